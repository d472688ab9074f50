package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/image/store"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// bigImage is built once per test binary: building 64 MiB of estargz
// under -race takes a while.
var bigImage = sync.OnceValues(func() (v1.Image, error) {
	img, _, err := imagetest.RandomImage(1, 64)
	return img, err
})

func mustBig(t *testing.T) v1.Image {
	t.Helper()
	img, err := bigImage()
	if err != nil {
		t.Fatal(err)
	}
	return img
}

// file finds a file's data entries in a layer list, top layer first.
func file(t *testing.T, ls []LayerReader, name string) (*ChunkReader, []*estargz.TOCEntry) {
	t.Helper()
	for i := len(ls) - 1; i >= 0; i-- {
		var ces []*estargz.TOCEntry
		for _, e := range ls[i].TOC.Entries {
			if e.Name == name && (e.Type == "reg" || e.Type == "chunk") {
				ces = append(ces, e)
			}
		}
		if len(ces) > 0 {
			return ls[i].Chunks, ces
		}
	}
	t.Fatalf("no file %q in the layers", name)
	return nil, nil
}

// readFile reads a whole file through its chunks.
func readFile(ctx context.Context, cr *ChunkReader, ces []*estargz.TOCEntry) ([]byte, error) {
	var out []byte
	for _, ce := range ces {
		buf := make([]byte, ce.ChunkSize)
		n, err := cr.ReadChunk(ctx, ce, buf, 0)
		if err != nil {
			return nil, err
		}
		out = append(out, buf[:n]...)
	}
	return out, nil
}

func layerBlob(t *testing.T, img v1.Image, i int) (v1.Hash, int64) {
	t.Helper()
	ls, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	d, _ := ls[i].Digest()
	n, _ := ls[i].Size()
	return d, n
}

