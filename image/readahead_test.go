package image

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/opencontainers/go-digest"
)

// smallFilesImage is an estargz image of n small files of random bytes
// (1 to 8 KiB) in one layer, over the base layer, and the files' bodies.
func smallFilesImage(t *testing.T, n int) (*imagetest.Registry, string, map[string][]byte) {
	t.Helper()
	rng := rand.New(rand.NewPCG(7, 11))
	files := []imagetest.File{{Name: "src/", Type: '5'}}
	bodies := map[string][]byte{}
	for i := range n {
		b := make([]byte, 1024+rng.IntN(7*1024))
		for k := range b {
			b[k] = byte(rng.Uint32())
		}
		name := fmt.Sprintf("src/f%04d.go", i)
		files = append(files, imagetest.File{Name: name, Body: b})
		bodies[name] = b
	}
	img, _, err := imagetest.EstargzImage(imagetest.Tar(imagetest.BaseFiles()...), imagetest.Tar(files...))
	if err != nil {
		t.Fatal(err)
	}
	reg := imagetest.NewRegistry(t)
	return reg, reg.Push(t, "small:v1", img), bodies
}

// dataEntries are the regular files of a layer's TOC that have data, in
// the TOC's (the blob's) order.
func dataEntries(l LayerReader) []*estargz.TOCEntry {
	var out []*estargz.TOCEntry
	for _, e := range l.TOC.Entries {
		if e.Type == "reg" && e.Size > 0 && e.Name != estargz.NoPrefetchLandmark {
			out = append(out, e)
		}
	}
	return out
}

// A walk through a lazy layer in its order (git status, grep -r) reads
// ahead: a few requests for hundreds of files, every byte right. Reads
// here and there read nothing ahead: one request and one stored chunk
// each. A chunk read ahead that fails its check fails nobody's read and is
// not stored; reading it later fetches it again and gives EIO.
func TestReadahead(t *testing.T) {
	const n = 400
	reg, ref, bodies := smallFilesImage(t, n)
	ctx := context.Background()
	open := func() []LayerReader {
		t.Helper()
		im := openImages(t)
		rec, err := im.Pull(ctx, ref, PullOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ls, err := im.Layers(ctx, rec)
		if err != nil {
			t.Fatal(err)
		}
		return ls
	}
	read := func(l LayerReader, e *estargz.TOCEntry) error {
		got, err := readFile(ctx, l.Chunks, []*estargz.TOCEntry{e})
		if err != nil {
			return err
		}
		if !bytes.Equal(got, bodies[e.Name]) {
			return fmt.Errorf("%s: the bytes read are not the file's", e.Name)
		}
		return nil
	}

	t.Run("walk", func(t *testing.T) {
		ls := open()
		l := ls[len(ls)-1]
		ents := dataEntries(l)
		if len(ents) != n {
			t.Fatalf("%d files in the layer, want %d", len(ents), n)
		}
		reg.Reset()
		for _, e := range ents {
			if err := read(l, e); err != nil {
				t.Fatal(err)
			}
		}
		st := reg.Stats()
		t.Logf("a walk through %d files: %d requests, %d bytes", n, st.Requests, st.Bytes)
		if st.Requests > n/10 {
			t.Errorf("a walk through %d files took %d requests, want at most %d", n, st.Requests, n/10)
		}
		if max := l.Layer.Size; st.Bytes > max {
			t.Errorf("the walk fetched %d bytes of a %d-byte layer", st.Bytes, max)
		}
	})

	t.Run("scattered", func(t *testing.T) {
		ls := open()
		l := ls[len(ls)-1]
		ents := dataEntries(l)
		reg.Reset()
		picks := []int{300, 7, 150, 151 + 40, 20}
		for _, i := range picks {
			if err := read(l, ents[i]); err != nil {
				t.Fatal(err)
			}
		}
		if st := reg.Stats(); st.Requests != int64(len(picks)) {
			t.Errorf("%d scattered reads took %d requests, want %d", len(picks), st.Requests, len(picks))
		}
		stored := 0
		for _, e := range ents {
			if l.Chunks.im.st.Has(digest.Digest(e.ChunkDigest)) {
				stored++
			}
		}
		if stored != len(picks) {
			t.Errorf("%d scattered reads stored %d chunks", len(picks), stored)
		}
	})

	t.Run("bad chunk ahead", func(t *testing.T) {
		ls := open()
		l := ls[len(ls)-1]
		ents := dataEntries(l)
		// Two reads in order make the third one read ahead; the chunk
		// right after it is served with a flipped byte.
		bad := ents[3]
		undo := reg.FlipByte(l.Layer.Digest, bad.Offset+30)
		for _, e := range ents[:3] {
			if err := read(l, e); err != nil {
				t.Fatalf("a read before the bad chunk: %v", err)
			}
		}
		if l.Chunks.im.st.Has(digest.Digest(bad.ChunkDigest)) {
			t.Fatal("a chunk that failed its check was stored")
		}
		if !l.Chunks.im.st.Has(digest.Digest(ents[4].ChunkDigest)) {
			t.Fatal("the chunk after the bad one was not read ahead")
		}
		if err := read(l, bad); err == nil {
			t.Fatal("reading the bad chunk succeeded")
		}
		undo()
		if err := read(l, bad); err != nil {
			t.Fatalf("the chunk served right again: %v", err)
		}
	})
}
