package daemon_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func (e *env) hibernate(id string) *kilnpb.Sandbox {
	e.t.Helper()
	sb, err := e.c.PauseSandbox(ctxT(e.t), &kilnpb.PauseSandboxRequest{Id: id, Hibernate: true})
	if err != nil {
		e.t.Fatalf("hibernate %s: %v", id, err)
	}
	if sb.State != kilnpb.SandboxState_SANDBOX_STATE_PAUSED || !sb.Hibernated || sb.Pid != 0 || sb.Cgroup != "" {
		e.t.Fatalf("hibernated sandbox: %v", sb)
	}
	return sb
}

func (e *env) resume(id string) *kilnpb.Sandbox {
	e.t.Helper()
	sb, err := e.c.ResumeSandbox(ctxT(e.t), &kilnpb.ResumeSandboxRequest{Id: id})
	if err != nil {
		e.t.Fatalf("resume %s: %v", id, err)
	}
	if sb.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || sb.Hibernated || sb.Pid == 0 {
		e.t.Fatalf("resumed sandbox: %v", sb)
	}
	return sb
}

func (e *env) hibernatedDir(id string) string { return filepath.Join(e.state, "hibernated", id) }

// TestHibernateResume: a hibernated sandbox has no VMM process and holds
// no memory, its lifetime stands still, its in-memory checkpoints are
// written to disk, its fork children run on; the resume brings its files
// back under the same ID, with what was left of its lifetime.
func TestHibernateResume(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.HostMemoryMiB, c.MaxMemoryMiB = 3072, 3072 })
	events, err := e.c.WatchEvents(ctxT(t), &kilnpb.WatchEventsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.Header(); err != nil {
		t.Fatal(err)
	}
	sb := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: 60_000, Resources: &kilnpb.Resources{MemoryMib: 1024}})
	e.sh(sb.Id, `echo one > "$KILN_TEST_ROOT/f"`)
	held := e.checkpoint(sb.Id, false) // in memory: its VMM process holds it
	e.sh(sb.Id, `echo two > "$KILN_TEST_ROOT/f"`)
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	committed, _ := e.srv.MemoryCommit()
	e.clock.Advance(20 * time.Second)

	h := e.hibernate(sb.Id)
	waitGone(t, sb.Pid)
	if h.ExpiresUnixMs != 0 {
		t.Errorf("a hibernated sandbox expires at %d: its lifetime stands still", h.ExpiresUnixMs)
	}
	if _, err := os.Stat(e.hibernatedDir(sb.Id)); err != nil {
		t.Errorf("its state: %v", err)
	}
	if now, _ := e.srv.MemoryCommit(); now != committed-1024-64 {
		t.Errorf("committed %d MiB after the hibernation, %d before: it still counts", now, committed)
	}
	// Room for another 1 GiB sandbox only because it is hibernated.
	other := e.create(&kilnpb.CreateSandboxRequest{Resources: &kilnpb.Resources{MemoryMib: 1024}})
	cks, err := e.c.ListCheckpoints(ctxT(t), &kilnpb.ListCheckpointsRequest{SandboxId: sb.Id})
	if err != nil || len(cks.Checkpoints) != 1 || !cks.Checkpoints[0].Persisted {
		t.Fatalf("checkpoints of the hibernated sandbox: %v, %v", cks, err)
	}
	if r := e.sh(kids[0].Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "two\n" {
		t.Errorf("fork child after its parent's hibernation: %+v", r)
	}
	r := e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"true"}})
	wantCode(t, r.err, codes.FailedPrecondition, "hibernated")
	// Pause of a hibernated one changes nothing; neither does a second
	// hibernate.
	for _, hib := range []bool{false, true} {
		p, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id, Hibernate: hib})
		if err != nil || !p.Hibernated {
			t.Errorf("pause (hibernate %v) of a hibernated sandbox: %v, %v", hib, p, err)
		}
	}
	// Its lifetime does not run: 40 s were left.
	e.clock.Advance(time.Hour)
	if got := e.get(sb.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("hibernated sandbox after an hour: %v", got)
	}
	// No room for it while the other runs.
	_, err = e.c.ResumeSandbox(ctxT(t), &kilnpb.ResumeSandboxRequest{Id: sb.Id})
	wantCode(t, err, codes.ResourceExhausted, "stays hibernated")
	if got := e.get(sb.Id); !got.Hibernated {
		t.Fatalf("a failed resume: %v", got)
	}
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: other.Id})

	res := e.resume(sb.Id)
	if res.Id != sb.Id || res.Pid == sb.Pid {
		t.Errorf("resumed: %v", res)
	}
	if want := e.clock.Now().UnixMilli() + 40_000; res.ExpiresUnixMs != want {
		t.Errorf("expires at %d after the resume, want %d (40 s left)", res.ExpiresUnixMs, want)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "two\n" {
		t.Errorf("file after the resume: %+v", r)
	}
	if _, err := os.Stat(e.hibernatedDir(sb.Id)); !os.IsNotExist(err) {
		t.Errorf("its state after the resume: %v", err)
	}
	// The persisted checkpoint rolls it back.
	if _, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: held.Id}); err != nil {
		t.Fatal(err)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "one\n" {
		t.Errorf("file after the rollback: %+v", r)
	}
	var kinds []kilnpb.Event_Kind
	for len(kinds) < 3 {
		ev, err := events.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if ev.SandboxId == sb.Id && (ev.Kind == kilnpb.Event_KIND_PAUSED || ev.Kind == kilnpb.Event_KIND_RESUMED || ev.Kind == kilnpb.Event_KIND_ROLLED_BACK) {
			kinds = append(kinds, ev.Kind)
		}
	}
	if kinds[0] != kilnpb.Event_KIND_PAUSED || kinds[1] != kilnpb.Event_KIND_RESUMED {
		t.Errorf("events %v", kinds)
	}
	e.clock.Advance(41 * time.Second)
	e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
}