// A pull of a 64 MiB estargz image fetches footers and TOCs only; a small
// file costs at most one chunk, 4 KiB of a big file exactly one chunk,
// and a second read, in this Images or another on the same folder (a VMM
// process), costs nothing.
func TestLazyPullAndRead(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	img := mustBig(t)
	ref := reg.Push(t, "big:v1", img)
	dataBlob, dataSize := layerBlob(t, img, 1)
	if dataSize < 64<<20 {
		t.Fatalf("data layer of %d bytes, want at least 64 MiB", dataSize)
	}
	reg.Reset()
	im := openImages(t)
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pulled := reg.BlobStats(dataBlob).Bytes
	t.Logf("pull: %d of %d bytes of the data layer (%.3f%%), %d requests in all", pulled, dataSize,
		100*float64(pulled)/float64(dataSize), reg.Stats().Requests)
	if pulled > dataSize/100 {
		t.Errorf("pull fetched %d bytes of a %d-byte layer (over 1%%)", pulled, dataSize)
	}
	for _, l := range rec.Layers {
		if l.Chunks != ChunksRegistry || l.TOC == "" || l.TOCOffset <= 0 || im.Store().Has(l.Digest) {
			t.Errorf("layer record %+v (blob stored: %v)", l, im.Store().Has(l.Digest))
		}
	}
	if rec.Repo != reg.Host+"/big" || !rec.PlainHTTP {
		t.Errorf("repo %q plain %v", rec.Repo, rec.PlainHTTP)
	}
	ls, err := im.Layers(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}

	// A small file of the base layer: at most one chunk's member.
	cr, ces := file(t, ls, "etc/os-release")
	before := reg.Stats().Bytes
	got, err := readFile(ctx, cr, ces)
	if err != nil || string(got) != "NAME=kiln-test\nID=kiln\n" {
		t.Fatalf("os-release: %q, %v", got, err)
	}
	if cost, member := reg.Stats().Bytes-before, ces[0].NextOffset(); cost > 64<<10 {
		t.Errorf("a 23-byte file cost %d registry bytes (%d)", cost, member)
	}

	// 4 KiB in the middle of the 32 MiB file: one chunk, one request.
	cr, ces = file(t, ls, "data/big.bin")
	if len(ces) != 8 {
		t.Fatalf("big.bin has %d chunks, want 8", len(ces))
	}
	ce := ces[3]
	f0, b0 := im.Fetched(), reg.BlobStats(dataBlob).Bytes
	buf := make([]byte, 4096)
	if n, err := cr.ReadChunk(ctx, ce, buf, 100); err != nil || n != 4096 {
		t.Fatalf("ReadChunk: %d, %v", n, err)
	}
	f1 := im.Fetched()
	if f1.Requests-f0.Requests != 1 {
		t.Errorf("4 KiB took %d requests, want 1", f1.Requests-f0.Requests)
	}
	if served := reg.BlobStats(dataBlob).Bytes - b0; served < ce.ChunkSize || served > ce.ChunkSize+64<<10 {
		t.Errorf("4 KiB of a chunk of %d bytes cost %d registry bytes", ce.ChunkSize, served)
	}
	if !im.Store().Has(digest.Digest(ce.ChunkDigest)) {
		t.Error("the fetched chunk is not stored")
	}
	for _, other := range ces {
		if other != ce && im.Store().Has(digest.Digest(other.ChunkDigest)) {
			t.Error("a chunk that was not read is stored")
		}
	}
	// The second read is free, here and in another process's Images.
	b1 := reg.Stats()
	if _, err := cr.ReadChunk(ctx, ce, make([]byte, 4096), 5000); err != nil {
		t.Fatal(err)
	}
	im2, err := Open(im.Dir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	rec2, err := im2.Get(rec.Manifest.String())
	if err != nil {
		t.Fatal(err)
	}
	ls2, err := im2.Layers(ctx, rec2)
	if err != nil {
		t.Fatal(err)
	}
	cr2, ces2 := file(t, ls2, "data/big.bin")
	buf2 := make([]byte, 4096)
	if _, err := cr2.ReadChunk(ctx, ces2[3], buf2, 100); err != nil || !bytes.Equal(buf, buf2) {
		t.Fatalf("second process: %v (same bytes: %v)", err, bytes.Equal(buf, buf2))
	}
	if d := reg.Stats(); d != b1 || im2.Fetched() != (FetchStats{}) {
		t.Errorf("second reads cost %d requests, %d bytes", d.Requests-b1.Requests, d.Bytes-b1.Bytes)
	}
	// The bytes are the file's: a whole read matches the source tar.
	want := imagetest.RandomFiles(1, "data", 64)[1].Body
	if !bytes.Equal(buf, want[3*imagetest.ChunkSize+100:3*imagetest.ChunkSize+100+4096]) {
		t.Error("the bytes read are not the file's")
	}
	// Past the chunk's end: io.EOF, a short read at the end.
	if n, err := cr.ReadChunk(ctx, ce, buf, ce.ChunkSize-10); n != 10 || err != io.EOF {
		t.Errorf("read at the end: %d, %v", n, err)
	}
}

// Two images sharing a base layer: its chunks are fetched and stored once.
func TestSharedBaseChunksOnce(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	a, _, err := imagetest.RandomImage(2, 1)
	if err != nil {
		t.Fatal(err)
	}
	b, _, err := imagetest.RandomImage(3, 1)
	if err != nil {
		t.Fatal(err)
	}
	base, _ := layerBlob(t, a, 0)
	if bb, _ := layerBlob(t, b, 0); bb != base {
		t.Fatal("the images do not share their base layer")
	}
	refA, refB := reg.Push(t, "a:v1", a), reg.Push(t, "b:v1", b)
	im := openImages(t)
	ctx := context.Background()
	for _, ref := range []string{refA, refB} {
		rec, err := im.Pull(ctx, ref, PullOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ls, err := im.Layers(ctx, rec)
		if err != nil {
			t.Fatal(err)
		}
		for _, name := range []string{"bin/busybox", "etc/os-release", "etc/hostname"} {
			cr, ces := file(t, ls, name)
			if _, err := readFile(ctx, cr, ces); err != nil {
				t.Fatalf("%s: %s: %v", ref, name, err)
			}
		}
	}
	// Footer/TOC once, then chunk GETs for the first image only.
	st := reg.BlobStats(base)
	if st.Requests > 2+3 {
		t.Errorf("base layer: %d GETs for two images (want ≤ 1 TOC read and 3 chunks)", st.Requests)
	}
	n := 0
	ents, _ := os.ReadDir(filepath.Join(im.Dir(), "store", "blobs", "sha256"))
	for range ents {
		n++
	}
	// 2 manifests, 2 configs, 3 TOCs, 3 base chunks.
	if n != 10 {
		t.Errorf("%d blobs in the store, want 10", n)
	}
}

// A flipped byte in a chunk's compressed bytes: EIO, nothing stored; once
// the registry serves the right bytes, the read succeeds.
func TestFlippedByte(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	img, _, err := imagetest.RandomImage(4, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "flip:v1", img)
	im := openImages(t)
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ls, err := im.Layers(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	cr, ces := file(t, ls, "data/f000.bin")
	blob, _ := layerBlob(t, img, 1)
	for _, at := range []int64{100, 5000} {
		undo := reg.FlipByte(blob, ces[0].Offset+at)
		_, err = cr.ReadChunk(ctx, ces[0], make([]byte, 10), 0)
		var de *store.DigestError
		if !errors.Is(err, syscall.EIO) || !errors.As(err, &de) || !strings.Contains(err.Error(), "data/f000.bin") {
			t.Errorf("flip at +%d: %v, want EIO with a DigestError naming the file", at, err)
		}
		if im.Store().Has(digest.Digest(ces[0].ChunkDigest)) {
			t.Error("a chunk that failed its check was stored")
		}
		undo()
	}
	got, err := readFile(ctx, cr, ces)
	if err != nil || !bytes.Equal(got, imagetest.RandomFiles(4, "data", 1)[1].Body) {
		t.Errorf("after the fault: %v", err)
	}
}

// A registry that fails chunk GETs: EIO, retried transient failures, and
// a read that works once the registry does.
func TestFailingRegistry(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	img, _, err := imagetest.RandomImage(12, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "fail:v1", img)
	im := openImages(t)
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ls, err := im.Layers(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	cr, ces := file(t, ls, "data/f000.bin")
	blob, _ := layerBlob(t, img, 1)
	for _, tc := range []struct {
		status       int
		wantRequests int64 // 1 + retries of a transient failure
	}{
		{http.StatusInternalServerError, 3},
		{http.StatusTooManyRequests, 3},
		{http.StatusNotFound, 1},
		{http.StatusForbidden, 1},
	} {
		undo := reg.Fail(blob, tc.status)
		before := im.Fetched().Requests
		_, err := cr.ReadChunk(ctx, ces[0], make([]byte, 10), 0)
		if !errors.Is(err, syscall.EIO) || !strings.Contains(err.Error(), fmt.Sprint(tc.status)) {
			t.Errorf("HTTP %d: got %v, want EIO naming the status", tc.status, err)
		}
		if n := im.Fetched().Requests - before; n != tc.wantRequests {
			t.Errorf("HTTP %d: %d requests, want %d", tc.status, n, tc.wantRequests)
		}
		undo()
	}
	if _, err := readFile(ctx, cr, ces); err != nil {
		t.Errorf("after the failures: %v", err)
	}
}

// A manifest whose TOC annotation is not the layer's TOC: Pull fails
// naming the layer and both digests.
func TestWrongTOCAnnotation(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	l, err := imagetest.Estargz(imagetest.Tar(imagetest.BaseFiles()...))
	if err != nil {
		t.Fatal(err)
	}
	real := l.TOC
	l.TOC = digest.FromString("not the TOC")
	img, err := imagetest.Image(l)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "wrongtoc:v1", img)
	im := openImages(t)
	_, err = im.Pull(context.Background(), ref, PullOptions{})
	d, _ := l.Digest()
	var me *TOCMismatchError
	if !errors.As(err, &me) || !errors.Is(err, ErrInvalid) {
		t.Fatalf("got %v, want a TOCMismatchError", err)
	}
	for _, want := range []string{d.String(), real.String(), l.TOC.String()} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %s", err, want)
		}
	}
	if list, _ := im.List(); len(list) != 0 {
		t.Errorf("the image was added: %v", list)
	}
}

// A registry that stops answering mid-chunk fails the read within the
// deadline, with an error the guest sees as EIO.
func TestStalledRegistry(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	img, _, err := imagetest.RandomImage(5, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "stall:v1", img)
	im, err := Open(t.TempDir(), Options{GCGrace: -1, FetchTimeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ls, err := im.Layers(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	cr, ces := file(t, ls, "data/f000.bin")
	blob, _ := layerBlob(t, img, 1)
	release := reg.Stall(blob, ces[0].Offset+1000)
	defer release()
	start := time.Now()
	_, err = cr.ReadChunk(ctx, ces[0], make([]byte, 10), 0)
	if !errors.Is(err, syscall.EIO) || !errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("got %v, want EIO and DeadlineExceeded", err)
	}
	if el := time.Since(start); el > 3*time.Second {
		t.Errorf("the read failed after %s, with a 300ms deadline", el)
	}
	release()
	if _, err := cr.ReadChunk(ctx, ces[0], make([]byte, 10), 0); err != nil {
		t.Errorf("after the stall: %v", err)
	}
}

// Concurrent reads of one chunk fetch it once.
func TestConcurrentReadsOneFetch(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	img, _, err := imagetest.RandomImage(6, 1)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "conc:v1", img)
	im := openImages(t)
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ls, err := im.Layers(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	cr, ces := file(t, ls, "data/f000.bin")
	blob, _ := layerBlob(t, img, 1)
	release := reg.Stall(blob, ces[0].Offset+10) // hold the first fetch until all readers wait
	before := im.Fetched()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			_, err := cr.ReadChunk(ctx, ces[0], make([]byte, 100), 0)
			errs <- err
		})
	}
	time.Sleep(200 * time.Millisecond)
	release()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if n := im.Fetched().Requests - before.Requests; n != 1 {
		t.Errorf("8 concurrent reads made %d requests, want 1", n)
	}
	if n := reg.BlobStats(blob).Requests; n > 3 { // tail, (TOC), the chunk
		t.Errorf("%d GETs of the layer", n)
	}
}

