package chunkrpc_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/chunkrpc"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/opencontainers/go-digest"
)

// noNetwork is a transport that reaches nothing: the jailed process's.
type noNetwork struct{}

func (noNetwork) RoundTrip(*http.Request) (*http.Response, error) {
	return nil, errors.New("no network in the jail")
}

// entries returns the data entries of name in ls, and its layer's reader.
func entries(t *testing.T, ls []image.LayerReader, name string) (image.LayerReader, []*estargz.TOCEntry) {
	t.Helper()
	for i := len(ls) - 1; i >= 0; i-- {
		var ces []*estargz.TOCEntry
		for _, e := range ls[i].TOC.Entries {
			if e.Name == name && (e.Type == "reg" || e.Type == "chunk") {
				ces = append(ces, e)
			}
		}
		if len(ces) > 0 {
			return ls[i], ces
		}
	}
	t.Fatalf("no file %q", name)
	return image.LayerReader{}, nil
}

// A process that cannot reach the registry (the jailed VMM) reads a lazy
// image's chunks through its parent's socket: the parent fetches and
// stores them, the child reads them from the shared store; hostile
// requests are refused with errors naming what is wrong, and the server
// goes on serving.
func TestFetchThroughParent(t *testing.T) {
	ctx := context.Background()
	reg := imagetest.NewRegistry(t)
	img, _, err := imagetest.RandomImage(7, 12)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "r:v1", img)
	dir := t.TempDir()
	parent, err := image.Open(dir, image.Options{})
	if err != nil {
		t.Fatal(err)
	}
	rec, err := parent.Pull(ctx, ref, image.PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	roots := image.NewRoots(image.Options{})
	root, release, err := roots.Open(ctx, dir, rec.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	defer release()
	sock := filepath.Join(t.TempDir(), "vmm.sock.chunks")
	srv, err := chunkrpc.Listen(sock, os.Getuid(), os.Getgid(), root, 20*time.Second, nil)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("socket mode: %v %v, want 0600", fi.Mode(), err)
	}
	cl := chunkrpc.Client{Path: sock}

	child, err := image.Open(dir, image.Options{Transport: noNetwork{}, Fetcher: cl})
	if err != nil {
		t.Fatal(err)
	}
	crec, err := child.Get(rec.Manifest.String())
	if err != nil {
		t.Fatal(err)
	}
	ls, err := child.Layers(ctx, crec)
	if err != nil {
		t.Fatal(err)
	}
	lr, ces := entries(t, ls, "data/big.bin")
	reg.Reset()
	var got []byte
	for _, ce := range ces {
		buf := make([]byte, ce.ChunkSize)
		n, err := lr.Chunks.ReadChunk(ctx, ce, buf, 0)
		if err != nil {
			t.Fatalf("read through the parent: %v", err)
		}
		got = append(got, buf[:n]...)
	}
	want := imagetest.RandomFiles(7, "data", 12)[1].Body
	if !bytes.Equal(got, want) {
		t.Errorf("read %d bytes through the parent, not the file's %d", len(got), len(want))
	}
	if st := child.Fetched(); st.Requests != 0 {
		t.Errorf("the child made %d registry requests itself", st.Requests)
	}
	if reg.Stats().Bytes == 0 {
		t.Error("the registry served nothing: who fetched?")
	}

	// Hostile requests.
	ce := ces[0]
	good := image.ChunkRef{Offset: ce.Offset, InnerOffset: ce.InnerOffset, Digest: digest.Digest(ce.ChunkDigest)}
	many := make([]image.ChunkRef, image.MaxChunkRequest+1)
	for i := range many {
		many[i] = good
	}
	other := digest.FromString("another image")
	for _, c := range []struct {
		name string
		req  image.ChunkRequest
		want string
	}{
		{"another image", image.ChunkRequest{Manifest: other, Layer: lr.Layer.Digest, Chunks: []image.ChunkRef{good}}, "this root is"},
		{"no chunks", image.ChunkRequest{Manifest: rec.Manifest, Layer: lr.Layer.Digest}, "names 0 chunks"},
		{"too many", image.ChunkRequest{Manifest: rec.Manifest, Layer: lr.Layer.Digest, Chunks: many}, "want 1 to"},
		{"not a layer", image.ChunkRequest{Manifest: rec.Manifest, Layer: other, Chunks: []image.ChunkRef{good}}, "is not a layer"},
		{"not a chunk", image.ChunkRequest{Manifest: rec.Manifest, Layer: lr.Layer.Digest,
			Chunks: []image.ChunkRef{{Offset: good.Offset + 1, Digest: good.Digest}}}, "is not a chunk"},
		{"wrong digest", image.ChunkRequest{Manifest: rec.Manifest, Layer: lr.Layer.Digest,
			Chunks: []image.ChunkRef{{Offset: good.Offset, InnerOffset: good.InnerOffset, Digest: other}}}, "is not a chunk"},
	} {
		err := cl.FetchChunks(ctx, c.req)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want an error with %q", c.name, err, c.want)
		}
	}
	// Garbage and an endless request: the connection is dropped, the
	// server serves the next one.
	for _, junk := range [][]byte{[]byte("not json\n"), bytes.Repeat([]byte("["), 1<<20)} {
		conn, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		conn.Write(junk) // may fail once the server stops reading
		conn.Close()
	}
	if err := cl.FetchChunks(ctx, image.ChunkRequest{Manifest: rec.Manifest, Layer: lr.Layer.Digest, Chunks: []image.ChunkRef{good}}); err != nil {
		t.Errorf("a good request after junk: %v", err)
	}

	if err := srv.Close(); err != nil {
		t.Errorf("Close: %v", err)
	}
	if _, err := os.Lstat(sock); !os.IsNotExist(err) {
		t.Errorf("socket left after Close: %v", err)
	}
	// With the parent gone, a read of a chunk not stored fails (EIO), not hangs.
	lr2, ces2 := entries(t, ls, "etc/os-release")
	if child.Store().Has(digest.Digest(ces2[0].ChunkDigest)) {
		t.Fatal("os-release's chunk is stored already: nothing left to fetch")
	}
	_, err = lr2.Chunks.ReadChunk(ctx, ces2[0], make([]byte, 16), 0)
	if err == nil || !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), "through the parent") {
		t.Errorf("a read with the parent gone: %v, want EIO fetching through the parent", err)
	}
}

