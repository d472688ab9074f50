package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func (e *env) checkpoint(id string, keep bool) *kilnpb.CheckpointInfo {
	e.t.Helper()
	ck, err := e.c.Checkpoint(ctxT(e.t), &kilnpb.CheckpointRequest{SandboxId: id, Keep: keep})
	if err != nil {
		e.t.Fatalf("checkpoint %s: %v", id, err)
	}
	return ck
}

func (e *env) fork(req *kilnpb.ForkRequest) ([]*kilnpb.Sandbox, error) {
	return e.forkCtx(ctxT(e.t), req)
}

func (e *env) forkCtx(ctx context.Context, req *kilnpb.ForkRequest) ([]*kilnpb.Sandbox, error) {
	if req.RequestId == "" {
		req.RequestId = nextReq()
	}
	stream, err := e.c.Fork(ctx, req)
	if err != nil {
		return nil, err
	}
	var out []*kilnpb.Sandbox
	for {
		sb, err := stream.Recv()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, sb)
	}
}

func ids(sbs []*kilnpb.Sandbox) string {
	var out []string
	for _, sb := range sbs {
		out = append(out, sb.Id)
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

func TestRollback(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	e.sh(sb.Id, `echo v1 > "$KILN_TEST_ROOT/f"`)
	ck1 := e.checkpoint(sb.Id, false)
	e.clock.Advance(time.Millisecond)
	e.sh(sb.Id, `echo v2 > "$KILN_TEST_ROOT/f"`)
	ck2 := e.checkpoint(sb.Id, false)
	if ck1.ParentId != "" || ck2.ParentId != ck1.Id || ck2.Persisted {
		t.Errorf("checkpoints: %v, %v", ck1, ck2)
	}
	e.sh(sb.Id, `rm "$KILN_TEST_ROOT/f"`)
	bg, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	cancel()
	got, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck1.Id})
	if err != nil {
		t.Fatal(err)
	}
	if got.Id != sb.Id || got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || got.Checkpoint != ck1.Id {
		t.Errorf("rolled back: %v", got)
	}
	if r := e.sh(sb.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "v1\n" {
		t.Errorf("after the rollback the file reads %q", r.stdout)
	}
	waitGone(t, bg.Pid)
	// The next checkpoint is a child of the rollback's target: a tree.
	e.clock.Advance(time.Millisecond)
	ck3 := e.checkpoint(sb.Id, false)
	if ck3.ParentId != ck1.Id {
		t.Errorf("checkpoint after the rollback has parent %q, want %s", ck3.ParentId, ck1.Id)
	}
	list, err := e.c.ListCheckpoints(ctxT(t), &kilnpb.ListCheckpointsRequest{SandboxId: sb.Id})
	if err != nil || len(list.Checkpoints) != 3 || list.Checkpoints[0].Id != ck1.Id {
		t.Fatalf("ListCheckpoints: %v %v", list, err)
	}
	// Only its own checkpoints.
	other := e.create(nil)
	_, err = e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: other.Id, CheckpointId: ck1.Id})
	wantCode(t, err, codes.FailedPrecondition, "its own checkpoints")
	_, err = e.c.DeleteCheckpoint(ctxT(t), &kilnpb.DeleteCheckpointRequest{Id: ck1.Id})
	wantCode(t, err, codes.FailedPrecondition, "child checkpoint")
	if _, err := e.c.DeleteCheckpoint(ctxT(t), &kilnpb.DeleteCheckpointRequest{Id: ck3.Id}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.state, "checkpoints", ck3.Id)); !os.IsNotExist(err) {
		t.Errorf("deleted checkpoint left its folder: %v", err)
	}
}

