package image

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"io"
	"io/fs"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/opencontainers/go-digest"

	"github.com/kilnvm/kiln/image/imagetest"
)

// TestRoots opens a two-layer image (a file whited out on top, a file
// replaced) as a root: the merged tree reads through the lazy layers, one
// tree is shared by every hold, and the last release unpins it.
func TestRoots(t *testing.T) {
	top := imagetest.Tar(
		imagetest.File{Name: "etc/", Type: tar.TypeDir},
		imagetest.File{Name: "etc/.wh.hostname"},
		imagetest.File{Name: "etc/os-release", Body: []byte("NAME=upper\n")},
		imagetest.File{Name: "srv/", Type: tar.TypeDir},
		imagetest.File{Name: "srv/big.bin", Body: bytes.Repeat([]byte("0123456789abcdef"), 1<<19)}, // 8 MiB: two chunks
	)
	img, _, err := imagetest.EstargzImage(imagetest.Tar(imagetest.BaseFiles()...), top)
	if err != nil {
		t.Fatal(err)
	}
	reg := imagetest.NewRegistry(t)
	ref := reg.Push(t, "root:v1", img)
	im := openImages(t)
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	rs := NewRoots(Options{})
	r1, release1, err := rs.Open(ctx, im.Dir(), rec.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	r2, release2, err := rs.Open(ctx, im.Dir(), rec.Manifest)
	if err != nil {
		t.Fatal(err)
	}
	if r1 != r2 {
		t.Error("two holds of one image got two trees")
	}
	tr := r1.Tree
	if _, err := tr.Resolve("/etc/hostname"); !errors.Is(err, syscall.ENOENT) {
		t.Errorf("whited-out /etc/hostname: %v, want ENOENT", err)
	}
	read := func(path string, off int64, n int) []byte {
		t.Helper()
		ino, err := tr.Resolve(path)
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, n)
		got, err := tr.ReadAt(ctx, ino, buf, off)
		if err != nil && !errors.Is(err, io.EOF) {
			t.Fatalf("%s: %v", path, err)
		}
		return buf[:got]
	}
	if got := read("/etc/os-release", 0, 100); string(got) != "NAME=upper\n" {
		t.Errorf("os-release %q", got)
	}
	// Across the chunk boundary of the 8 MiB file.
	if got := read("/srv/big.bin", 4<<20-8, 16); string(got) != "89abcdef01234567" {
		t.Errorf("big.bin across chunks: %q", got)
	}
	release1()
	release1() // idempotent
	if rs.open[rootKey{im.Dir(), rec.Manifest}] == nil {
		t.Fatal("root closed while a hold remains")
	}
	release2()
	if len(rs.open) != 0 {
		t.Errorf("%d roots open after every release", len(rs.open))
	}
	if _, _, err := rs.Open(ctx, im.Dir(), "sha256:nothex"); err == nil {
		t.Error("Open took a malformed digest")
	}
	if _, _, err := rs.Open(ctx, im.Dir(), digest.Digest("sha256:"+strings.Repeat("0", 64))); !errors.Is(err, ErrNotFound) {
		t.Errorf("Open of an unknown image: %v, want ErrNotFound", err)
	}
}

// An open root pins its image in this process: a GC after the image's name
// is removed keeps its TOCs and the chunks read so far; once the root is
// closed, GC takes them.
func TestOpenRootPinsImage(t *testing.T) {
	img, _, err := imagetest.EstargzImage(imagetest.Tar(imagetest.BaseFiles()...),
		imagetest.Tar(imagetest.File{Name: "srv/", Type: tar.TypeDir}, imagetest.File{Name: "srv/a.txt", Body: []byte("pinned bytes")}))
	if err != nil {
		t.Fatal(err)
	}
	reg := imagetest.NewRegistry(t)
	ref := reg.Push(t, "pin:v1", img)
	im := openImages(t)
	ctx := context.Background()
	rec, err := im.Pull(ctx, ref, PullOptions{})
	if err != nil {
		t.Fatal(err)
	}
	root, err := im.OpenRoot(ctx, rec.Manifest.String())
	if err != nil {
		t.Fatal(err)
	}
	ino, err := root.Tree.Resolve("/srv/a.txt")
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if n, err := root.Tree.ReadAt(ctx, ino, buf, 0); string(buf[:n]) != "pinned bytes" {
		t.Fatalf("read %q, %v", buf[:n], err)
	}
	if _, err := im.Remove(rec.Name); err != nil {
		t.Fatal(err)
	}
	blobs := func() int {
		t.Helper()
		n := 0
		err := filepath.WalkDir(filepath.Join(im.Dir(), "store", "blobs"), func(_ string, d fs.DirEntry, err error) error {
			if err == nil && d.Type().IsRegular() {
				n++
			}
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := blobs()
	res, err := im.GC(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Removed) != 0 || blobs() != before {
		t.Errorf("GC of a pinned image removed %d blobs (%d of %d left)", len(res.Removed), blobs(), before)
	}
	if n, err := root.Tree.ReadAt(ctx, ino, buf, 0); string(buf[:n]) != "pinned bytes" {
		t.Fatalf("read after GC %q, %v", buf[:n], err)
	}
	root.Close()
	if res, err = im.GC(ctx); err != nil || len(res.Removed) == 0 {
		t.Errorf("GC after the root closed removed %d blobs, %v", len(res.Removed), err)
	}
}
