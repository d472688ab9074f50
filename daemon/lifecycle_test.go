package daemon_test

import (
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// waitPending waits until the fake clock has n timers armed.
func (e *env) waitPending(n int) {
	e.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for e.clock.Pending() != n {
		if time.Now().After(deadline) {
			e.t.Fatalf("%d timers armed, want %d", e.clock.Pending(), n)
		}
		time.Sleep(time.Millisecond)
	}
}

func TestIdleTimeout(t *testing.T) {
	e := newEnv(t, nil)
	events := e.subscribe()
	idle := e.create(&kilnpb.CreateSandboxRequest{IdleTimeoutMs: 10_000})
	active := e.create(&kilnpb.CreateSandboxRequest{IdleTimeoutMs: 10_000})
	e.waitPending(2)
	for range 4 {
		e.clock.Advance(4 * time.Second)
		e.sh(active.Id, "true")
	}
	// 16 s on: the idle one timed out at 10 s, the active one runs on.
	sb := e.waitState(idle.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
	if !strings.Contains(sb.Reason, "idle timeout") {
		t.Errorf("reason %q", sb.Reason)
	}
	if got := e.get(active.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Errorf("the active sandbox is %v (%s)", got.State, got.Reason)
	}
	for {
		ev, err := events.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Kind == kilnpb.Event_KIND_TIMED_OUT {
			if ev.SandboxId != idle.Id || !strings.Contains(ev.Reason, "idle") || ev.Sandbox.GetState() != kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT {
				t.Errorf("timed-out event %v", ev)
			}
			break
		}
	}
	if e.be.Live() != 1 {
		t.Errorf("%d sandboxes run, want 1", e.be.Live())
	}
}

func TestIdleTimeoutWaitsForExecs(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{IdleTimeoutMs: 1000})
	_, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}})
	e.waitPending(1)
	e.clock.Advance(5 * time.Second)
	e.waitPending(1) // re-armed: an exec in flight is activity
	if got := e.get(sb.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("timed out during an exec: %v", got)
	}
	cancel()
	deadline := time.Now().Add(5 * time.Second)
	for e.get(sb.Id).State == kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		if time.Now().After(deadline) {
			t.Fatal("no idle timeout after the exec ended")
		}
		e.clock.Advance(time.Second)
		time.Sleep(2 * time.Millisecond)
	}
	e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
}