func TestFork(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(&kilnpb.CreateSandboxRequest{Env: []string{"ROLE=parent"}})
	e.sh(sb.Id, `echo base > "$KILN_TEST_ROOT/f"`)
	ck1 := e.checkpoint(sb.Id, false)
	e.sh(sb.Id, `echo level2 > "$KILN_TEST_ROOT/f"`)
	ck2 := e.checkpoint(sb.Id, false)

	// From a checkpoint two levels deep.
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck2.Id}, Count: 3, Labels: map[string]string{"gen": "1"}, RequestId: "fork-1"})
	if err != nil || len(kids) != 3 {
		t.Fatalf("fork from %s: %v %v", ck2.Id, kids, err)
	}
	for _, k := range kids {
		if k.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || k.Checkpoint != ck2.Id || k.Labels["gen"] != "1" {
			t.Errorf("child %v", k)
		}
		if r := e.sh(k.Id, `cat "$KILN_TEST_ROOT/f"; echo $ROLE`); r.stdout != "level2\nparent\n" {
			t.Errorf("child %s reads %q", k.Id, r.stdout)
		}
	}
	// A retry streams the same children; other parameters are refused.
	again, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck2.Id}, Count: 3, Labels: map[string]string{"gen": "1"}, RequestId: "fork-1"})
	if err != nil || ids(again) != ids(kids) {
		t.Errorf("retried fork: %s %v, want %s", ids(again), err, ids(kids))
	}
	_, err = e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck1.Id}, Count: 3, RequestId: "fork-1"})
	wantCode(t, err, codes.AlreadyExists, "fork-1")

	// From the running sandbox: its state now.
	e.sh(sb.Id, `echo now > "$KILN_TEST_ROOT/f"`)
	live, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 2})
	if err != nil || len(live) != 2 {
		t.Fatalf("fork of %s: %v %v", sb.Id, live, err)
	}
	for _, k := range live {
		if r := e.sh(k.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "now\n" {
			t.Errorf("child %s reads %q", k.Id, r.stdout)
		}
	}
	// Children survive a restart like any sandbox.
	e.stop()
	e.start()
	for _, k := range append(kids, live...) {
		if got := e.get(k.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
			t.Errorf("child %s after a restart: %v", k.Id, got)
		}
	}
	again, err = e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck2.Id}, Count: 3, Labels: map[string]string{"gen": "1"}, RequestId: "fork-1"})
	if err != nil || ids(again) != ids(kids) {
		t.Errorf("retried fork after a restart: %s %v, want %s", ids(again), err, ids(kids))
	}
	// A checkpoint taken before the restart still forks.
	if more, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck1.Id}, Count: 1}); err != nil || len(more) != 1 {
		t.Errorf("fork of a checkpoint after a restart: %v %v", more, err)
	}
	// The sandbox's checkpoints go with it, but those kept.
	ck3 := e.checkpoint(sb.Id, true)
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id})
	list, err := e.c.ListCheckpoints(ctxT(t), &kilnpb.ListCheckpointsRequest{SandboxId: sb.Id})
	if err != nil || len(list.Checkpoints) != 1 || list.Checkpoints[0].Id != ck3.Id {
		t.Errorf("checkpoints after destroy: %v %v", list, err)
	}
	if _, err := os.Stat(filepath.Join(e.state, "checkpoints", ck1.Id)); !os.IsNotExist(err) {
		t.Errorf("a checkpoint outlived its sandbox: %v", err)
	}
}

func TestForkInvalid(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.MaxSandboxes = 4 })
	sb := e.create(nil)
	tests := []struct {
		name string
		req  *kilnpb.ForkRequest
		code codes.Code
		msg  string
	}{
		{"no count", &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, RequestId: "f1"}, codes.InvalidArgument, "count 0"},
		{"no source", &kilnpb.ForkRequest{Count: 1, RequestId: "f2"}, codes.InvalidArgument, "no source"},
		{"unknown sandbox", &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: "sb-nope"}, Count: 1, RequestId: "f3"}, codes.NotFound, "sb-nope"},
		{"unknown checkpoint", &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: "ck-nope"}, Count: 1, RequestId: "f4"}, codes.NotFound, "ck-nope"},
		{"over the host limit", &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 4, RequestId: "f5"}, codes.ResourceExhausted, "limit is 4"},
		{"lifetime under idle", &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 1, LifetimeMs: 10, IdleTimeoutMs: 20, RequestId: "f6"}, codes.InvalidArgument, "idle"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.fork(tc.req)
			wantCode(t, err, tc.code, tc.msg)
		})
	}
	stream, err := e.c.Fork(ctxT(t), &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 1})
	if err == nil {
		_, err = stream.Recv()
	}
	wantCode(t, err, codes.InvalidArgument, "request_id is empty")
	if n := e.be.Live(); n != 1 {
		t.Errorf("%d sandboxes after refused forks, want 1", n)
	}
}

// TestRollbackToOrigin: a sandbox made from a checkpoint rolls back to
// it, though the checkpoint is another sandbox's.
func TestRollbackToOrigin(t *testing.T) {
	e := newEnv(t, nil)
	parent := e.create(nil)
	e.sh(parent.Id, `echo start > "$KILN_TEST_ROOT/f"`)
	ck := e.checkpoint(parent.Id, false)
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck.Id}, Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	kid := kids[0]
	e.sh(kid.Id, `echo changed > "$KILN_TEST_ROOT/f"`)
	if _, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: kid.Id, CheckpointId: ck.Id}); err != nil {
		t.Fatal(err)
	}
	if r := e.sh(kid.Id, `cat "$KILN_TEST_ROOT/f"`); r.stdout != "start\n" {
		t.Errorf("after the rollback: %q", r.stdout)
	}
}