// A plain gzip layer is indexed at pull time: all its chunks are stored,
// reads need no registry, GC keeps them; lazily fetched chunks are a
// cache that GC holds under the cap.
func TestIndexedPlainLayer(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	files := append(imagetest.BaseFiles(), imagetest.RandomFiles(7, "plain", 10)...)
	plain, err := imagetest.Gzip(imagetest.Tar(files...))
	if err != nil {
		t.Fatal(err)
	}
	lazy, err := imagetest.Estargz(imagetest.Tar(imagetest.RandomFiles(8, "lazy", 2)...))
	if err != nil {
		t.Fatal(err)
	}
	img, err := imagetest.Image(plain, lazy)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "mixed:v1", img)
	dir := t.TempDir()
	im, err := Open(dir, Options{GCGrace: -1, Store: store.Options{MaxBytes: 1}})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Layers[0].Chunks != ChunksStore || rec.Layers[1].Chunks != ChunksRegistry {
		t.Fatalf("layers %+v", rec.Layers)
	}
	ls, err := im.Layers(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range ls[0].Chunks.ix.chunks {
		if !im.Store().Has(c.digest) {
			t.Errorf("chunk %s of %q not stored", c.digest, c.file)
		}
	}
	if im.Store().Has(rec.Layers[0].Digest) {
		t.Error("the compressed plain layer was kept")
	}
	// Read the lazy layer's file so that its chunks are cached.
	cr, ces := file(t, ls, "lazy/f000.bin")
	if _, err := readFile(ctx, cr, ces); err != nil {
		t.Fatal(err)
	}
	lazyChunk := digest.Digest(ces[0].ChunkDigest)
	res, err := im.GC(ctx) // cap of 1 byte: only the cache goes
	if err != nil {
		t.Fatal(err)
	}
	if im.Store().Has(lazyChunk) {
		t.Errorf("GC under the cap kept a lazily fetched chunk: %+v", res)
	}
	reg.Reset()
	for _, name := range []string{"plain/big.bin", "plain/f004.bin", "bin/busybox", "etc/os-release"} {
		cr, ces := file(t, ls, name)
		got, err := readFile(ctx, cr, ces)
		if err != nil {
			t.Fatalf("%s after GC: %v", name, err)
		}
		for _, f := range files {
			if f.Name == name && !bytes.Equal(f.Body, got) {
				t.Errorf("%s: wrong bytes", name)
			}
		}
	}
	if st := reg.Stats(); st.Requests != 0 {
		t.Errorf("reading an indexed layer cost %d requests", st.Requests)
	}
	for _, d := range []digest.Digest{rec.Manifest, rec.Config, rec.Layers[0].TOC, rec.Layers[1].TOC} {
		if !im.Store().Has(d) {
			t.Errorf("GC removed %s", d)
		}
	}
	// The lazy chunk comes back from the registry.
	if _, err := readFile(ctx, cr, ces); err != nil || !im.Store().Has(lazyChunk) {
		t.Errorf("refetch after eviction: %v", err)
	}
	// A second pull indexes nothing again.
	reg.Reset()
	if _, err := im.Pull(ctx, ref, PullOptions{}); err != nil {
		t.Fatal(err)
	}
	pd, _ := plain.Digest()
	if n := reg.BlobStats(pd).Requests; n != 0 {
		t.Errorf("re-pull fetched the indexed layer %d times", n)
	}
	// Removed and collected: nothing is left.
	if _, err := im.Remove(ref); err != nil {
		t.Fatal(err)
	}
	res, err = im.GC(ctx)
	if err != nil || res.Blobs != 0 {
		t.Errorf("GC after rm: %+v, %v", res, err)
	}
}

