package virtio_test

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// blkGuestScript runs in the guest after the modules are loaded. It finds
// the disks by serial (GET_ID) and counts their hardware queues, checksums
// a file on the ext4 disk from vCPU 0, writes a new file there, checksums
// the read-only disk from vCPU 1 (so through its second queue) and tries to
// write it.
const blkGuestScript = `
echo "KILN-BLK-UPTIME start $(cat /proc/uptime)"
rw= ; ro=
i=0
while [ $i -lt 20 ]; do
	for d in /sys/block/vd*; do
		[ -e "$d/serial" ] || continue
		s=$(cat $d/serial)
		echo "KILN-BLK-DISK ${d##*/} serial=$s ro=$(cat $d/ro) sectors=$(cat $d/size)"
		case "$s" in
		kiln-rw) rw=/dev/${d##*/} ;;
		kiln-ro) ro=/dev/${d##*/} ;;
		esac
	done
	[ -n "$rw" ] && [ -n "$ro" ] && [ -b "$rw" ] && [ -b "$ro" ] && break
	rw= ; ro=
	i=$((i+1)); sleep 1
done
for d in $rw $ro; do
	echo "KILN-BLK-MQ ${d##*/} $(ls /sys/block/${d##*/}/mq | wc -l) $(cat /sys/block/${d##*/}/mq/*/cpu_list | tr '\n' ' ')"
done
mkdir -p /mnt/rw
if mount -t ext4 "$rw" /mnt/rw; then
	echo "KILN-BLK-SUM $(busybox taskset 1 busybox sha256sum /mnt/rw/random.bin)"
	echo 'written by the guest through virtio-blk' > /mnt/rw/guest.txt
	umount /mnt/rw && echo KILN-BLK-UMOUNT=ok
else
	echo KILN-BLK-MOUNT=failed
fi
sync
echo "KILN-BLK-ROSUM $(busybox taskset 2 dd if=$ro bs=4096 2>/dev/null | busybox sha256sum)"
if dd if=/dev/zero of=$ro bs=512 count=1 conv=fsync 2>/dev/null; then
	echo KILN-BLK-ROWRITE=succeeded
else
	echo KILN-BLK-ROWRITE=failed
fi
echo "KILN-BLK-UPTIME end $(cat /proc/uptime)"
dmesg | grep -E 'Run /init|Freeing unused kernel|virtio_blk|virtio-mmio|EXT4-fs|clocksource: Switched|ACPI: Interpreter' | sed 's/^/KILN-BLK-DMESG /'
echo KILN-BLK-DONE
poweroff -f
`

