package kvmtest

import (
	"bytes"
	"os"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/guestkernel"
)

func TestModulesInit(t *testing.T) {
	order := []guestkernel.Module{{Name: "virtio"}, {Name: "virtio_ring"}, {Name: "virtio_mmio", Depends: []string{"virtio", "virtio_ring"}}}
	s, err := modulesInit(order, "echo done\n")
	if err != nil {
		t.Fatal(err)
	}
	i1 := strings.Index(s, "insmod /lib/modules/virtio.ko ")
	i2 := strings.Index(s, "insmod /lib/modules/virtio_ring.ko ")
	i3 := strings.Index(s, "insmod /lib/modules/virtio_mmio.ko ")
	mount := strings.Index(s, "mount -t devtmpfs devtmpfs /dev")
	if mount < 0 || i1 < mount || i2 < i1 || i3 < i2 || !strings.HasSuffix(s, "\necho done\n") {
		t.Fatalf("init script out of order:\n%s", s)
	}
	if _, err := modulesInit([]guestkernel.Module{{Name: "x;reboot"}}, ""); err == nil {
		t.Fatal("a module name with shell syntax was accepted")
	}
}

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