// countFetcher counts the requests that reach the fetcher.
type countFetcher struct{ n atomic.Int64 }

func (c *countFetcher) FetchChunks(context.Context, image.ChunkRequest) error {
	c.n.Add(1)
	return nil
}

// FuzzServer sends arbitrary bytes to the server as a (hostile) VMM
// process would: it never panics or hangs, reads at most its limit, and
// a well-formed request after it is served.
func FuzzServer(f *testing.F) {
	good := `{"method":"Chunks.Fetch","params":[{"manifest":"sha256:00","layer":"sha256:01","chunks":[{"offset":1,"innerOffset":0,"digest":"sha256:02"}]}],"id":1}`
	for _, s := range []string{good, "", "{", `{"method":"Chunks.Nope","params":[],"id":1}`, `{"method":"Chunks.Fetch","params":[1,2],"id":"x"}`,
		`{"method":"Chunks.Fetch","params":[{"chunks":[` + strings.Repeat(`{"offset":-1},`, 100) + `{}]}],"id":1}`} {
		f.Add([]byte(s))
	}
	dir := f.TempDir()
	var fake countFetcher
	srv, err := chunkrpc.Listen(filepath.Join(dir, "s"), os.Getuid(), os.Getgid(), &fake, 5*time.Second, nil)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { srv.Close() })
	f.Fuzz(func(t *testing.T, data []byte) {
		conn, err := net.Dial("unix", filepath.Join(dir, "s"))
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		conn.Write(data)
		conn.(*net.UnixConn).CloseWrite()
		io.Copy(io.Discard, conn) // the server answers or closes, within its timeout
		conn.Close()
		before := fake.n.Load()
		if err := (chunkrpc.Client{Path: filepath.Join(dir, "s")}).FetchChunks(context.Background(), image.ChunkRequest{Layer: "sha256:01"}); err != nil {
			t.Fatalf("a request after %q: %v", data, err)
		}
		if fake.n.Load() != before+1 {
			t.Fatal("the request after the fuzz input did not reach the fetcher")
		}
	})
}