// TestRollbackRaces: execs, rollbacks and a destroy at once end in a
// destroyed sandbox with nothing left, under -race.
func TestRollbackRaces(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ck := e.checkpoint(sb.Id, false)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				// Execs racing a rollback may fail (the machine goes
				// under them); they must not hang, panic or race.
				e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"true"}, Background: true})
			}
		}()
	}
	for range 3 {
		if _, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck.Id}); err != nil {
			t.Fatal(err)
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck.Id})
	}()
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	<-done
	close(stop)
	wg.Wait()
	e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_DESTROYED)
	deadline := time.Now().Add(5 * time.Second)
	for e.be.Live() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d sandboxes left", e.be.Live())
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestInMemoryCheckpoints: a checkpoint is held by the sandbox's VMM
// process (no snapshot in the state folder) unless persisted or kept;
// forks and creates restore from it; a rollback moves the sandbox's holds
// to its new machine; a restart finds them; they go with the sandbox.
func TestInMemoryCheckpoints(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	e.sh(sb.Id, `echo one > "$KILN_TEST_ROOT/f"`)
	ck1 := e.checkpoint(sb.Id, false)
	e.sh(sb.Id, `echo two > "$KILN_TEST_ROOT/f"`)
	ck2 := e.checkpoint(sb.Id, false)
	persisted, err := e.c.Checkpoint(ctxT(t), &kilnpb.CheckpointRequest{SandboxId: sb.Id, Persist: true})
	if err != nil {
		t.Fatal(err)
	}
	kept := e.checkpoint(sb.Id, true)
	if ck1.Persisted || ck2.Persisted || !persisted.Persisted || !kept.Persisted || !kept.Keep {
		t.Fatalf("checkpoints: %v %v %v %v", ck1, ck2, persisted, kept)
	}
	for _, c := range []struct {
		id   string
		want bool
	}{{ck1.Id, false}, {ck2.Id, false}, {persisted.Id, true}, {kept.Id, true}} {
		_, err := os.Stat(filepath.Join(e.state, "checkpoints", c.id))
		if got := err == nil; got != c.want {
			t.Errorf("checkpoint %s: a snapshot folder in the state folder: %v, want %v", c.id, got, c.want)
		}
	}
	read := func(id string) string {
		t.Helper()
		return e.sh(id, `cat "$KILN_TEST_ROOT/f"`).stdout
	}
	// A create and a fork from in-memory checkpoints.
	kid := e.create(&kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Checkpoint{Checkpoint: ck1.Id}})
	if got := read(kid.Id); got != "one\n" {
		t.Errorf("created from %s: %q", ck1.Id, got)
	}
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck2.Id}, Count: 2})
	if err != nil || len(kids) != 2 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	for _, k := range kids {
		if got := read(k.Id); got != "two\n" {
			t.Errorf("forked from %s: %q", ck2.Id, got)
		}
	}
	// A rollback to ck1 keeps ck2 (its hold moves to the new machine).
	if _, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck1.Id}); err != nil {
		t.Fatal(err)
	}
	if got := read(sb.Id); got != "one\n" {
		t.Errorf("after the rollback to %s: %q", ck1.Id, got)
	}
	if _, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck2.Id}); err != nil {
		t.Fatalf("rollback to %s after a rollback: %v", ck2.Id, err)
	}
	if got := read(sb.Id); got != "two\n" {
		t.Errorf("after the rollback to %s: %q", ck2.Id, got)
	}
	// A restart finds the holds.
	e.stop()
	e.start()
	list, err := e.c.ListCheckpoints(ctxT(t), &kilnpb.ListCheckpointsRequest{SandboxId: sb.Id})
	if err != nil || len(list.Checkpoints) != 4 {
		t.Fatalf("after a restart: %v %v", list, err)
	}
	again, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck1.Id}, Count: 1})
	if err != nil || len(again) != 1 || read(again[0].Id) != "one\n" {
		t.Fatalf("fork after a restart: %v %v", again, err)
	}
	// Deleting one releases its hold.
	ck3 := e.checkpoint(sb.Id, false)
	if ck3.ParentId != ck2.Id {
		t.Errorf("checkpoint after the rollback to %s: %v", ck2.Id, ck3)
	}
	if _, err := e.c.DeleteCheckpoint(ctxT(t), &kilnpb.DeleteCheckpointRequest{Id: ck3.Id}); err != nil {
		t.Fatal(err)
	}
	if held, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", sb.Id, "holds", "*")); len(held) != 2 {
		t.Errorf("holds after deleting %s: %v", ck3.Id, held)
	}
	// Destroyed: its in-memory and persisted checkpoints go, the kept one
	// stays; its children run on.
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{ck1.Id, persisted.Id} {
		_, err := e.c.Fork(ctxT(t), &kilnpb.ForkRequest{RequestId: nextReq(), Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: id}, Count: 1})
		if err == nil {
			_, err = e.forkCtx(ctxT(t), &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: id}, Count: 1})
		}
		wantCode(t, err, codes.NotFound, id)
	}
	if left, _ := os.ReadDir(filepath.Join(e.state, "checkpoints")); len(left) != 2 { // kept: its record and folder
		t.Errorf("left in the checkpoints folder: %v", left)
	}
	if got := read(kid.Id); got != "one\n" {
		t.Errorf("a child after its origin's sandbox ended: %q", got)
	}
	last, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: kept.Id}, Count: 1})
	if err != nil || len(last) != 1 {
		t.Fatalf("fork of a kept checkpoint: %v %v", last, err)
	}
}