// Indexing a tar gives the TOC estargz would write for it: the same entry
// fields and the same chunk digests.
func TestIndexMatchesEstargz(t *testing.T) {
	files := append(imagetest.BaseFiles(),
		imagetest.File{Name: "dev/", Type: tar.TypeDir},
		imagetest.File{Name: "dev/null", Type: tar.TypeChar, Mode: 0o666, Devmajor: 1, Devminor: 3},
		imagetest.File{Name: "dev/sda", Type: tar.TypeBlock, Mode: 0o660, Devmajor: 8, GID: 6},
		imagetest.File{Name: "run/fifo", Type: tar.TypeFifo},
		imagetest.File{Name: "bin/ping", Mode: 0o755, Body: []byte("ping"), Xattrs: map[string]string{"security.capability": "\x01\x00\x00\x02"}},
		imagetest.File{Name: "empty", Body: nil, UID: 1000, GID: 1000},
		imagetest.File{Name: "etc/.wh.hostname"},
		imagetest.File{Name: "exact4m", Body: bytes.Repeat([]byte("x"), 4<<20)},
	)
	files = append(files, imagetest.RandomFiles(9, "r", 9)...)
	tb := imagetest.Tar(files...)
	esgz, err := imagetest.Estargz(tb)
	if err != nil {
		t.Fatal(err)
	}
	want, _, err := parseTOCFromBlob(esgz.Blob, esgz.TOC)
	if err != nil {
		t.Fatal(err)
	}
	st, err := store.Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ix, err := indexTar(context.Background(), st, bytes.NewReader(tb))
	if err != nil {
		t.Fatal(err)
	}
	got, gix, err := parseTOC(ix.toc, -1)
	if err != nil {
		t.Fatal(err)
	}
	// estargz.Build adds its landmark file first; the rest is the tar's.
	var wantEnts []*estargz.TOCEntry
	for _, e := range want.Entries {
		if e.Name != estargz.NoPrefetchLandmark && e.Name != estargz.PrefetchLandmark {
			wantEnts = append(wantEnts, e)
		}
	}
	if len(got.Entries) != len(wantEnts) {
		t.Fatalf("%d entries, estargz has %d", len(got.Entries), len(wantEnts))
	}
	for i, g := range got.Entries {
		w := *wantEnts[i]
		gg := *g
		w.Offset, w.InnerOffset, gg.Offset, gg.InnerOffset = 0, 0, 0, 0
		if fmt.Sprintf("%+v", gg) != fmt.Sprintf("%+v", w) {
			t.Errorf("entry %d:\n got %+v\nwant %+v", i, gg, w)
		}
	}
	for _, c := range gix.chunks {
		if !st.Has(c.digest) {
			t.Errorf("chunk of %q not stored", c.file)
		}
	}
	// Deterministic: indexing again gives the same TOC digest.
	ix2, err := indexTar(context.Background(), st, bytes.NewReader(tb))
	if err != nil || ix2.tocDgt != ix.tocDgt || ix.diffID != digest.FromBytes(tb) {
		t.Errorf("second index: %v, %s vs %s; diff ID %s", err, ix2.tocDgt, ix.tocDgt, ix.diffID)
	}
}

