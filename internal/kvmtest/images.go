package kvmtest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
)

// TestImagesLayout names the OCI image layout make test-rootfs builds
// (tools/build-test-rootfs.sh, tools/testimage) under <cache>/test-rootfs.
const TestImagesLayout = "images-v3"

// TestImages returns the image tests' OCI layout: estargz images made from
// a debootstrap Debian root (python3, git). It fails the test when the
// layout is missing (make test-rootfs builds it): an image test never
// skips.
func TestImages(tb testing.TB) string {
	tb.Helper()
	cache, err := guestkernel.CacheDir()
	if err != nil {
		tb.Fatal(err)
	}
	dir := filepath.Join(cache, "test-rootfs", TestImagesLayout)
	if _, err := os.Stat(filepath.Join(dir, "index.json")); err != nil {
		tb.Fatalf("the image tests' images are missing (make test-rootfs builds them): %v", err)
	}
	return dir
}

// FidelityLayout names the fidelity tests' OCI layout under
// <cache>/test-rootfs: one image, FidelityImage.
const FidelityLayout = "fidelity-v2"

// FidelityImage is its image's name: a Debian root with systemd as
// /sbin/init, docker.io, iptables, python3 with pytest, and git.
const FidelityImage = "fidelity"

// FidelityImages returns the fidelity tests' OCI layout, failing the test
// when it is missing (make test-rootfs builds it).
func FidelityImages(tb testing.TB) string {
	tb.Helper()
	cache, err := guestkernel.CacheDir()
	if err != nil {
		tb.Fatal(err)
	}
	dir := filepath.Join(cache, "test-rootfs", FidelityLayout)
	if _, err := os.Stat(filepath.Join(dir, "index.json")); err != nil {
		tb.Fatalf("the fidelity image is missing (make test-rootfs builds it): %v", err)
	}
	return dir
}

// TestDisksDir names the folder of ext4 images of test images' trees that
// make test-rootfs builds under <cache>/test-rootfs (NAME.ext4).
const TestDisksDir = "ext4-v3"

// DebianDisk is the ext4 image of the debian-read test image's tree: the
// debootstrap Debian minbase root (python3, git; no kmod) and a data
// file, about 800 MB; open it read-only, it is shared.
const DebianDisk = "debian-read.ext4"

// TestDisk returns the ext4 image name (DebianDisk, busybox.ext4) in
// TestDisksDir, failing the test when it is missing (make test-rootfs
// builds it): a test that boots it never skips.
func TestDisk(tb testing.TB, name string) string {
	tb.Helper()
	cache, err := guestkernel.CacheDir()
	if err != nil {
		tb.Fatal(err)
	}
	p := filepath.Join(cache, "test-rootfs", TestDisksDir, name)
	if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() {
		tb.Fatalf("the test disk %s is missing (make test-rootfs builds it): %v", p, err)
	}
	return p
}
