package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/vmm"
)

// vsockInitrd is the benchmark's initramfs: the modules for virtio-mmio
// vsock, VsockEchoScript, and /vsockecho.
func vsockInitrd(b *testing.B) string {
	b.Helper()
	echo := kvmtest.VsockEchoBinary(b)
	initrd := filepath.Join(b.TempDir(), "initrd.cpio")
	if err := ModulesInitrd(kvmtest.Kernel(b), VsockModules, VsockEchoScript, initrd, map[string]string{"vsockecho": echo}); err != nil {
		b.Fatal(err)
	}
	return initrd
}

// BenchmarkVsock echoes 8 MiB through one vsock connection (written and
// read concurrently) and makes 200 one-byte round trips on another, on Kiln
// (userspace virtio-vsock on a Unix socket) and on QEMU microvm
// (vhost-vsock, host side AF_VSOCK), alternating, b.N boots each. It
// reports the medians of MiB/s and of the per-boot median round trip, and
// Kiln's over QEMU's. Run it with a fixed count:
// go test -run '^$' -bench Vsock -benchtime 3x ./bench
func BenchmarkVsock(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		b.Skip("qemu-system-x86_64 not installed (make deps)")
	}
	if _, err := os.Stat("/dev/vhost-vsock"); err != nil {
		b.Skipf("QEMU's vhost-vsock needs /dev/vhost-vsock (modprobe vhost_vsock): %v", err)
	}
	k := kvmtest.Kernel(b)
	if k.Vmlinux == "" {
		b.Fatal("the kernel cache has no vmlinux (make kernel extracts it)")
	}
	s := BootSpec{Kernel: k.Vmlinux, Initrd: vsockInitrd(b), Cmdline: vmm.DefaultCmdline + " quiet", CPUs: 1, MemoryMiB: 512}
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	var echo, rtt Comparison
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		kr, err := VsockKiln(ctx, s, b.TempDir())
		if err != nil {
			b.Fatalf("kiln run %d: %v", i+1, err)
		}
		qr, err := VsockQEMU(ctx, qemu, s)
		if err != nil {
			b.Fatalf("qemu run %d: %v", i+1, err)
		}
		echo.Kiln, echo.Peer = append(echo.Kiln, kr.Echo), append(echo.Peer, qr.Echo)
		rtt.Kiln, rtt.Peer = append(rtt.Kiln, Median(kr.RTTs)), append(rtt.Peer, Median(qr.RTTs))
		b.Logf("run %d: kiln %.2f MiB/s (%d MiB echoed in %v), rtt median %v (min %v, max %v), ready after %v",
			i+1, kr.MiBps(), VsockEchoBytes>>20, kr.Echo.Round(time.Millisecond),
			Median(kr.RTTs), minDuration(kr.RTTs), maxDuration(kr.RTTs), kr.Ready.Round(time.Millisecond))
		b.Logf("run %d: qemu %.2f MiB/s (%d MiB echoed in %v), rtt median %v (min %v, max %v), ready after %v",
			i+1, qr.MiBps(), VsockEchoBytes>>20, qr.Echo.Round(time.Millisecond),
			Median(qr.RTTs), minDuration(qr.RTTs), maxDuration(qr.RTTs), qr.Ready.Round(time.Millisecond))
	}
	mibps := func(d time.Duration) float64 { return VsockResult{Echo: d}.MiBps() }
	us := func(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
	kt, qt := mibps(Median(echo.Kiln)), mibps(Median(echo.Peer))
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(kt, "kiln-MiB/s")
	b.ReportMetric(qt, "qemu-MiB/s")
	if qt > 0 {
		b.ReportMetric(kt/qt, "kiln/qemu-throughput")
	}
	b.ReportMetric(us(Median(rtt.Kiln)), "kiln-rtt-us")
	b.ReportMetric(us(Median(rtt.Peer)), "qemu-rtt-us")
	b.ReportMetric(rtt.Ratio(), "kiln/qemu-rtt")
}

func minDuration(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	m := ds[0]
	for _, d := range ds[1:] {
		m = min(m, d)
	}
	return m
}

func maxDuration(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	m := ds[0]
	for _, d := range ds[1:] {
		m = max(m, d)
	}
	return m
}

