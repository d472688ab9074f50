package sandbox_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestKVMWarmSnapshot makes the warm snapshot before the other KVM tests
// start (the harness runs TestKVMWarm* first) and checks it restores.
func TestKVMWarmSnapshot(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	snap := sandbox.WarmSnapshot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	sb, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{})
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	defer sb.Close(context.Background())
	if got := execOut(t, ctx, sb, "hostname"); got != "warm" {
		t.Fatalf("hostname %q", got)
	}
}

// vmmProcess runs a sandbox's VM in a VMM process: this test binary (see
// TestMain).
func vmmProcess() *sandbox.ProcessOptions {
	return &sandbox.ProcessOptions{Command: []string{os.Args[0], "-test.run=^$"}}
}

func execOut(t *testing.T, ctx context.Context, sb *sandbox.Sandbox, script string) string {
	t.Helper()
	return sandbox.ShOut(t, ctx, sb, script)
}

// TestKVMProcess runs sandboxes in VMM processes of their own, restored
// from the warm snapshot: a killed VMM process fails its own sandbox only,
// with its exit named, while the others serve execs; a parent re-attaches
// to a running VMM process by its folder; and a fork of a sandbox in a
// VMM process into 4 children, each in its own process, shares guest
// memory as an in-process fork does (PSS of the children's guest RAM,
// measured side by side).
func TestKVMProcess(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	snap := sandbox.WarmSnapshot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()

	restore := func(name string, proc *sandbox.ProcessOptions) *sandbox.Sandbox {
		t.Helper()
		begin := time.Now()
		sb, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Hostname: name, Process: proc})
		if err != nil {
			t.Fatalf("Restore %s: %v", name, err)
		}
		t.Cleanup(func() { sb.Close(context.Background()) })
		t.Logf("%s restored in %v (VMM process %d)", name, time.Since(begin).Round(time.Millisecond), sb.PID())
		return sb
	}
	a := restore("a", vmmProcess())
	b := restore("b", vmmProcess())
	if a.PID() == os.Getpid() || a.PID() == b.PID() {
		t.Fatalf("VMM processes: a %d, b %d, this %d", a.PID(), b.PID(), os.Getpid())
	}
	if got := execOut(t, ctx, a, "hostname; echo $((6*7))"); got != "a\n42" {
		t.Fatalf("a: %q", got)
	}

	outer := t
	t.Run("attach", func(t *testing.T) {
		at, err := sandbox.Attach(ctx, a.Dir(), sandbox.AttachOptions{Process: *vmmProcess()})
		if err != nil {
			t.Fatalf("Attach: %v", err)
		}
		// Closing the attached copy stops a's VM: after the whole test.
		outer.Cleanup(func() { at.Close(context.Background()) })
		if got := execOut(t, ctx, at, "hostname"); got != "a" {
			t.Fatalf("attached sandbox says it is %q", got)
		}
		if at.PID() != a.PID() {
			t.Fatalf("attached to VMM process %d, a's is %d", at.PID(), a.PID())
		}
		if len(at.Devices()) != len(a.Devices()) {
			t.Fatalf("attached devices %v, a's %v", at.Devices(), a.Devices())
		}
		// The attached sandbox forks as one this process started would.
		kids, err := at.Fork(ctx, 1, sandbox.ForkOptions{})
		if err != nil {
			t.Fatalf("Fork of the attached sandbox: %v", err)
		}
		defer kids[0].Close(context.Background())
		if got := execOut(t, ctx, kids[0], "hostname"); got != "a-0" {
			t.Fatalf("child of the attached sandbox: hostname %q", got)
		}
	})

	t.Run("fork shares memory across processes", func(t *testing.T) {
		const n = 4
		measure := func(name string, parent *sandbox.Sandbox) (pss, rss float64) {
			t.Helper()
			begin := time.Now()
			kids, err := parent.Fork(ctx, n, sandbox.ForkOptions{})
			if err != nil {
				t.Fatalf("%s: Fork: %v", name, err)
			}
			defer func() {
				for _, k := range kids {
					k.Close(context.Background())
				}
			}()
			t.Logf("%s: %d children answering after %v", name, n, time.Since(begin).Round(time.Millisecond))
			pids := map[int]bool{}
			for i, k := range kids {
				if got, want := execOut(t, ctx, k, "hostname"), fmt.Sprintf("%s-%d", parentName(parent), i); got != want {
					t.Errorf("%s child %d: hostname %q, want %q", name, i, got, want)
				}
				pids[k.PID()] = true
			}
			for _, k := range kids {
				u, err := bench.GuestUsage(k)
				if err != nil {
					t.Fatalf("%s: %v", name, err)
				}
				pss += bench.MiB(u.Pss) / n
				rss += bench.MiB(u.Rss) / n
			}
			t.Logf("%s: guest RAM per child: PSS %.1f MiB, RSS %.1f MiB (%d VMM processes)", name, pss, rss, len(pids))
			if pss > rss/2 {
				t.Errorf("%s: the children share little of their memory: PSS %.1f MiB of RSS %.1f MiB", name, pss, rss)
			}
			return pss, rss
		}
		local := restore("l", nil)
		lpss, _ := measure("in-process", local)
		ppss, _ := measure("out-of-process", b)
		t.Logf("guest RAM PSS per child, out-of-process / in-process: %.2f", ppss/lpss)
	})

	t.Run("overhead of the process boundary", func(t *testing.T) {
		rep, err := bench.RunProcess(ctx, bench.ProcessSpec{Snapshot: snap, Process: *vmmProcess(), Execs: 3, Forks: 1}, nil)
		if err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		rep.Print(&b)
		t.Logf("bench.RunProcess (emulated KVM):\n%s", b.String())
		if rep.OutOfProcess().VMMPSS == 0 || len(rep.OutOfProcess().Execs) != 3 || len(rep.InProcess().Forks) != 1 || len(rep.InProcess().Restores) != 1 {
			t.Fatalf("report %+v", rep)
		}
	})

	t.Run("a killed VMM process fails its sandbox only", func(t *testing.T) {
		if err := syscall.Kill(a.PID(), syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		select {
		case <-a.Done():
		case <-time.After(time.Minute):
			t.Fatal("the sandbox did not notice its VMM process died")
		}
		_, err := a.Exit()
		var pe *vmmproc.ProcessError
		if !errors.As(err, &pe) || !strings.Contains(err.Error(), "signal: killed") || pe.PID == 0 {
			t.Fatalf("Exit after kill -9: %v", err)
		}
		t.Logf("a: %v", err)
		if got := execOut(t, ctx, b, "echo still here"); got != "still here" {
			t.Fatalf("b after a's VMM died: %q", got)
		}
		if err := a.Close(ctx); err != nil {
			t.Logf("Close of the dead sandbox: %v", err)
		}
	})
}

// parentName returns the host name the parent's children are named after.
func parentName(sb *sandbox.Sandbox) string {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	info, err := sb.Client().Info(ctx)
	if err != nil {
		return "?"
	}
	return info.Hostname
}
