package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/vmm"
)

// benchSpec builds the guest both VMMs boot: Debian's kernel and a busybox
// initramfs that prints Marker and powers off.
func benchSpec(b *testing.B) BootSpec {
	b.Helper()
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	k, err := guestkernel.Find()
	if err != nil {
		b.Skip(err)
	}
	ib, err := initramfs.BusyboxInit("echo " + Marker + "\npoweroff -f\n")
	if err != nil {
		b.Fatal(err)
	}
	path := filepath.Join(b.TempDir(), "initrd.cpio")
	f, err := os.Create(path)
	if err != nil {
		b.Fatal(err)
	}
	if _, err := ib.WriteTo(f); err != nil {
		b.Fatal(err)
	}
	f.Close()
	return BootSpec{Kernel: k.Image, Initrd: path, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: 1, MemoryMiB: 256}
}

// BenchmarkBoot boots to userspace on Kiln and on QEMU microvm, alternating,
// b.N times each, and reports both medians and their ratio. Run it with a
// fixed count: go test -run '^$' -bench Boot -benchtime 5x ./bench
func BenchmarkBoot(b *testing.B) {
	s := benchSpec(b)
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		b.Skip("qemu-system-x86_64 not installed (make deps)")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	b.ResetTimer()
	c, err := CompareBoot(ctx, qemu, s, b.N, nil)
	if err != nil {
		b.Fatal(err)
	}
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(float64(Median(c.Kiln).Microseconds())/1000, "kiln-ms")
	b.ReportMetric(float64(Median(c.Peer).Microseconds())/1000, "qemu-ms")
	b.ReportMetric(c.Ratio(), "kiln/qemu")
}

func TestMedianAndRatio(t *testing.T) {
	ms := time.Millisecond
	tests := []struct {
		kiln, peer []time.Duration
		median     time.Duration
		ratio      float64
	}{
		{[]time.Duration{3 * ms, 1 * ms, 2 * ms}, []time.Duration{4 * ms}, 2 * ms, 0.5},
		{[]time.Duration{1 * ms, 3 * ms}, []time.Duration{2 * ms, 2 * ms}, 2 * ms, 1},
		{nil, nil, 0, 0},
	}
	for _, tt := range tests {
		c := Comparison{Kiln: tt.kiln, Peer: tt.peer}
		if m := Median(tt.kiln); m != tt.median {
			t.Errorf("Median(%v) = %v, want %v", tt.kiln, m, tt.median)
		}
		if r := c.Ratio(); r != tt.ratio {
			t.Errorf("Ratio = %v, want %v", r, tt.ratio)
		}
	}
}

func TestMarkerWriterSplitAcrossWrites(t *testing.T) {
	w := newMarkerWriter()
	w.Write([]byte("boot... KILN-BE"))
	select {
	case <-w.seen:
		t.Fatal("marker seen too early")
	default:
	}
	w.Write([]byte("NCH-READY\n"))
	select {
	case <-w.seen:
	default:
		t.Fatal("marker split across two writes was missed")
	}
}
