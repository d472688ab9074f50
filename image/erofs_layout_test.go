package image_test

import (
	"context"
	"testing"
	"time"

	"github.com/kilnvm/kiln/erofs/erofstest"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// TestEROFSLayoutOfTestImages lays out every image the image tests run
// (make test-rootfs's OCI layout: a debootstrap Debian root with python3
// and git, its variants, busybox, and go-repo: Go's src/ as a git
// repository on top of that root) as a sandbox's root does, and checks the
// layout with tools that share no code with package erofs: Debian's
// fsck.erofs on the image, and go-erofs walking it against the image's
// merged tree (every path both ways, modes with setuid bits, owners,
// sizes, link counts, mtimes, devices, link targets, xattrs, every name
// looked up). The bytes of every file are compared in debian and busybox;
// the other images add layers of random files to theirs, which the
// laziness tests never read (and the suite need not fetch).
func TestEROFSLayoutOfTestImages(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	reg, refs := imagetest.ServeLayout(t, kvmtest.TestImages(t), "kiln/test")
	defer reg.Close()
	roots := image.NewRoots(image.Options{})
	dir := t.TempDir()
	im, err := roots.Images(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(refs) == 0 {
		t.Fatal("the test layout has no images")
	}
	for name, ref := range refs {
		t.Run(name, func(t *testing.T) {
			img, err := im.Pull(ctx, ref, image.PullOptions{})
			if err != nil {
				t.Fatalf("pull %s: %v", ref, err)
			}
			r, release, err := roots.Open(ctx, dir, img.Manifest)
			if err != nil {
				t.Fatal(err)
			}
			defer release()
			start := time.Now()
			layout, err := r.EROFS(ctx)
			if err != nil {
				t.Fatalf("EROFS: %v", err)
			}
			t.Logf("%s: %d inodes, metadata %d KiB, image %d MiB, laid out in %v", name, layout.Inodes(),
				layout.MetadataSize()>>10, layout.Size()>>20, time.Since(start).Round(time.Millisecond))
			if again, _ := r.EROFS(ctx); again != layout {
				t.Error("Root.EROFS laid the tree out twice")
			}
			if err := erofstest.Fsck(ctx, layout, t.TempDir(), false); err != nil {
				t.Fatal(err)
			}
			bytes := name == "debian" || name == "busybox"
			st, err := erofstest.Compare(ctx, layout, r.Tree, erofstest.Options{Bytes: func(string, int64) bool { return bytes }})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("%s: go-erofs agrees on %d paths, %d files, %d MiB compared", name, st.Paths, st.Files, st.BytesCompared>>20)
			if st.Files == 0 || (bytes && st.BytesCompared == 0) {
				t.Errorf("compared %d files, %d bytes: nothing checked", st.Files, st.BytesCompared)
			}
		})
	}
}
