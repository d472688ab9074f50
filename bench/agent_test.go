package bench

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// agentBench gates the agent benchmarks the way the other benchmarks are
// gated (a usable /dev/kvm, QEMU, here also vhost-vsock) and returns the
// QEMU binary and a static agent.
func agentBench(b *testing.B) (qemu, agent string) {
	b.Helper()
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		b.Skip("qemu-system-x86_64 not installed (make deps)")
	}
	if err := EnsureVhostVsock(); err != nil {
		b.Skip(err)
	}
	kvmtest.Kernel(b)
	return qemu, kvmtest.AgentBinary(b)
}

// logWriter writes each line it is given to b.Log.
type logWriter struct{ b *testing.B }

func (w logWriter) Write(p []byte) (int, error) {
	w.b.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// BenchmarkColdStart measures VM creation to the first exec's result
// (sandbox.Start, then Exec of `true`) on Kiln and on QEMU microvm booting
// the same kernel, agent initramfs and command line with vhost-vsock,
// alternating, one boot of each per iteration, on Debian's kernel and on
// the minimal kernel when make guest-kernel built it. It reports the
// medians and Kiln's over QEMU's. Run it with a fixed count:
// go test -run '^$' -bench ColdStart -benchtime 3x ./bench
func BenchmarkColdStart(b *testing.B) {
	qemu, agent := agentBench(b)
	for _, kernel := range []string{KernelDebian, KernelMinimal} {
		b.Run(kernel, func(b *testing.B) {
			s, err := StartSpecFor(kernel, agent)
			if errors.Is(err, ErrNoMinimalKernel) {
				b.Skip(err)
			}
			if err != nil {
				b.Fatal(err)
			}
			b.Logf("%s: %s", s.Name, s.Kernel)
			ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
			defer cancel()
			if err := WarmUp(ctx, qemu, s); err != nil {
				b.Fatal(err)
			}
			var c StartComparison
			i := 0
			for b.Loop() {
				if err := c.Run(ctx, qemu, s, i, logWriter{b}); err != nil {
					b.Fatal(err)
				}
				i++
			}
			cold := c.ColdStart()
			b.ReportMetric(0, "ns/op")
			b.ReportMetric(ms(Median(cold.Kiln)), "kiln-ms")
			b.ReportMetric(ms(Median(cold.Peer)), "qemu-ms")
			b.ReportMetric(cold.Ratio(), "kiln/qemu")
		})
	}
}

// BenchmarkExecRTT boots one VM on each VMM (Debian's kernel, as
// BenchmarkColdStart), runs a first exec on each untimed, and then times
// one exec of `true` on each per iteration. It reports the median and p90 round trips and the ratio of
// the medians. Run it with a fixed count:
// go test -run '^$' -bench ExecRTT -benchtime 100x ./bench
func BenchmarkExecRTT(b *testing.B) {
	qemu, agent := agentBench(b)
	s, err := StartSpecFor(KernelDebian, agent)
	if err != nil {
		b.Fatal(err)
	}
	s = s.withDefaults()
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	if err := WarmUp(ctx, qemu, s); err != nil {
		b.Fatal(err)
	}
	kvm, err := startKilnVM(ctx, s)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		if err := kvm.stop(); err != nil {
			b.Error(err)
		}
	}()
	qvm, err := startQEMUVM(ctx, qemu, s)
	if err != nil {
		b.Fatal(err)
	}
	defer func() {
		if err := qvm.stop(); err != nil {
			b.Error(err)
		}
	}()
	b.Logf("agent ready after: kiln %v, qemu %v", kvm.ready.Round(time.Millisecond), qvm.ready.Round(time.Millisecond))
	// The first exec is part of the cold start (BenchmarkColdStart); the
	// round trips are those on a VM that has run one.
	for _, vm := range []*agentVM{kvm, qvm} {
		if err := execTrue(ctx, vm.client); err != nil {
			b.Fatalf("first exec: %v; console: %s", err, vm.console())
		}
	}
	var rtt Comparison
	for b.Loop() {
		for _, vm := range []*agentVM{kvm, qvm} {
			t := time.Now()
			if err := execTrue(ctx, vm.client); err != nil {
				b.Fatalf("%v; console: %s", err, vm.console())
			}
			if vm == kvm {
				rtt.Kiln = append(rtt.Kiln, time.Since(t))
			} else {
				rtt.Peer = append(rtt.Peer, time.Since(t))
			}
		}
	}
	b.ReportMetric(0, "ns/op")
	b.ReportMetric(us(Median(rtt.Kiln)), "kiln-us")
	b.ReportMetric(us(Percentile(rtt.Kiln, 90)), "kiln-p90-us")
	b.ReportMetric(us(Median(rtt.Peer)), "qemu-us")
	b.ReportMetric(us(Percentile(rtt.Peer, 90)), "qemu-p90-us")
	b.ReportMetric(rtt.Ratio(), "kiln/qemu")
}