// parseTOCFromBlob reads an estargz blob's TOC as a pull does.
func parseTOCFromBlob(blob []byte, want digest.Digest) (*estargz.JTOC, *tocIndex, error) {
	data, off, err := openTOC(context.Background(), bytesRange(blob), int64(len(blob)), want)
	if err != nil {
		return nil, nil, err
	}
	return parseTOC(data, off)
}

type bytesRange []byte

func (b bytesRange) Range(_ context.Context, off, n int64) ([]byte, error) {
	return bytes.Clone(b[off : off+n]), nil
}

// An index.json of version 1 (layers kept whole): listed as before, not
// runnable until pulled again.
func TestIndexVersion1(t *testing.T) {
	im := openImages(t)
	d := "sha256:" + strings.Repeat("a", 64)
	os.WriteFile(filepath.Join(im.Dir(), "index.json"), []byte(fmt.Sprintf(
		`{"version":1,"images":[{"name":"old","ref":"index.docker.io/library/old:latest","manifest":%q,"config":%q,"layers":[{"digest":%q,"size":3}],"size":9}]}`, d, d, d)), 0o644)
	list, err := im.List()
	if err != nil || len(list) != 1 {
		t.Fatalf("list: %v, %v", list, err)
	}
	if _, err := im.Layers(context.Background(), &list[0]); !errors.Is(err, ErrStale) || !strings.Contains(err.Error(), "pull or import it again") {
		t.Errorf("Layers of an old record: %v", err)
	}
	os.WriteFile(filepath.Join(im.Dir(), "index.json"), []byte(`{"version":3,"images":[]}`), 0o644)
	if _, err := im.List(); err == nil || !strings.Contains(err.Error(), "newer kiln") {
		t.Errorf("version 3: %v", err)
	}
}

