package sandbox_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
)

// TestKVMHold takes in-memory checkpoints of a sandbox in a VMM process,
// restored from the warm snapshot: /f=v1, hold a, /f=v2, hold b. Sandboxes
// restored from a and b see v1 and v2 and draw different random bytes; a
// parent attached afresh finds both holds in the VMM process and hands a
// out, which another sandbox adopts and releases; unknown IDs are
// ErrNotHeld. The same holds work in-process. Every VMM process is gone
// once its sandbox is closed.
func TestKVMHold(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	snap := sandbox.WarmSnapshot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	var pids []int
	closeAll := func(sbs ...*sandbox.Sandbox) {
		for _, sb := range sbs {
			if err := sb.Close(context.Background()); err != nil {
				t.Errorf("Close: %v", err)
			}
		}
	}
	begin := time.Now()
	p, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Hostname: "p", Process: vmmProcess()})
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	defer closeAll(p)
	pids = append(pids, p.PID())
	t.Logf("parent restored in %v", time.Since(begin).Round(time.Millisecond))

	hold := func(id string) {
		t.Helper()
		begin := time.Now()
		if err := p.Hold(ctx, id); err != nil {
			t.Fatalf("Hold %s: %v", id, err)
		}
		t.Logf("Hold %s: %v (emulated KVM)", id, time.Since(begin).Round(time.Millisecond))
	}
	execOut(t, ctx, p, "echo v1 >/f")
	hold("a")
	execOut(t, ctx, p, "echo v2 >/f")
	hold("b")
	if err := p.Hold(ctx, "a"); !errors.Is(err, sandbox.ErrHoldExists) {
		t.Fatalf("second Hold of a: %v", err)
	}
	if got := execOut(t, ctx, p, "cat /f"); got != "v2" {
		t.Fatalf("the parent after its holds: /f is %q", got)
	}

	// A fresh parent attached to the VMM process finds the holds there.
	at, err := sandbox.Attach(ctx, p.Dir(), sandbox.AttachOptions{Process: *vmmProcess()})
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	if ids, err := at.Held(ctx); err != nil || !slices.Equal(ids, []string{"a", "b"}) {
		t.Fatalf("Held of the attached sandbox: %v %v, want [a b]", ids, err)
	}
	if _, err := at.Frozen(ctx, "zz"); !errors.Is(err, sandbox.ErrNotHeld) {
		t.Fatalf("Frozen of an unknown ID: %v", err)
	}
	fa, err := at.Frozen(ctx, "a")
	if err != nil {
		t.Fatalf("Frozen a from the attached sandbox: %v", err)
	}
	defer fa.Close()
	fb, err := p.Frozen(ctx, "b")
	if err != nil {
		t.Fatalf("Frozen b: %v", err)
	}
	defer fb.Close()
	if fa.ID() != "a" || fa.Hostname() != "p" {
		t.Fatalf("Frozen a: ID %q, host name %q", fa.ID(), fa.Hostname())
	}

	restore := func(f *sandbox.Frozen, opts sandbox.RestoreOptions) *sandbox.Sandbox {
		t.Helper()
		begin := time.Now()
		sb, err := sandbox.RestoreFrozen(ctx, f, opts)
		if err != nil {
			t.Fatalf("RestoreFrozen %s: %v", f.ID(), err)
		}
		t.Logf("RestoreFrozen %s (process %v): %v to a freshened agent (emulated KVM)", f.ID(), opts.Process != nil, time.Since(begin).Round(time.Millisecond))
		if opts.Process != nil {
			pids = append(pids, sb.PID())
		}
		return sb
	}
	ca := restore(fa, sandbox.RestoreOptions{Hostname: "ca", Process: vmmProcess()})
	defer closeAll(ca)
	cb := restore(fb, sandbox.RestoreOptions{Process: vmmProcess()})
	defer closeAll(cb)
	const look = "cat /f; hostname; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"
	outA, outB := strings.Split(execOut(t, ctx, ca, look), "\n"), strings.Split(execOut(t, ctx, cb, look), "\n")
	if len(outA) != 3 || len(outB) != 3 || outA[0] != "v1" || outA[1] != "ca" || outB[0] != "v2" || outB[1] != "p" {
		t.Fatalf("restored from a: %q, from b: %q; want v1, ca and v2, p", outA, outB)
	}
	if outA[2] == outB[2] || len(outA[2]) != 32 {
		t.Fatalf("the restored sandboxes drew random bytes %s and %s", outA[2], outB[2])
	}
	// Refresh: a new identity for a running sandbox.
	if err := cb.Refresh(ctx, "fresh"); err != nil {
		t.Fatalf("Refresh: %v", err)
	}
	if got := execOut(t, ctx, cb, "hostname"); got != "fresh" {
		t.Fatalf("hostname after Refresh: %q", got)
	}

	// ca adopts a (as a rollback target would), and lets it go.
	if err := ca.Adopt(ctx, fa); err != nil {
		t.Fatalf("Adopt: %v", err)
	}
	if err := ca.Adopt(ctx, fa); !errors.Is(err, sandbox.ErrHoldExists) {
		t.Fatalf("second Adopt: %v", err)
	}
	if ids, err := ca.Held(ctx); err != nil || !slices.Equal(ids, []string{"a"}) {
		t.Fatalf("Held after Adopt: %v %v", ids, err)
	}
	if err := p.Release(ctx, "a"); err != nil {
		t.Fatalf("Release a in the parent: %v", err)
	}
	// The adopted one lives on in ca's process after the parent's release.
	fa2, err := ca.Frozen(ctx, "a")
	if err != nil {
		t.Fatalf("Frozen of the adopted hold: %v", err)
	}
	fa2.Close()
	if err := ca.Release(ctx, "a"); err != nil {
		t.Fatalf("Release of the adopted hold: %v", err)
	}
	if err := ca.Release(ctx, "a"); err != nil {
		t.Fatalf("Release of a hold released already: %v", err)
	}
	if ids, err := ca.Held(ctx); err != nil || len(ids) != 0 {
		t.Fatalf("Held after Release: %v %v", ids, err)
	}
	if ids, err := at.Held(ctx); err != nil || !slices.Equal(ids, []string{"b"}) {
		t.Fatalf("the parent's holds after releasing a: %v %v", ids, err)
	}

	// In this process: hold, restore in-process, release.
	l := restore(fb, sandbox.RestoreOptions{Hostname: "l"})
	defer closeAll(l)
	execOut(t, ctx, l, "echo v3 >/f")
	begin = time.Now()
	if err := l.Hold(ctx, "c"); err != nil {
		t.Fatalf("in-process Hold: %v", err)
	}
	t.Logf("in-process Hold c: %v (emulated KVM)", time.Since(begin).Round(time.Millisecond))
	fc, err := l.Frozen(ctx, "c")
	if err != nil {
		t.Fatalf("in-process Frozen: %v", err)
	}
	defer fc.Close()
	lc := restore(fc, sandbox.RestoreOptions{})
	if got := execOut(t, ctx, lc, "cat /f; hostname"); got != "v3\nl" {
		t.Fatalf("restored in-process from c: %q", got)
	}
	if err := l.Release(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	if _, err := l.Frozen(ctx, "c"); !errors.Is(err, sandbox.ErrNotHeld) {
		t.Fatalf("in-process Frozen after Release: %v", err)
	}
	closeAll(lc)

	// p's VMM process ends with p (the attached copy only lets go of it).
	closeAll(p, at, ca, cb)
	deadline := time.Now().Add(30 * time.Second)
	for _, pid := range pids {
		for syscall.Kill(pid, 0) != syscall.ESRCH {
			if time.Now().After(deadline) {
				t.Fatalf("VMM process %d is left after its sandbox closed", pid)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}