func TestPercentile(t *testing.T) {
	ms := time.Millisecond
	ds := []time.Duration{5 * ms, 1 * ms, 4 * ms, 2 * ms, 3 * ms, 10 * ms, 9 * ms, 8 * ms, 7 * ms, 6 * ms}
	tests := []struct {
		ds   []time.Duration
		p    float64
		want time.Duration
	}{
		{ds, 90, 9 * ms},
		{ds, 50, 5 * ms},
		{ds, 100, 10 * ms},
		{ds, 150, 10 * ms},
		{ds, 1, 1 * ms},
		{ds, 0, 0},
		{ds, -5, 0},
		{[]time.Duration{7 * ms}, 90, 7 * ms},
		{nil, 90, 0},
	}
	for _, tt := range tests {
		if got := Percentile(tt.ds, tt.p); got != tt.want {
			t.Errorf("Percentile(%v, %v) = %v, want %v", tt.ds, tt.p, got, tt.want)
		}
	}
	if !slices.Equal(ds[:3], []time.Duration{5 * ms, 1 * ms, 4 * ms}) {
		t.Error("Percentile sorted its argument")
	}
}

func TestQEMUStartArgs(t *testing.T) {
	s := StartSpec{Kernel: "/k/vmlinux", Initrd: "/i/agent.cpio", Cmdline: "kiln.debug"}
	args := strings.Join(QEMUStartArgs(s, 1234), " ")
	for _, want := range []string{
		"-M microvm,", "-enable-kvm -cpu host", "-m 512 -smp 1",
		"-kernel /k/vmlinux", "-initrd /i/agent.cpio",
		"-append " + SandboxCmdline + " kiln.debug",
		"-device vhost-vsock-device,guest-cid=1234", "-device virtio-rng-device",
	} {
		if !strings.Contains(args, want) {
			t.Errorf("QEMU args %q lack %q", args, want)
		}
	}
	if got := (StartSpec{}).KernelCmdline(); got != SandboxCmdline {
		t.Errorf("KernelCmdline() = %q, want %q", got, SandboxCmdline)
	}
}

func TestCheckCmdline(t *testing.T) {
	want := SandboxCmdline
	for _, tt := range []struct {
		got string
		ok  bool
	}{
		{want, true},
		{want + " virtio_mmio.device=512@0xfeb00e00:12", true},
		{want + "x", false},
		{"console=ttyS0", false},
		{"", false},
	} {
		if err := checkCmdline("kiln", tt.got, want); (err == nil) != tt.ok {
			t.Errorf("checkCmdline(%q) = %v, want ok=%v", tt.got, err, tt.ok)
		}
	}
}

func TestStartSpecErrors(t *testing.T) {
	t.Setenv("KILN_CACHE", t.TempDir())
	if _, err := StartSpecFor(KernelMinimal, "/nonexistent/agent"); !errors.Is(err, ErrNoMinimalKernel) {
		t.Errorf("minimal kernel in an empty cache: %v", err)
	}
	if _, err := StartSpecFor("", "/nonexistent/agent"); err == nil {
		t.Error("no kernel named: no error")
	}
	if _, err := StartSpecFor("/nonexistent/bzImage", "/nonexistent/agent"); err == nil {
		t.Error("missing kernel file: no error")
	}
	if _, err := StartSpecFor(t.TempDir(), "/nonexistent/agent"); err == nil {
		t.Error("kernel that is a folder: no error")
	}
	ctx := context.Background()
	if _, err := StartKiln(ctx, StartSpec{}); err == nil {
		t.Error("StartKiln with an empty spec: no error")
	}
	if _, err := StartQEMU(ctx, "qemu-system-x86_64", StartSpec{Kernel: "k"}); err == nil {
		t.Error("StartQEMU without an initramfs: no error")
	}
	if _, err := CompareStart(ctx, "qemu-system-x86_64", StartSpec{Kernel: "k", Initrd: "i"}, 0, nil); err == nil {
		t.Error("CompareStart with no runs: no error")
	}
	if err := WarmUp(ctx, "qemu-system-x86_64", StartSpec{Kernel: "/nonexistent/k", Initrd: "i"}); err == nil {
		t.Error("WarmUp with a missing kernel: no error")
	}
	if err := (StartSpec{Kernel: "k", Initrd: "i", Execs: -1}).validate(); err == nil {
		t.Error("negative exec count: no error")
	}
}

