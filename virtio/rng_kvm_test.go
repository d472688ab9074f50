package virtio_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// TestKVMVirtioRNG boots Debian's kernel with a virtio-rng device behind the
// virtio-mmio transport (found through the ACPI DSDT), loads virtio_mmio and
// virtio-rng, and reads the host's entropy through /dev/hwrng: this needs
// the whole path to work, from feature negotiation to the level-triggered
// interrupt that completes each request.
func TestKVMVirtioRNG(t *testing.T) {
	kvmtest.Require(t)
	k := kvmtest.Kernel(t)
	if k.Vmlinux == "" {
		t.Fatal("the kernel cache has no vmlinux (make kernel extracts it)")
	}
	initrd := kvmtest.ModulesInitrd(t, []string{"virtio_mmio", "virtio_rng"}, `
echo "KILN-RNG current=$(cat /sys/class/misc/hw_random/rng_current)"
hex=$(timeout 60 dd if=/dev/hwrng bs=64 count=1 2>/dev/null | /bin/busybox od -An -tx1 | tr -d ' \n')
echo "KILN-RNG bytes=$hex"
grep virtio /proc/interrupts | sed 's/^/KILN-RNG irq /'
echo KILN-RNG done
poweroff -f
`)
	var out kvmtest.Console
	start := time.Now()
	vm, err := vmm.New(vmm.Config{
		Spec:    vmm.Spec{Kernel: k.Vmlinux, Initrd: initrd, CPUs: 1, MemoryMiB: 256, Devices: []virtio.DeviceSpec{{ID: "rng", Kind: virtio.KindRNG, RNG: &virtio.RNGSpec{}}}},
		Console: &out,
	})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	exit, err := vm.Run(ctx)
	t.Logf("guest ran %v", time.Since(start).Round(time.Millisecond))
	console := out.String()
	if err != nil || exit.Reason != vmm.ReasonPowerOff {
		t.Fatalf("stopped with %v, %v; console:\n%s", exit, err, console)
	}
	if !strings.Contains(console, "KILN-RNG done") {
		t.Fatalf("the script did not finish; console:\n%s", console)
	}
	if m := regexp.MustCompile(`KILN-RNG current=(\S*)`).FindStringSubmatch(console); m == nil || !strings.HasPrefix(m[1], "virtio_rng") {
		t.Errorf("rng_current is not virtio_rng: %q; console:\n%s", m, console)
	}
	m := regexp.MustCompile(`KILN-RNG bytes=([0-9a-f]*)`).FindStringSubmatch(console)
	if m == nil || len(m[1]) != 128 || m[1] == strings.Repeat("0", 128) {
		t.Fatalf("did not read 64 random bytes from /dev/hwrng: %q; console:\n%s", m, console)
	}
	for _, line := range strings.Split(console, "\n") {
		if strings.HasPrefix(line, "KILN-RNG") {
			t.Log(strings.TrimSpace(line))
		}
	}
}
