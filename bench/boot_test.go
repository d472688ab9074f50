package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
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
	ib, err := initramfs.BusyboxInit(BootScript)
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
	_, kk, kb := PhaseMedians(c.KilnPhases)
	_, qk, qb := PhaseMedians(c.PeerPhases)
	b.ReportMetric(float64(kk.Microseconds())/1000, "kiln-kernel-ms")
	b.ReportMetric(float64(kb.Microseconds())/1000, "kiln-before-kernel-ms")
	b.ReportMetric(float64(qk.Microseconds())/1000, "qemu-kernel-ms")
	b.ReportMetric(float64(qb.Microseconds())/1000, "qemu-before-kernel-ms")
}

func TestParseInitLine(t *testing.T) {
	tests := []struct {
		log  string
		want time.Duration
		ok   bool
	}{
		{"KILN-BENCH-READY\r\nKILN-BENCH-INIT [    0.812345] Run /init as init process\r\n", 812345 * time.Microsecond, true},
		{"junk KILN-BENCH-INIT [12.5] Run /init as init process", 12500 * time.Millisecond, true},
		{"KILN-BENCH-INIT \n", 0, false},                         // no log line: dmesg found nothing
		{"KILN-BENCH-INIT [  -1.0] Run /init", 0, false},         // negative
		{"KILN-BENCH-INIT [NaN] Run /init", 0, false},            // not a time
		{"KILN-BENCH-INIT [1e300] Run /init", 0, false},          // absurd
		{"KILN-BENCH-INIT [    0.5 Run /init as init", 0, false}, // no bracket
		{"KILN-BENCH-INIT [" + strings.Repeat("1", 40) + "]", 0, false},
		{"", 0, false},
	}
	for _, tt := range tests {
		got, ok := parseInitLine(tt.log)
		if got != tt.want || ok != tt.ok {
			t.Errorf("parseInitLine(%q) = %v, %v; want %v, %v", tt.log, got, ok, tt.want, tt.ok)
		}
	}
}

func TestBootPhases(t *testing.T) {
	s := time.Second
	ps := []BootPhases{
		{Total: 10 * s, Setup: 1 * s, Kernel: 6 * s},
		{Total: 12 * s, Setup: 3 * s, Kernel: 7 * s},
		{Total: 11 * s, Setup: 2 * s}, // no kernel line
		{Total: 5 * s, Kernel: 9 * s}, // a kernel time past the total: not trusted
		{Total: 30 * s, Kernel: 29 * s},
	}
	if got := ps[0].BeforeKernel(); got != 4*s {
		t.Errorf("BeforeKernel = %v, want 4s", got)
	}
	if got := ps[2].BeforeKernel(); got != 0 {
		t.Errorf("BeforeKernel without a kernel time = %v, want 0", got)
	}
	if got := ps[3].BeforeKernel(); got != 0 {
		t.Errorf("BeforeKernel with kernel > total = %v, want 0", got)
	}
	setup, kernel, before := PhaseMedians(ps)
	if setup != 2*s || kernel != 7*s || before != 4*s { // kernels 6, 7, 29; befores 4, 5, 1
		t.Errorf("PhaseMedians = %v, %v, %v; want 2s, 7s, 4s", setup, kernel, before)
	}
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