func TestParseTOCBad(t *testing.T) {
	d := "sha256:" + strings.Repeat("a", 64)
	entry := func(s string) string { return `{"version":1,"entries":[` + s + `]}` }
	for _, tc := range []struct {
		name, json, want string
		limit            int64
	}{
		{"not JSON", `{"version":1,"entries":[`, "TOC JSON", -1},
		{"trailing", `{"version":1,"entries":[]} {}`, "data after", -1},
		{"version", `{"version":2,"entries":[]}`, "version 2", -1},
		{"null entry", entry(`null`), "null", -1},
		{"type", entry(`{"name":"x","type":"sock"}`), `unknown type "sock"`, -1},
		{"chunk first", entry(`{"name":"x","type":"chunk","chunkSize":1}`), "follows no file", -1},
		{"no digest", entry(`{"name":"x","type":"reg","size":5,"offset":10}`), "chunk digest", -1},
		{"bad digest", entry(`{"name":"x","type":"reg","size":5,"offset":10,"chunkDigest":"sha256:../x"}`), "chunk digest", -1},
		{"short chunks", entry(fmt.Sprintf(`{"name":"x","type":"reg","size":10,"offset":10,"chunkSize":4,"chunkDigest":%q}`, d)), "cover 4 of its 10", -1},
		{"gap", entry(fmt.Sprintf(`{"name":"x","type":"reg","size":10,"offset":10,"chunkSize":4,"chunkDigest":%q},{"type":"chunk","offset":20,"chunkOffset":5,"chunkDigest":%q}`, d, d)), "want 4", -1},
		{"overrun", entry(fmt.Sprintf(`{"name":"x","type":"reg","size":10,"offset":10,"chunkSize":20,"chunkDigest":%q}`, d)), "chunk of 20", -1},
		{"huge chunk", entry(fmt.Sprintf(`{"name":"x","type":"reg","size":1000000000,"offset":10,"chunkDigest":%q}`, d)), "at most", -1},
		{"negative", entry(`{"name":"x","type":"reg","size":-1}`), "negative", -1},
		{"past TOC", entry(fmt.Sprintf(`{"name":"x","type":"reg","size":5,"offset":100,"chunkDigest":%q}`, d)), "past the TOC", 50},
		{"offset twice", entry(fmt.Sprintf(`{"name":"x","type":"reg","size":5,"offset":10,"chunkDigest":%q},{"name":"y","type":"reg","size":5,"offset":10,"chunkDigest":%q}`, d, d)), "used twice", -1},
		{"symlink", entry(`{"name":"x","type":"symlink"}`), "without a target", -1},
		{"NUL", entry(`{"name":"x\u0000y","type":"dir"}`), "NUL", -1},
		{"giant", `{"version":1,"entries":[` + strings.Repeat(" ", maxTOCBytes) + `]}`, "at most", -1},
	} {
		_, _, err := parseTOC([]byte(tc.json), tc.limit)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: got %v, want an error naming %q", tc.name, err, tc.want)
		}
	}
}