// TestHibernatePaused: a sandbox whose vCPUs are paused hibernates too.
func TestHibernatePaused(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	e.sh(sb.Id, `echo kept > "$KILN_TEST_ROOT/f"`)
	if _, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	e.hibernate(sb.Id)
	waitGone(t, sb.Pid)
	e.resume(sb.Id)
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "kept\n" {
		t.Errorf("file after the resume: %+v", r)
	}
}

// TestHibernateRestart: a hibernated sandbox outlives a restart of the
// server (nothing to take over, nothing pruned) and resumes after it; a
// destroy removes its state.
func TestHibernateRestart(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{Labels: map[string]string{"k": "v"}, LifetimeMs: 60_000})
	gone := e.create(nil)
	e.sh(sb.Id, `echo kept > "$KILN_TEST_ROOT/f"`)
	e.sh(gone.Id, `echo gone > "$KILN_TEST_ROOT/f"`)
	e.hibernate(sb.Id)
	e.hibernate(gone.Id)
	e.stop()
	// A leftover of a hibernation cut short goes at the start.
	stray := e.hibernatedDir("sb-stray")
	if err := os.MkdirAll(stray, 0o700); err != nil {
		t.Fatal(err)
	}
	old := e.be
	t.Cleanup(old.KillAll)
	e.be = &daemontest.Backend{}
	e.cfg.Backend = e.be
	e.start()
	if _, err := os.Stat(stray); !os.IsNotExist(err) {
		t.Errorf("a stray hibernated state survived the start: %v", err)
	}
	got := e.get(sb.Id)
	if got.State != kilnpb.SandboxState_SANDBOX_STATE_PAUSED || !got.Hibernated || got.Labels["k"] != "v" {
		t.Fatalf("hibernated sandbox after the restart: %v", got)
	}
	if e.be.Live() != 0 {
		t.Errorf("%d sandboxes run after the restart, want none", e.be.Live())
	}
	res := e.resume(sb.Id)
	if want := e.clock.Now().UnixMilli() + 60_000; res.ExpiresUnixMs != want {
		t.Errorf("expires at %d, want %d", res.ExpiresUnixMs, want)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "kept\n" {
		t.Errorf("file after the restart and resume: %+v", r)
	}
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: gone.Id}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(e.hibernatedDir(gone.Id)); !os.IsNotExist(err) {
		t.Errorf("the state of a destroyed hibernated sandbox: %v", err)
	}
	if got := e.get(gone.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED || got.Hibernated {
		t.Errorf("destroyed hibernated sandbox: %v", got)
	}
}

