package bench

import (
	"context"
	"fmt"
	"os/exec"
	"regexp"
	"strconv"
	"time"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// BlkReadScript is the guest side of the disk benchmark: it reads the whole
// first virtio disk once with dd and prints how long that took.
const BlkReadScript = `
start=$(cat /proc/uptime | cut -d' ' -f1)
dd if=/dev/vda of=/dev/null bs=1M 2>/dev/null
end=$(cat /proc/uptime | cut -d' ' -f1)
echo "KILN-BLK-READ start=$start end=$end"
poweroff -f
`

var blkReadRE = regexp.MustCompile(`KILN-BLK-READ start=([0-9.]+) end=([0-9.]+)`)

// parseBlkRead returns the guest-measured read time from the console.
func parseBlkRead(console string) (time.Duration, error) {
	m := blkReadRE.FindStringSubmatch(console)
	if m == nil {
		return 0, fmt.Errorf("no KILN-BLK-READ line in the console")
	}
	start, err1 := strconv.ParseFloat(m[1], 64)
	end, err2 := strconv.ParseFloat(m[2], 64)
	if err1 != nil || err2 != nil || end < start {
		return 0, fmt.Errorf("bad KILN-BLK-READ line %q", m[0])
	}
	return time.Duration((end - start) * float64(time.Second)), nil
}

// BlkReadKiln boots s on Kiln with image as a read-only virtio-blk disk and
// returns the guest-measured time to read it all.
func BlkReadKiln(ctx context.Context, s BootSpec, image string) (time.Duration, error) {
	disk := virtio.DeviceSpec{ID: "disk", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: image, ReadOnly: true}}
	w := newMarkerWriter()
	vm, err := vmm.New(vmm.Config{
		Spec:      vmm.Spec{Kernel: s.Kernel, Initrd: s.Initrd, Cmdline: s.Cmdline, CPUs: s.CPUs, MemoryMiB: s.MemoryMiB, Devices: []virtio.DeviceSpec{disk}},
		Console:   w,
		HoldProcs: s.HoldProcs,
	})
	if err != nil {
		return 0, err
	}
	defer vm.Close()
	exit, err := vm.Run(ctx)
	if err != nil {
		return 0, err
	}
	if exit.Reason != vmm.ReasonPowerOff {
		return 0, fmt.Errorf("kiln guest ended with %v: %s", exit, w.tail())
	}
	return parseBlkRead(w.log.String())
}

// BlkReadQEMU does the same on QEMU microvm with a virtio-mmio disk.
func BlkReadQEMU(ctx context.Context, qemu string, s BootSpec, image string) (time.Duration, error) {
	w := newMarkerWriter()
	args := append(QEMUArgs(s), "-drive", "file="+image+",format=raw,if=none,id=d0,readonly=on",
		"-device", "virtio-blk-device,drive=d0")
	cmd := exec.CommandContext(ctx, qemu, args...)
	cmd.Stdout, cmd.Stderr = w, w
	if err := cmd.Run(); err != nil {
		return 0, fmt.Errorf("qemu: %w: %s", err, w.tail())
	}
	return parseBlkRead(w.log.String())
}