func FuzzParseTOC(f *testing.F) {
	d := "sha256:" + strings.Repeat("b", 64)
	f.Add([]byte(fmt.Sprintf(`{"version":1,"entries":[{"name":"./a/","type":"dir"},{"name":"a/f","type":"reg","size":10,"offset":30,"chunkSize":4,"chunkDigest":%q},{"type":"chunk","offset":60,"chunkOffset":4,"chunkDigest":%q},{"name":"l","type":"hardlink","linkName":"a/f"}]}`, d, d)), int64(100))
	f.Add([]byte(`{"version":1,"entries":[]}`), int64(-1))
	f.Fuzz(func(t *testing.T, data []byte, limit int64) {
		toc, ix, err := parseTOC(data, limit)
		if err != nil {
			return
		}
		for _, c := range ix.chunks {
			if c.size <= 0 || c.size > maxChunkSize || c.size != c.ent.ChunkSize || c.ent.Name != c.file {
				t.Fatalf("chunk %+v", c)
			}
			if _, err := store.ParseDigest(string(c.digest)); err != nil {
				t.Fatalf("digest %q accepted", c.digest)
			}
			if limit > 0 && (c.end > limit || c.end <= c.ent.Offset) {
				t.Fatalf("chunk [%d, %d) with limit %d", c.ent.Offset, c.end, limit)
			}
			if got, err := ix.lookup(c.ent); err != nil || got != c {
				t.Fatalf("lookup: %v", err)
			}
			// Readahead walks the blob order: every chunk in it, at its pos.
			if limit > 0 && (c.pos >= len(ix.inBlob) || ix.inBlob[c.pos] != c) {
				t.Fatalf("chunk at %d is not at its place %d in blob order", c.ent.Offset, c.pos)
			}
		}
		for i := 1; i < len(ix.inBlob); i++ {
			if ix.inBlob[i].ent.Offset < ix.inBlob[i-1].ent.Offset {
				t.Fatalf("blob order: offset %d after %d", ix.inBlob[i].ent.Offset, ix.inBlob[i-1].ent.Offset)
			}
		}
		for _, e := range toc.Entries {
			if strings.HasPrefix(e.Name, "/") || strings.Contains("/"+e.Name+"/", "/../") {
				t.Fatalf("name %q not cleaned", e.Name)
			}
		}
	})
}

// A layer blob is recognised as gzip, zstd or a bare tar, and all three
// index to the same TOC.
func TestDecompressKinds(t *testing.T) {
	tb := imagetest.Tar(imagetest.BaseFiles()...)
	var gz, zs bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tb)
	zw.Close()
	ze, err := zstd.NewWriter(&zs)
	if err != nil {
		t.Fatal(err)
	}
	ze.Write(tb)
	ze.Close()
	st, err := store.Open(t.TempDir(), store.Options{})
	if err != nil {
		t.Fatal(err)
	}
	var want digest.Digest
	for _, tc := range []struct {
		name string
		blob []byte
	}{{"tar", tb}, {"gzip", gz.Bytes()}, {"zstd", zs.Bytes()}} {
		r, err := decompress(bytes.NewReader(tc.blob))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		ix, err := indexTar(context.Background(), st, r)
		r.Close()
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if want == "" {
			want = ix.tocDgt
		}
		if ix.tocDgt != want || ix.diffID != digest.FromBytes(tb) {
			t.Errorf("%s: TOC %s (want %s), diff ID %s", tc.name, ix.tocDgt, want, ix.diffID)
		}
	}
	// Not a tar at all.
	r, _ := decompress(strings.NewReader("plain text, not a layer"))
	if _, err := indexTar(context.Background(), st, r); !errors.Is(err, ErrInvalid) {
		t.Errorf("text: %v", err)
	}
}
