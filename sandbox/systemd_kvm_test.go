package sandbox

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/image/imagetest"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/vmm"
)

// TestKVMSystemd boots the fidelity image with Init systemd: systemd is
// process 1 and reaches its default target, the agent serves as one of its
// services (exec works, through a fork too), the kernel's module
// autoloading goes through Kiln's modprobe helper, power-off from inside ends
// the VM cleanly; an image without /sbin/init fails at once, saying so.
// It logs systemd's boot figures; BenchmarkKVMSystemdBoot sets them
// against the agent-as-init boot of the same image (docs/bench.md).
func TestKVMSystemd(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	e := fidelityEnv(t, ctx)
	ref := e.refs[kvmtest.FidelityImage]

	sb, firstExec, booted, state := bootSystemd(t, ctx, e, ref)
	failed := sh(t, ctx, sb, "systemctl --failed --no-legend --plain | awk '{print $1}' | tr '\\n' ' '")
	t.Logf("boot figures (emulated): systemd, first exec %v, %s after %v; failed units: [%s]",
		firstExec.Round(time.Millisecond), state, booted.Round(time.Millisecond), failed)
	// Diagnostics only, bounded: under a loaded emulation systemd-analyze
	// has taken minutes to answer.
	analyzeTime, _, _, _ := shTry(ctx, sb, "timeout 60 systemd-analyze time 2>&1 | head -1")
	blame, _, _, _ := shTry(ctx, sb, "timeout 60 systemd-analyze blame 2>&1 | head -8")
	t.Logf("systemd-analyze: %s\nslowest units:\n%s", analyzeTime, blame)
	switch state {
	case "running":
	case "degraded":
		// Allowed (the issue asks that the failed units be named): what
		// fails is the image's units.
		t.Logf("systemd is degraded: failed units %s; status:\n%s", failed,
			sh(t, ctx, sb, "systemctl status --no-pager --lines=5 $(systemctl --failed --no-legend --plain | awk '{print $1}') 2>&1 || true"))
	default:
		t.Errorf("systemctl is-system-running = %q, want running or degraded", state)
	}
	if got := sh(t, ctx, sb, "ps -p 1 -o comm="); got != "systemd" {
		t.Errorf("process 1 is %q, want systemd", got)
	}
	// The kernel's module autoloading goes through Kiln's helper under
	// systemd too (systemd kept the /run the helper is bound in): an
	// AF_ALG skcipher socket, a module nothing else loads, has the
	// kernel ask for algif-skcipher, which needs af_alg.
	if got := sh(t, ctx, sb, "cat /proc/sys/kernel/modprobe; "+loadedOf("algif_skcipher")+`
python3 -c 'import socket; s = socket.socket(socket.AF_ALG, socket.SOCK_SEQPACKET, 0); s.bind(("skcipher", "cbc(aes)"))'
`+loadedOf("af_alg algif_skcipher")); got != "/run/kiln/modprobe\naf_alg\nalgif_skcipher" {
		t.Errorf("module autoloading under systemd: %q, want the helper /run/kiln/modprobe, then af_alg and algif_skcipher loaded", got)
	}
	if got := sh(t, ctx, sb, "systemctl is-active kiln-agent"); got != "active" {
		t.Errorf("systemctl is-active kiln-agent = %q", got)
	}
	if got := sh(t, ctx, sb, "systemctl get-default"); got != "graphical.target" && got != "multi-user.target" {
		t.Errorf("default target %q", got)
	}
	// An exec runs in a cgroup below the agent's delegated one.
	if got := sh(t, ctx, sb, "cat /proc/self/cgroup"); !strings.Contains(got, "/kiln-agent.service/sandbox/") {
		t.Errorf("an exec's cgroup is %q, want one below kiln-agent.service/sandbox", got)
	}
	if got := sh(t, ctx, sb, "hostname"); got != "img" {
		t.Errorf("hostname %q, want img", got)
	}
	// The image's top layer disables Docker's units (whiteouts of their
	// links in the layer below): systemd sees them installed, not enabled.
	if got := sh(t, ctx, sb, "systemctl is-enabled docker.service docker.socket containerd.service || true"); got != "disabled\ndisabled\ndisabled" {
		t.Errorf("systemctl is-enabled docker.service docker.socket containerd.service = %q, want disabled for each", got)
	}

	// A fork: the child's agent answers, systemd still runs there.
	kids, err := sb.Fork(ctx, 1, ForkOptions{})
	if err != nil {
		t.Fatalf("Fork: %v", err)
	}
	kid := kids[0]
	t.Cleanup(func() { kid.Close(context.Background()) })
	if got := sh(t, ctx, kid, "systemctl is-active kiln-agent; ps -p 1 -o comm="); got != "active\nsystemd" {
		t.Errorf("in the fork: %q", got)
	}

	// Power-off from inside (systemctl poweroff in the fork) and through
	// the agent's PowerOff, which asks systemd (in the parent), side by
	// side: systemd stops its units, the VMs exit power-off.
	began := time.Now()
	if _, _, st, err := shTry(ctx, kid, "systemctl poweroff"); err != nil || !st.Success() {
		t.Logf("systemctl poweroff: %v %v (the VM may stop before the status comes back)", st, err)
	}
	if err := sb.Client().PowerOff(ctx); err != nil {
		t.Errorf("PowerOff: %v", err)
	}
	for _, v := range []struct {
		what string
		sb   *Sandbox
	}{{"systemctl poweroff", kid}, {"PowerOff", sb}} {
		select {
		case <-v.sb.Done():
		case <-time.After(5 * time.Minute):
			t.Fatalf("the VM did not stop after %s%s", v.what, "\n"+v.sb.Console())
		}
		if exit, err := v.sb.Exit(); err != nil || exit.Reason != vmm.ReasonPowerOff {
			t.Errorf("after %s the VM exited %v, %v; want power-off", v.what, exit, err)
		}
		t.Logf("%s: the VM stopped after %v", v.what, time.Since(began).Round(time.Millisecond))
	}
	if c := sb.Console(); !strings.Contains(c, "reboot: Power down") {
		t.Errorf("the console after PowerOff lacks the kernel's power down:\n%s", c[max(0, len(c)-2000):])
	}

	// Bad input: the debian test image has no /sbin/init.
	dreg, drefs := imagetest.ServeLayout(t, kvmtest.TestImages(t), "kiln/test")
	de := newImageEnv(t, dreg, drefs)
	de.pull(t, ctx, "debian")
	began = time.Now()
	bad, err := Start(ctx, Options{Runtime: testRuntime(t), Images: de.dir, ImageRoots: de.roots, Image: de.refs["debian"],
		Init: InitSystemd, MemoryMiB: 512, BootTimeout: 5 * time.Minute})
	if err == nil {
		bad.Close(ctx)
		t.Fatal("Start with Init systemd on an image without /sbin/init succeeded")
	}
	t.Logf("no /sbin/init: failed after %v: %v", time.Since(began).Round(time.Millisecond), err)
	if !strings.Contains(err.Error(), "/sbin/init") || !strings.Contains(err.Error(), "stopped before its agent answered") {
		t.Errorf("Start on an image without /sbin/init: %v; want the VM stopped, naming /sbin/init", err)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		t.Errorf("Start on an image without /sbin/init timed out: %v", err)
	}
}