func TestParseOKLine(t *testing.T) {
	tests := []struct {
		line string
		want uint32
		ok   bool
	}{
		{"OK 1073741824\n", 1 << 30, true},
		{"OK 0\n", 0, true},
		{"OK 4294967295\n", 1<<32 - 1, true},
		{"OK 4294967296\n", 0, false},
		{"OK 12", 0, false},
		{"OK \n", 0, false},
		{"OK -1\n", 0, false},
		{"ok 5\n", 0, false},
		{"FAILED\n", 0, false},
		{"", 0, false},
	}
	for _, tt := range tests {
		got, err := parseOKLine(tt.line)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("parseOKLine(%q) = %d, %v; want %d, ok=%v", tt.line, got, err, tt.want, tt.ok)
		}
	}
}

func FuzzParseOKLine(f *testing.F) {
	for _, s := range []string{"OK 1073741824\n", "OK \n", "", "OK 99999999999999999999\n"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		port, err := parseOKLine(line)
		if err != nil {
			return
		}
		digits, ok := strings.CutPrefix(line, "OK ")
		digits, ok2 := strings.CutSuffix(digits, "\n")
		if !ok || !ok2 || digits == "" || strings.Trim(digits, "0123456789") != "" {
			t.Fatalf("parseOKLine(%q) accepted a line that is not \"OK <digits>\\n\"", line)
		}
		if strings.TrimLeft(digits, "0") != strings.TrimLeft(fmt.Sprint(port), "0") {
			t.Fatalf("parseOKLine(%q) = %d", line, port)
		}
	})
}

// TestMeasureVsock runs the host side of the benchmark against an echo
// server on a Unix socket pair: the readiness retries, the echo and the
// round trips.
func TestMeasureVsock(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "echo.sock")
	// Nothing listens yet: the first dials fail and are retried.
	dial := func(ctx context.Context) (vsockStream, error) {
		return dialKilnVsock(ctx, path, VsockEchoPort)
	}
	errc := make(chan error, 1)
	go func() {
		time.Sleep(300 * time.Millisecond)
		errc <- serveFakeKilnEcho(path)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	r, err := measureVsock(ctx, time.Now(), dial, make(chan struct{}), kilnCPU)
	if err != nil {
		t.Fatal(err)
	}
	// This process is the "VMM" here, with no guest: the round trips' CPU
	// is all outside a guest, and no more than they took.
	var total time.Duration
	for _, d := range r.RTTs {
		total += d
	}
	if c := r.RTTCPU; !r.RTTCPUKnown || c.Guest != 0 || c.VMM < 0 || c.Vhost != 0 || c.Client != 0 || c.Sum() > 2*total/time.Duration(len(r.RTTs))+10*time.Millisecond {
		t.Errorf("round trips' CPU %+v (known %v), mean round trip %v", c, r.RTTCPUKnown, total/time.Duration(len(r.RTTs)))
	}
	if r.Echo <= 0 || r.MiBps() <= 0 || len(r.RTTs) != VsockRoundTrips || r.Ready < 300*time.Millisecond {
		t.Errorf("result: echo %v (%.1f MiB/s), %d round trips, ready after %v", r.Echo, r.MiBps(), len(r.RTTs), r.Ready)
	}
	if err := <-errc; err != nil {
		t.Error(err)
	}
}

// serveFakeKilnEcho answers two connections on path the way Kiln's vsock
// device and the guest's echo program do: "CONNECT 1234\n", "OK <port>\n",
// then an echo until the host closes.
func serveFakeKilnEcho(path string) error {
	ln, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	defer ln.Close()
	for i := range 2 {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		line := make([]byte, len("CONNECT 1234\n"))
		if _, err := io.ReadFull(c, line); err != nil || string(line) != "CONNECT 1234\n" {
			c.Close()
			return fmt.Errorf("connection %d: got %q, %v", i, line, err)
		}
		fmt.Fprintf(c, "OK %d\n", 1<<30+i)
		go func() {
			defer c.Close()
			io.Copy(c, c)
		}()
	}
	return nil
}

func TestDialUntilReadyStops(t *testing.T) {
	stopped := make(chan struct{})
	close(stopped)
	failing := func(context.Context) (vsockStream, error) { return nil, errors.New("refused") }
	_, err := dialUntilReady(context.Background(), failing, stopped)
	if err == nil || !strings.Contains(err.Error(), "VM stopped") || !strings.Contains(err.Error(), "refused") {
		t.Errorf("dialUntilReady with a stopped VM: %v", err)
	}
}