// TestForkIndexPruned: a fork's request ID is remembered while one of its
// children is, and forgotten with the last: 1,000 forks whose children
// ended and were pruned leave no request ID behind (kiln_fork_requests),
// and a retry of a pruned fork's request ID forks anew instead of
// "succeeding" with no children.
func TestForkIndexPruned(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.KeepEnded = 1 })
	parent := e.create(nil)
	const forks = 1000
	for i := range forks {
		kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: parent.Id}, Count: 1, RequestId: fmt.Sprintf("f-%d", i)})
		if err != nil || len(kids) != 1 {
			t.Fatalf("fork %d: %v %v", i, kids, err)
		}
		e.clock.Advance(time.Millisecond)
		if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: kids[0].Id}); err != nil {
			t.Fatal(err)
		}
	}
	// The last child is the one ended sandbox kept (KeepEnded 1): its
	// fork is still remembered, and a retry gets that child.
	if got := metricValue(t, e.srv, "kiln_fork_requests", nil); got != 1 {
		t.Errorf("kiln_fork_requests with the last child kept = %v, want 1", got)
	}
	last := fmt.Sprintf("f-%d", forks-1)
	again, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: parent.Id}, Count: 1, RequestId: last})
	if err != nil || len(again) != 1 || again[0].State != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED {
		t.Errorf("a retry of the last fork: %v %v, want its one destroyed child", again, err)
	}
	// Another sandbox's end prunes the last child: nothing is remembered.
	other := e.create(nil)
	e.clock.Advance(time.Millisecond)
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: other.Id}); err != nil {
		t.Fatal(err)
	}
	if got := metricValue(t, e.srv, "kiln_fork_requests", nil); got != 0 {
		t.Errorf("kiln_fork_requests after %d forks whose children were pruned = %v, want 0", forks, got)
	}
	// A retry of a pruned request ID, the same fork, is a new fork: a
	// new child, not a success with none.
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: parent.Id}, Count: 1, RequestId: "f-0"})
	if err != nil || len(kids) != 1 || kids[0].State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("a retry of pruned fork f-0: %v %v, want a new running child", kids, err)
	}
	if got := metricValue(t, e.srv, "kiln_fork_requests", nil); got != 1 {
		t.Errorf("kiln_fork_requests after the new fork = %v, want 1", got)
	}
}

// TestDestroyDuringFailingRollback: a destroy that comes while a rollback
// starts its new machine stands when that machine then fails to start
// (c4fe7ad): the sandbox stays destroyed, it does not fail or run again.
func TestDestroyDuringFailingRollback(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ck := e.checkpoint(sb.Id, false)
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	e.be.CreateHook = func(ctx context.Context, spec daemon.CreateSpec) error {
		once.Do(func() { close(entered) })
		select {
		case <-release:
		case <-ctx.Done():
		}
		return errors.New("the new machine did not start")
	}
	done := make(chan error, 1)
	go func() {
		_, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck.Id})
		done <- err
	}()
	<-entered
	if got := e.get(sb.Id).State; got != kilnpb.SandboxState_SANDBOX_STATE_STARTING {
		t.Errorf("rolling back, it shows %v", got)
	}
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	close(release)
	if err := <-done; err == nil {
		t.Fatal("the rollback succeeded")
	}
	if got := e.get(sb.Id); got.State != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED || got.Reason != "destroyed on request" {
		t.Errorf("destroyed during a failing rollback, it is %v (%s)", got.State, got.Reason)
	}
	if n := e.be.Live(); n != 0 {
		t.Errorf("%d machines left", n)
	}
}