func TestLifetime(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.DefaultLifetime = time.Minute })
	def := e.create(nil)
	long := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: 3_600_000})
	never := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: -1})
	if def.ExpiresUnixMs != def.CreatedUnixMs+60_000 || never.ExpiresUnixMs != 0 {
		t.Errorf("expiry: default %d (created %d), never %d", def.ExpiresUnixMs, def.CreatedUnixMs, never.ExpiresUnixMs)
	}
	e.waitPending(2)
	e.clock.Advance(59 * time.Second)
	if got := e.get(def.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("ended early: %v", got)
	}
	e.clock.Advance(time.Second)
	sb := e.waitState(def.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
	if !strings.Contains(sb.Reason, "lifetime of 1m0s") {
		t.Errorf("reason %q", sb.Reason)
	}
	e.clock.Advance(2 * time.Hour)
	e.waitState(long.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
	if got := e.get(never.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Errorf("a sandbox without a lifetime ended: %v", got)
	}
}

func TestVMMProcessKilled(t *testing.T) {
	e := newEnv(t, nil)
	events := e.subscribe()
	a := e.create(nil)
	b := e.create(nil)
	if err := syscall.Kill(int(a.Pid), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	sb := e.waitState(a.Id, kilnpb.SandboxState_SANDBOX_STATE_FAILED)
	if !strings.Contains(sb.Reason, "killed") {
		t.Errorf("reason %q does not say how the VMM process died", sb.Reason)
	}
	if r := e.sh(b.Id, "echo alive"); r.stdout != "alive\n" {
		t.Errorf("sibling: %+v", r)
	}
	for {
		ev, err := events.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Kind == kilnpb.Event_KIND_FAILED {
			if ev.SandboxId != a.Id || ev.Reason != sb.Reason {
				t.Errorf("failed event %v", ev)
			}
			break
		}
	}
}

// TestGuestPowerOff: a guest that powers itself off (poweroff inside,
// systemctl poweroff under --init systemd) ends its sandbox STOPPED, a
// clean end with a KIND_STOPPED event, not FAILED, and nothing is
// counted as a failure; a sibling runs on.
func TestGuestPowerOff(t *testing.T) {
	e := newEnv(t, nil)
	events := e.subscribe()
	a := e.create(nil)
	b := e.create(nil)
	in := e.be.ByPID(int(a.Pid))
	if in == nil {
		t.Fatalf("no stand-in instance with pid %d", a.Pid)
	}
	in.PowerOffGuest()
	sb := e.waitState(a.Id, kilnpb.SandboxState_SANDBOX_STATE_STOPPED)
	if !strings.Contains(sb.Reason, "powered off") {
		t.Errorf("reason %q does not say the guest powered off", sb.Reason)
	}
	if r := e.sh(b.Id, "echo alive"); r.stdout != "alive\n" {
		t.Errorf("sibling: %+v", r)
	}
	for {
		ev, err := events.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.Kind == kilnpb.Event_KIND_FAILED {
			t.Fatalf("a guest power-off published a failure: %v", ev)
		}
		if ev.Kind == kilnpb.Event_KIND_STOPPED {
			if ev.SandboxId != a.Id || ev.Reason != sb.Reason || ev.Sandbox.GetState() != kilnpb.SandboxState_SANDBOX_STATE_STOPPED {
				t.Errorf("stopped event %v", ev)
			}
			break
		}
	}
	if got := metricValue(t, e.srv, "kiln_failures_total", map[string]string{"op": "sandbox"}); got > 0 { // -1: no such series
		t.Errorf("a guest power-off counted %v sandbox failures", got)
	}
	if got := metricValue(t, e.srv, "kiln_sandboxes_ended_total", map[string]string{"state": "stopped"}); got != 1 {
		t.Errorf("kiln_sandboxes_ended_total{state=stopped} = %v, want 1", got)
	}
	l, err := e.c.ListSandboxes(ctxT(t), &kilnpb.ListSandboxesRequest{States: []kilnpb.SandboxState{kilnpb.SandboxState_SANDBOX_STATE_STOPPED}})
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Sandboxes) != 1 || l.Sandboxes[0].Id != a.Id {
		t.Errorf("sandboxes listed as stopped: %v", l.Sandboxes)
	}
}

// TestRestart: a server that stops without a word (kill -9) and a new
// one over the same state folder: every sandbox is listed again with its
// ID and state and answers; one whose VMM process died meanwhile is
// failed.
func TestRestart(t *testing.T) {
	e := newEnv(t, nil)
	run := e.create(&kilnpb.CreateSandboxRequest{Labels: map[string]string{"k": "v"}})
	paused := e.create(nil)
	dead := e.create(nil)
	ended := e.create(nil)
	e.sh(run.Id, `echo kept > "$KILN_TEST_ROOT/f"`)
	if _, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: paused.Id}); err != nil {
		t.Fatal(err)
	}
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: ended.Id})
	// The old server goes as if killed: Close writes nothing to the state
	// folder (it only stops the watchers, which a killed server's
	// would not outlive either).
	e.stop()
	syscall.Kill(int(dead.Pid), syscall.SIGKILL)
	waitGone(t, dead.Pid)
	old := e.be
	t.Cleanup(old.KillAll)
	e.be = &daemontest.Backend{}
	e.cfg.Backend = e.be
	e.start()

	got := e.get(run.Id)
	if got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || got.Labels["k"] != "v" || got.Pid != run.Pid || got.CreatedUnixMs != run.CreatedUnixMs {
		t.Errorf("running sandbox after the restart: %v", got)
	}
	if r := e.sh(run.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "kept\n" {
		t.Errorf("exec after the restart: %+v", r)
	}
	if got := e.get(paused.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		t.Errorf("paused sandbox after the restart: %v", got)
	}
	if _, err := e.c.ResumeSandbox(ctxT(t), &kilnpb.ResumeSandboxRequest{Id: paused.Id}); err != nil {
		t.Fatal(err)
	}
	if r := e.sh(paused.Id, "echo ok"); r.stdout != "ok\n" {
		t.Errorf("exec in the resumed sandbox: %+v", r)
	}
	if got := e.get(dead.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_FAILED || !strings.Contains(got.Reason, "restart") {
		t.Errorf("sandbox whose VMM process died: %v", got)
	}
	if got := e.get(ended.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED {
		t.Errorf("destroyed sandbox after the restart: %v", got)
	}
	list, _ := e.c.ListSandboxes(ctxT(t), &kilnpb.ListSandboxesRequest{})
	if len(list.GetSandboxes()) != 2 {
		t.Errorf("live sandboxes after the restart: %v", list.GetSandboxes())
	}
	// The taken-over sandbox is destroyed as any other.
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: run.Id})
	waitGone(t, run.Pid)
}

// TestRestartKeepsTimeouts: a lifetime is absolute across a restart.
func TestRestartKeepsTimeouts(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: 60_000})
	e.stop()
	e.start()
	e.waitPending(1)
	e.clock.Advance(61 * time.Second)
	e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
}