// TestKVMVirtioBlock boots Debian's kernel, 2 vCPUs, with two virtio-blk
// disks of two request queues each (VIRTIO_BLK_F_MQ): an ext4 image it
// reads a file from and writes a file to, and a read-only raw image it
// reads from the second vCPU and fails to write. The host then checks the checksums the
// guest printed, the guest's file in the ext4 image (with debugfs) and that
// the read-only image did not change.
func TestKVMVirtioBlock(t *testing.T) {
	kvmtest.Require(t)
	k := kvmtest.Kernel(t)
	if k.Vmlinux == "" {
		t.Fatal("the kernel cache has no vmlinux (make kernel extracts it)")
	}
	for _, tool := range []string{"mke2fs", "debugfs", "e2fsck"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s not found (install e2fsprogs): %v", tool, err)
		}
	}
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(1, 2))
	random := make([]byte, 1<<20+123)
	for i := range random {
		random[i] = byte(rng.Uint32())
	}
	content := filepath.Join(dir, "content")
	if err := os.Mkdir(content, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(content, "random.bin"), random, 0o644); err != nil {
		t.Fatal(err)
	}
	rwImg := filepath.Join(dir, "rw.img")
	if out, err := exec.Command("mke2fs", "-q", "-F", "-t", "ext4", "-d", content, rwImg, "16M").CombinedOutput(); err != nil {
		t.Fatalf("mke2fs: %v: %s", err, out)
	}
	roData := make([]byte, 256<<10)
	for i := range roData {
		roData[i] = byte(rng.Uint32())
	}
	roImg := filepath.Join(dir, "ro.img")
	if err := os.WriteFile(roImg, roData, 0o644); err != nil {
		t.Fatal(err)
	}

	rw := virtio.DeviceSpec{ID: "rw", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: rwImg, Serial: "kiln-rw", Queues: 2}}
	ro := virtio.DeviceSpec{ID: "ro", Kind: virtio.KindBlock, Block: &virtio.BlockSpec{Path: roImg, ReadOnly: true, Serial: "kiln-ro", Queues: 2}}

	initrd := kvmtest.ModulesInitrd(t, []string{"virtio_mmio", "virtio_blk", "crc32c_generic", "ext4"}, blkGuestScript)
	var console kvmtest.Console
	vm, err := vmm.New(vmm.Config{
		Spec:    vmm.Spec{Kernel: k.Vmlinux, Initrd: initrd, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: 2, MemoryMiB: 256, Devices: []virtio.DeviceSpec{rw, ro}},
		Console: &console,
	})
	if err != nil {
		t.Fatalf("vmm.New: %v", err)
	}
	defer vm.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	start := time.Now()
	exit, err := vm.Run(ctx)
	t.Logf("guest ran %v", time.Since(start).Round(time.Millisecond))
	if err != nil {
		t.Fatalf("Run: %v; console:\n%s", err, console.String())
	}
	if err := vm.Close(); err != nil { // and its disks
		t.Errorf("closing the VM: %v", err)
	}
	out := console.String()
	if exit.Reason != vmm.ReasonPowerOff || !strings.Contains(out, "KILN-BLK-DONE") {
		t.Fatalf("guest stopped with %v before finishing; console:\n%s", exit, out)
	}
	for _, d := range regexp.MustCompile(`KILN-BLK-(DISK|UPTIME|DMESG|MQ) .*`).FindAllString(out, -1) {
		t.Log(strings.TrimSpace(d))
	}
	// Each disk has two hardware queues, one per vCPU.
	if mq := regexp.MustCompile(`KILN-BLK-MQ vd[a-z]+ 2 0 1 `).FindAllString(out, -1); len(mq) != 2 {
		t.Errorf("want both disks with 2 queues, one per vCPU (KILN-BLK-MQ vdX 2 0 1); console:\n%s", out)
	}

	sum := func(b []byte) string { s := sha256.Sum256(b); return hex.EncodeToString(s[:]) }
	if m := regexp.MustCompile(`KILN-BLK-SUM ([0-9a-f]{64})`).FindStringSubmatch(out); m == nil {
		t.Errorf("the guest printed no checksum of random.bin (mount failed?); console:\n%s", out)
	} else if m[1] != sum(random) {
		t.Errorf("guest read random.bin with sha256 %s, want %s", m[1], sum(random))
	}
	if !strings.Contains(out, "KILN-BLK-UMOUNT=ok") {
		t.Error("the guest could not unmount the ext4 disk")
	}
	if m := regexp.MustCompile(`KILN-BLK-ROSUM ([0-9a-f]{64})`).FindStringSubmatch(out); m == nil {
		t.Error("the guest printed no checksum of the read-only disk")
	} else if m[1] != sum(roData) {
		t.Errorf("guest read the read-only disk with sha256 %s, want %s", m[1], sum(roData))
	}
	if !strings.Contains(out, "KILN-BLK-ROWRITE=failed") {
		t.Errorf("writing the read-only disk did not fail in the guest; console:\n%s", out)
	}

	got, err := exec.Command("debugfs", "-R", "cat /guest.txt", rwImg).Output()
	if err != nil {
		t.Fatalf("debugfs: %v", err)
	}
	if want := "written by the guest through virtio-blk\n"; string(got) != want {
		t.Errorf("guest.txt in the image holds %q, want %q", got, want)
	}
	if out, err := exec.Command("e2fsck", "-fn", rwImg).CombinedOutput(); err != nil {
		t.Errorf("e2fsck of the image the guest wrote: %v\n%s", err, out)
	}
	after, err := os.ReadFile(roImg)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(after, roData) {
		t.Error("the read-only image changed")
	}
}
