package image

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/opencontainers/go-digest"
)

// Converting a plain image twice gives the same digests; pushed, the
// result pulls lazily and reads back the source's bytes.
func TestConvertDeterministic(t *testing.T) {
	reg := imagetest.NewRegistry(t)
	files := append(imagetest.BaseFiles(), imagetest.RandomFiles(11, "data", 9)...)
	base, err := imagetest.Gzip(imagetest.Tar(imagetest.BaseFiles()...))
	if err != nil {
		t.Fatal(err)
	}
	top, err := imagetest.Gzip(imagetest.Tar(files[len(imagetest.BaseFiles()):]...))
	if err != nil {
		t.Fatal(err)
	}
	src, err := imagetest.Image(base, top)
	if err != nil {
		t.Fatal(err)
	}
	ref := reg.Push(t, "plain:v1", src)
	im := openImages(t)
	ctx := context.Background()
	if _, err := im.Pull(ctx, ref, PullOptions{}); err != nil {
		t.Fatal(err)
	}
	blobsBefore := countBlobs(t, im)
	var out bytes.Buffer
	a, err := im.Convert(ctx, ref, ConvertOptions{Progress: NewProgress(&out)})
	if err != nil {
		t.Fatal(err)
	}
	if a.Name != ref+"-esgz" {
		t.Errorf("default name %q", a.Name)
	}
	if !strings.Contains(out.String(), "converting") {
		t.Errorf("progress: %q", out.String())
	}
	b, err := im.Convert(ctx, ref, ConvertOptions{Name: "again:v1"})
	if err != nil {
		t.Fatal(err)
	}
	if a.Manifest != b.Manifest || a.Config != b.Config {
		t.Errorf("two converts: %s and %s", a.Manifest, b.Manifest)
	}
	for i := range a.Layers {
		if a.Layers[i] != b.Layers[i] || a.Layers[i].Chunks != ChunksStore {
			t.Errorf("layer %d: %+v and %+v", i, a.Layers[i], b.Layers[i])
		}
	}
	// Same chunks as the source: only manifest, config, two TOCs and the
	// one-byte chunk of estargz.Build's ".no.prefetch.landmark" more.
	if n := countBlobs(t, im); n != blobsBefore+5 {
		t.Errorf("%d blobs after converting, want %d", n, blobsBefore+5)
	}
	d, err := im.Inspect("again:v1")
	if err != nil || d.Config.Cmd[0] != "/bin/sh" || d.Platform != "linux/amd64" {
		t.Errorf("inspect: %+v, %v", d, err)
	}

	// Pushed: the same digest, and a lazy pull reads the files back.
	dest := reg.Host + "/esgz:v1"
	c, err := im.Convert(ctx, ref, ConvertOptions{Push: dest})
	if err != nil {
		t.Fatal(err)
	}
	if c.Manifest != a.Manifest || c.Name != dest || c.Layers[0].Chunks != ChunksRegistry {
		t.Errorf("pushed: %+v", c)
	}
	im2 := openImages(t)
	rec, err := im2.Pull(ctx, dest, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if rec.Manifest != a.Manifest {
		t.Errorf("pulled %s, pushed %s", rec.Manifest, a.Manifest)
	}
	raw, err := os.ReadFile(filepath.Join(im2.Dir(), "store", "blobs", "sha256", rec.Manifest.Encoded()))
	if err != nil || !strings.Contains(string(raw), estargz.TOCJSONDigestAnnotation) {
		t.Errorf("manifest without TOC annotations: %s", raw)
	}
	ls, err := im2.Layers(ctx, rec)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range rec.Layers {
		if l.Chunks != ChunksRegistry {
			t.Errorf("converted layer pulled as %q", l.Chunks)
		}
	}
	for _, f := range files {
		if f.Type != 0 || len(f.Body) == 0 {
			continue
		}
		cr, ces := file(t, ls, f.Name)
		got, err := readFile(ctx, cr, ces)
		if err != nil || !bytes.Equal(got, f.Body) {
			t.Errorf("%s: %v (equal %v)", f.Name, err, bytes.Equal(got, f.Body))
		}
	}
	// The setuid bit and the symlink survive.
	for _, e := range ls[0].TOC.Entries {
		if e.Name == "bin/busybox" && e.Mode&0o4000 == 0 {
			t.Errorf("busybox mode %o", e.Mode)
		}
		if e.Name == "bin/sh" && (e.Type != "symlink" || e.LinkName != "busybox") {
			t.Errorf("bin/sh: %+v", e)
		}
	}
	// The source's chunks and the converted image's are the same.
	srcRec, _ := im.Get(ref)
	srcLs, err := im.Layers(ctx, srcRec)
	if err != nil {
		t.Fatal(err)
	}
	chunks := map[digest.Digest]bool{}
	for _, c := range srcLs[1].Chunks.ix.chunks {
		chunks[c.digest] = true
	}
	for _, c := range ls[1].Chunks.ix.chunks {
		if !chunks[c.digest] && c.file != estargz.NoPrefetchLandmark {
			t.Errorf("converted chunk %s of %q is not a source chunk", c.digest, c.file)
		}
	}
}

func TestConvertErrors(t *testing.T) {
	im := openImages(t)
	ctx := context.Background()
	for _, tc := range []struct {
		ref  string
		opts ConvertOptions
		want string
	}{
		{"Bad:Ref", ConvertOptions{}, "image reference"},
		{"127.0.0.1:1/absent:v1", ConvertOptions{}, "pulling"},
	} {
		if _, err := im.Convert(ctx, tc.ref, tc.opts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Convert(%q) = %v, want an error naming %q", tc.ref, err, tc.want)
		}
	}
}

func countBlobs(t *testing.T, im *Images) int {
	t.Helper()
	ents, err := os.ReadDir(filepath.Join(im.Dir(), "store", "blobs", "sha256"))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}