// TestTimeoutHibernate: a sandbox whose timeout action is hibernate is
// hibernated when its lifetime ends, and gets its lifetime again when
// resumed; when the hibernation fails it is destroyed, saying why.
func TestTimeoutHibernate(t *testing.T) {
	e := newEnv(t, nil)
	hib := kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE
	sb := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: 10_000, TimeoutAction: hib})
	if sb.TimeoutAction != hib {
		t.Fatalf("timeout action %v", sb.TimeoutAction)
	}
	e.sh(sb.Id, `echo kept > "$KILN_TEST_ROOT/f"`)
	e.waitPending(1)
	e.clock.Advance(10 * time.Second)
	got := e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_PAUSED)
	if !got.Hibernated {
		t.Fatalf("timed out: %v", got)
	}
	waitGone(t, sb.Pid)
	res := e.resume(sb.Id)
	if want := e.clock.Now().UnixMilli() + 10_000; res.ExpiresUnixMs != want {
		t.Errorf("expires at %d after the resume, want %d (its lifetime again)", res.ExpiresUnixMs, want)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "kept\n" {
		t.Errorf("file after the resume: %+v", r)
	}

	// A state folder where hibernated states cannot be written.
	if err := os.RemoveAll(filepath.Join(e.state, "hibernated")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(e.state, "hibernated"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	e.waitPending(1)
	e.clock.Advance(10 * time.Second)
	got = e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
	if !strings.Contains(got.Reason, "lifetime") || !strings.Contains(got.Reason, "hibernating it") {
		t.Errorf("reason %q", got.Reason)
	}
	waitGone(t, res.Pid)
}

// TestForkHibernated: a hibernated sandbox forks from its saved state:
// each child restores it (the parent's files and environment, its
// lineage), diverges after, and the parent stays hibernated with nothing
// of the fork left beside its state; it resumes as it was.
func TestForkHibernated(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{Env: []string{"ROLE=parent"}})
	e.sh(sb.Id, `echo saved > "$KILN_TEST_ROOT/f"`)
	e.hibernate(sb.Id)
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 3, Labels: map[string]string{"gen": "1"}})
	if err != nil || len(kids) != 3 {
		t.Fatalf("fork of hibernated %s: %v %v", sb.Id, kids, err)
	}
	for i, k := range kids {
		if k.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || k.Labels["gen"] != "1" {
			t.Errorf("child %v", k)
		}
		if r := e.sh(k.Id, `cat "$KILN_TEST_ROOT/f"; echo $ROLE`); r.stdout != "saved\nparent\n" {
			t.Errorf("child %s reads %q", k.Id, r.stdout)
		}
		e.sh(k.Id, `echo child`+string(rune('0'+i))+` > "$KILN_TEST_ROOT/f"`)
	}
	for i, k := range kids {
		if r := e.sh(k.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "child"+string(rune('0'+i))+"\n" {
			t.Errorf("child %s after diverging reads %q", k.Id, r.stdout)
		}
	}
	if got := e.get(sb.Id); !got.Hibernated {
		t.Errorf("the parent after the fork: %v", got)
	}
	left, _ := filepath.Glob(filepath.Join(e.state, "hibernated", ".fork-*"))
	if len(left) != 0 {
		t.Errorf("the fork left %v", left)
	}
	e.resume(sb.Id)
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "saved\n" {
		t.Errorf("the parent resumed reads %q", r.stdout)
	}
}

// TestHibernateFilesOnly: a hibernation that keeps only files writes the
// guest's writable-layer tar, stops the VMM process and says files_only;
// a fork's children boot the image with its files; its resume boots the image again under the
// same ID with the files applied (the double's root), the secrets'
// files written again.
func TestHibernateFilesOnly(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{Secrets: []*kilnpb.Secret{{Name: "TOKEN", Value: []byte("s3cret")}}})
	e.sh(sb.Id, `mkdir -p "$KILN_TEST_ROOT/work" && echo kept > "$KILN_TEST_ROOT/work/f"`)
	bg, cancelBg := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	defer cancelBg()
	h, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id, Hibernate: true, FilesOnly: true})
	if err != nil {
		t.Fatal(err)
	}
	if !h.Hibernated || !h.FilesOnly || h.Pid != 0 {
		t.Fatalf("hibernated keeping files: %v", h)
	}
	waitGone(t, sb.Pid)
	if _, err := os.Stat(filepath.Join(e.hibernatedDir(sb.Id), "writable.tar")); err != nil {
		t.Errorf("its files: %v", err)
	}
	// Its fork's children boot the image and apply its files, as its
	// resume does; each its own from then on.
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 2})
	if err != nil || len(kids) != 2 {
		t.Fatalf("fork of a sandbox hibernated keeping files: %v, %v", kids, err)
	}
	for i, k := range kids {
		if r := e.sh(k.Id, `cat "$KILN_TEST_ROOT/work/f" && test -n "$TOKEN" && echo `+strconv.Itoa(i)+` > "$KILN_TEST_ROOT/work/f"`); r.stdout != "kept\n" {
			t.Errorf("child %s: %+v", k.Id, r)
		}
		if k.Hibernated || k.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
			t.Errorf("child %v", k)
		}
	}
	if r := e.sh(kids[1].Id, `cat "$KILN_TEST_ROOT/work/f"`); r.stdout != "1\n" {
		t.Errorf("child 1 after the children wrote: %+v", r)
	}
	_, err = e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id, FilesOnly: true})
	wantCode(t, err, codes.InvalidArgument, "set hibernate")

	res := e.resume(sb.Id)
	if res.Id != sb.Id || res.FilesOnly || res.Pid == sb.Pid {
		t.Errorf("resumed: %v", res)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/work/f"`); r.stdout != "kept\n" {
		t.Errorf("its file after the resume: %+v", r)
	}
	if _, err := os.Stat(e.hibernatedDir(sb.Id)); !os.IsNotExist(err) {
		t.Errorf("its kept files after the resume: %v", err)
	}
	// Its background exec went with its memory: listed as killed.
	execs, err := e.c.ListExecs(ctxT(t), &kilnpb.ListExecsRequest{SandboxId: sb.Id})
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range execs.Execs {
		if x.ExecId == bg.ExecId && (x.Exit == nil || x.Exit.Signal != 9) {
			t.Errorf("the background exec after a boot: %v", x)
		}
	}
}
