package kvmtest

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
)

// TestImagesLayout names the OCI image layout make test-rootfs builds
// (tools/build-test-rootfs.sh, tools/testimage) under <cache>/test-rootfs.
const TestImagesLayout = "images-v2"

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
