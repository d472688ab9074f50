package kvmtest

import (
	"bytes"
	"os"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
)

func TestModulesInitrd(t *testing.T) {
	if _, err := guestkernel.Find(); err != nil {
		t.Skipf("no cached kernel: %v", err)
	}
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("busybox-static not installed")
	}
	p := ModulesInitrd(t, []string{"virtio_mmio", "virtio-rng"}, "echo hi\n")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	// newc headers carry the names in the clear; the init script is stored
	// uncompressed.
	for _, want := range []string{"lib/modules/virtio.ko", "lib/modules/virtio_ring.ko", "lib/modules/virtio_mmio.ko", "lib/modules/virtio_rng.ko", "insmod /lib/modules/virtio_rng.ko"} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("initrd lacks %q", want)
		}
	}
}
