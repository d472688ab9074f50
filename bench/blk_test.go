package bench

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/vmm"
)

const blkImageMiB = DefaultBlkMiB

// BenchmarkBlockRead reads a 64 MiB virtio-blk disk sequentially in the guest
// (dd, 1 MiB blocks) on Kiln and on QEMU microvm, b.N times each, and
// reports MB/s medians and their ratio. Run it with a fixed count:
// go test -run '^$' -bench BlockRead -benchtime 3x ./bench
func BenchmarkBlockRead(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		b.Skip("qemu-system-x86_64 not installed (make deps)")
	}
	k := kvmtest.Kernel(b)
	dir := b.TempDir()
	image := filepath.Join(dir, "disk.img")
	if err := WriteRandomDisk(image, blkImageMiB); err != nil {
		b.Fatal(err)
	}
	initrd := filepath.Join(dir, "initrd.cpio")
	if err := ModulesInitrd(k, BlkModules, BlkReadScript, initrd, nil); err != nil {
		b.Fatal(err)
	}
	s := BootSpec{Kernel: k.Vmlinux, Initrd: initrd, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: 1, MemoryMiB: 512}
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	var c Comparison
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		kd, err := BlkReadKiln(ctx, s, image)
		if err != nil {
			b.Fatalf("kiln: %v", err)
		}
		qd, err := BlkReadQEMU(ctx, qemu, s, image)
		if err != nil {
			b.Fatalf("qemu: %v", err)
		}
		c.Kiln, c.Peer = append(c.Kiln, kd), append(c.Peer, qd)
		b.Logf("run %d: kiln %v, qemu %v for %d MiB", i+1, kd, qd, blkImageMiB)
	}
	mbps := func(d time.Duration) float64 { return float64(blkImageMiB) / d.Seconds() }
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(mbps(Median(c.Kiln)), "kiln-MiB/s")
	b.ReportMetric(mbps(Median(c.Peer)), "qemu-MiB/s")
	b.ReportMetric(mbps(Median(c.Kiln))/mbps(Median(c.Peer)), "kiln/qemu-throughput")
}

func TestParseBlkRead(t *testing.T) {
	tests := []struct {
		console string
		want    time.Duration
		ok      bool
	}{
		{"boot\nKILN-BLK-READ start=10.50 end=12.75\n", 2250 * time.Millisecond, true},
		{"nothing here", 0, false},
		{"KILN-BLK-READ start=5.0 end=4.0", 0, false},
	}
	for _, tt := range tests {
		d, err := parseBlkRead(tt.console)
		if (err == nil) != tt.ok || d != tt.want {
			t.Errorf("parseBlkRead(%q) = %v, %v", tt.console, d, err)
		}
	}
}