// bootSystemd starts ref with Init systemd (768 MiB) and waits for its
// default target: the times from Start to the first exec answering and
// to systemctl is-system-running --wait answering, and its answer.
func bootSystemd(tb testing.TB, ctx context.Context, e *imageEnv, ref string) (*Sandbox, time.Duration, time.Duration, string) {
	tb.Helper()
	began := time.Now()
	sb := e.startWith(tb, ctx, Options{Image: ref, Init: InitSystemd, MemoryMiB: 768})
	sh(tb, ctx, sb, "true")
	firstExec := time.Since(began)
	state, _, _, err := shTry(ctx, sb, "systemctl is-system-running --wait")
	booted := time.Since(began)
	if err != nil {
		tb.Fatalf("systemctl is-system-running --wait: %v%s", err, "\n"+sb.Console())
	}
	return sb, firstExec, booted, state
}

// BenchmarkKVMSystemdBoot boots the fidelity image with the agent as
// process 1 (Start to the first exec answering) and with Init systemd
// (Start to multi-user.target: is-system-running --wait answering),
// alternating, in the same images folder (the first boot pays for the
// image's first lazy fetches: run -test.benchtime 2x or more and read
// the later ones). It reports both and their ratio, the issue's "under
// 3x" (measured, not asserted).
func BenchmarkKVMSystemdBoot(b *testing.B) {
	// Gated as the other benchmarks are (they are not tests the harness
	// counts): run it through the harness, where /dev/kvm works.
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	e := fidelityEnv(b, ctx)
	ref := e.refs[kvmtest.FidelityImage]
	var agentSum, firstSum, bootSum time.Duration
	n := 0
	for b.Loop() {
		began := time.Now()
		agentSB := e.startWith(b, ctx, Options{Image: ref, MemoryMiB: 768})
		sh(b, ctx, agentSB, "true")
		agent := time.Since(began)
		agentSB.Close(ctx)
		sb, first, booted, state := bootSystemd(b, ctx, e, ref)
		sb.Close(ctx)
		n++
		agentSum, firstSum, bootSum = agentSum+agent, firstSum+first, bootSum+booted
		b.Logf("boot %d (emulated or not: see the harness's mode): agent as init, first exec %v; systemd, first exec %v, %s after %v (%.1fx)",
			n, agent.Round(time.Millisecond), first.Round(time.Millisecond), state, booted.Round(time.Millisecond), float64(booted)/float64(agent))
	}
	b.ReportMetric(agentSum.Seconds()/float64(n), "agent-first-exec-s")
	b.ReportMetric(firstSum.Seconds()/float64(n), "systemd-first-exec-s")
	b.ReportMetric(bootSum.Seconds()/float64(n), "systemd-multi-user-s")
	b.ReportMetric(float64(bootSum)/float64(agentSum), "systemd/agent")
}