func TestMinimalKernel(t *testing.T) {
	cache := t.TempDir()
	t.Setenv("KILN_CACHE", cache)
	dir := filepath.Join(cache, "guest-kernel", "6.1.99-kiln")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("6.1.99-kiln", filepath.Join(cache, "guest-kernel", "current")); err != nil {
		t.Fatal(err)
	}
	if _, _, err := MinimalKernel(); !errors.Is(err, ErrNoMinimalKernel) {
		t.Errorf("no image: %v", err)
	}
	for _, name := range []string{"bzImage", "vmlinux"} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte("kernel"), 0o644); err != nil {
			t.Fatal(err)
		}
		img, release, err := MinimalKernel()
		if err != nil || img != filepath.Join(dir, name) || release != "6.1.99-kiln" {
			t.Errorf("with %s: %q, %q, %v", name, img, release, err)
		}
	}
}

// fakeAgent answers Health and runs nothing: `true` exits 0 (or failCode
// once fail is set), `cat /proc/cmdline` prints cmdline.
type fakeAgent struct {
	agentpb.UnimplementedAgentServer
	cmdline string
	mu      sync.Mutex
	execs   int
	fail    bool
}

func (f *fakeAgent) Health(context.Context, *agentpb.HealthRequest) (*agentpb.HealthResponse, error) {
	return &agentpb.HealthResponse{Ok: true}, nil
}

func (f *fakeAgent) Exec(stream agentpb.Agent_ExecServer) error {
	req, err := stream.Recv()
	if err != nil {
		return err
	}
	f.mu.Lock()
	f.execs++
	fail := f.fail
	f.mu.Unlock()
	argv := req.GetStart().GetArgv()
	if err := stream.Send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Started{Started: &agentpb.ExecStarted{Pid: 42}}}); err != nil {
		return err
	}
	code := int32(0)
	switch {
	case slices.Equal(argv, []string{"cat", "/proc/cmdline"}):
		if err := stream.Send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Stdout{Stdout: []byte(f.cmdline + "\n")}}); err != nil {
			return err
		}
	case slices.Equal(argv, []string{"true"}) && !fail:
	default:
		code = 1
	}
	return stream.Send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Exit{Exit: &agentpb.ExecExit{ExitCode: code}}})
}

// TestAgentVMMeasure runs the host side of the benchmark against a fake
// agent on a Unix socket that starts listening late: the readiness wait,
// the first exec, the round trips and the command line.
func TestAgentVMMeasure(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	fake := &fakeAgent{cmdline: SandboxCmdline + " virtio_mmio.device=512@0xfeb00e00:12"}
	srv := grpc.NewServer()
	agentpb.RegisterAgentServer(srv, fake)
	defer srv.Stop()
	go func() {
		time.Sleep(200 * time.Millisecond)
		ln, err := net.Listen("unix", path)
		if err != nil {
			t.Error(err)
			return
		}
		srv.Serve(ln)
	}()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := time.Now()
	dial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
	c, err := client.WaitReadyFunc(ctx, dial, client.WithRetryInterval(20*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	stopped := false
	vm := &agentVM{client: c, start: start, ready: time.Since(start),
		console: func() string { return "fake console" },
		stop:    func() error { stopped = true; return c.Close() }}
	r, err := vm.measureAndStop(ctx, 7, "fake")
	if err != nil {
		t.Fatal(err)
	}
	if !stopped {
		t.Error("the VM was not stopped")
	}
	fake.mu.Lock()
	execs := fake.execs
	fake.mu.Unlock()
	if r.Ready < 200*time.Millisecond || r.ColdStart < r.Ready || len(r.RTTs) != 7 || execs != 9 {
		t.Errorf("ready %v, cold start %v, %d round trips, %d execs; want ready >= 200ms <= cold start, 7 round trips, 9 execs",
			r.Ready, r.ColdStart, len(r.RTTs), execs)
	}
	if err := checkCmdline("fake", r.GuestCmdline, SandboxCmdline); err != nil {
		t.Error(err)
	}

	// A failing exec is an error naming it, with the console.
	c, err = client.WaitReadyFunc(ctx, dial)
	if err != nil {
		t.Fatal(err)
	}
	fake.mu.Lock()
	fake.fail = true
	fake.mu.Unlock()
	vm = &agentVM{client: c, start: time.Now(), console: func() string { return "fake console" }, stop: c.Close}
	_, err = vm.measureAndStop(ctx, 3, "fake")
	if err == nil || !strings.Contains(err.Error(), "first exec") || !strings.Contains(err.Error(), "fake console") {
		t.Errorf("failing exec: %v", err)
	}
}
