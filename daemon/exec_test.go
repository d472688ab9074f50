package daemon_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestExecStdinAndTimeout(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	r := e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"cat"}, HasStdin: true}, []byte("hello "), []byte("world"))
	if r.err != nil || r.stdout != "hello world" || r.exit.GetExitCode() != 0 {
		t.Errorf("cat: %+v", r)
	}
	r = e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "30"}, TimeoutMs: 50})
	if r.err != nil || !r.exit.GetTimedOut() || r.exit.GetSignal() != int32(syscall.SIGKILL) {
		t.Errorf("timed-out exec: %+v", r)
	}
	r = e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"no-such-program-kiln"}})
	wantCode(t, r.err, codes.NotFound, "no-such-program-kiln")
}

func TestExecInvalid(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	tests := []struct {
		name  string
		start *kilnpb.ExecStart
		msg   string
	}{
		{"empty argv", &kilnpb.ExecStart{SandboxId: sb.Id}, "argv is empty"},
		{"NUL in argv", &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"echo", "a\x00b"}}, "NUL"},
		{"relative cwd", &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"true"}, Cwd: "tmp"}, "relative"},
		{"escaping cwd", &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"true"}, Cwd: "/../.."}, `".."`},
		{"negative timeout", &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"true"}, TimeoutMs: -5}, "timeout_ms"},
		{"bad env", &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"true"}, Env: []string{"=x"}}, "NAME=VALUE"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			wantCode(t, e.exec(ctxT(t), tc.start).err, codes.InvalidArgument, tc.msg)
		})
	}
	// The first message must be the start.
	stream, err := e.c.Exec(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Stdin{Stdin: []byte("x")}})
	_, err = stream.Recv()
	wantCode(t, err, codes.InvalidArgument, "ExecStart")
}

func TestConcurrentExecs(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", fmt.Sprintf("sleep 0.0%d; echo %d", i%10, i)}})
			if r.err != nil || r.stdout != fmt.Sprintf("%d\n", i) {
				errs <- fmt.Errorf("exec %d: %+v", i, r)
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// alive says host process pid runs (the double's execs are host
// processes); a zombie counts as gone.
func alive(pid int32) bool {
	return syscall.Kill(int(pid), 0) == nil && !zombie(pid)
}

func waitGone(t *testing.T, pid int32) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d still runs", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// startExec starts an exec and returns its ExecStarted and the call's
// cancel.
func (e *env) startExec(start *kilnpb.ExecStart) (*kilnpb.ExecStarted, context.CancelFunc) {
	e.t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stream, err := e.c.Exec(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: start}})
	resp, err := stream.Recv()
	if err != nil || resp.GetStarted() == nil {
		e.t.Fatalf("exec start: %v %v", resp, err)
	}
	return resp.GetStarted(), cancel
}

func TestExecDisconnect(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	// A foreground exec dies with its call.
	fg, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}})
	cancel()
	waitGone(t, fg.Pid)
	// A background one runs on, listed, until killed.
	bg, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	cancel()
	time.Sleep(50 * time.Millisecond)
	if !alive(bg.Pid) {
		t.Fatal("the background exec died with its call")
	}
	list, err := e.c.ListExecs(ctxT(t), &kilnpb.ListExecsRequest{SandboxId: sb.Id})
	if err != nil {
		t.Fatal(err)
	}
	var found *kilnpb.ExecInfo
	for _, x := range list.Execs {
		if x.ExecId == bg.ExecId {
			found = x
		}
	}
	if found == nil || !found.Background || found.Exit != nil || found.Argv[0] != "sleep" {
		t.Fatalf("ListExecs: %v", list.Execs)
	}
	if _, err := e.c.KillExec(ctxT(t), &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: bg.ExecId}); err != nil {
		t.Fatal(err)
	}
	waitGone(t, bg.Pid)
	deadline := time.Now().Add(5 * time.Second)
	for {
		list, _ = e.c.ListExecs(ctxT(t), &kilnpb.ListExecsRequest{SandboxId: sb.Id})
		exited := false
		for _, x := range list.Execs {
			if x.ExecId == bg.ExecId && x.Exit != nil {
				exited = x.Exit.Signal == int32(syscall.SIGKILL)
			}
		}
		if exited {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("killed exec not listed as killed: %v", list.Execs)
		}
		time.Sleep(5 * time.Millisecond)
	}
	_, err = e.c.KillExec(ctxT(t), &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: bg.ExecId})
	wantCode(t, err, codes.FailedPrecondition, "exited")
	_, err = e.c.KillExec(ctxT(t), &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: "ex-nope"})
	wantCode(t, err, codes.NotFound, "ex-nope")
	// A background exec ends with its sandbox.
	bg2, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	cancel()
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id})
	waitGone(t, bg2.Pid)
}

func TestExecSignal(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ctx := ctxT(t)
	stream, err := e.c.Exec(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}}}})
	if resp, err := stream.Recv(); err != nil || resp.GetStarted() == nil {
		t.Fatalf("start: %v %v", resp, err)
	}
	stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Signal{Signal: &kilnpb.ExecSignal{Signal: int32(syscall.SIGTERM)}}})
	for {
		resp, err := stream.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if x := resp.GetExit(); x != nil {
			if x.Signal != int32(syscall.SIGTERM) || x.ExitCode != -1 {
				t.Errorf("exit after SIGTERM: %v", x)
			}
			return
		}
	}
}

// zombie says process pid has exited but is not reaped yet.
func zombie(pid int32) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	i := strings.LastIndexByte(string(b), ')')
	return i < 0 || i+2 >= len(b) || b[i+2] == 'Z'
}

// listExec returns sandbox id's exec execID as ListExecs lists it, nil
// if it is not listed.
func (e *env) listExec(id, execID string) *kilnpb.ExecInfo {
	e.t.Helper()
	list, err := e.c.ListExecs(ctxT(e.t), &kilnpb.ListExecsRequest{SandboxId: id})
	if err != nil {
		e.t.Fatal(err)
	}
	for _, x := range list.Execs {
		if x.ExecId == execID {
			return x
		}
	}
	return nil
}

// waitExit waits until ListExecs lists exec execID as exited.
func (e *env) waitExit(id, execID string) *kilnpb.ExecExit {
	e.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		if x := e.listExec(id, execID); x != nil && x.Exit != nil {
			return x.Exit
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("exec %s not listed as exited", execID)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestExecBackgroundSurvivesRestart: background execs are the sandbox's
// detached processes, which a server's restart leaves running and the
// next server lists, kills and sees exit; foreground ones die with their
// call, restart or not.
func TestExecBackgroundSurvivesRestart(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	long, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	cancel()
	short, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", "sleep 0.3; exit 3"}, Background: true})
	defer cancel() // its call is open when the server stops
	killed, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	cancel()
	fg, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}})
	defer cancel()

	e.stop()
	waitGone(t, fg.Pid) // its call ended with the server
	waitGone(t, short.Pid)
	if !alive(long.Pid) || !alive(killed.Pid) {
		t.Fatal("a background exec died with the server")
	}
	e.start()

	// KillExec as the new server's first call finds its exec.
	if _, err := e.c.KillExec(ctxT(t), &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: killed.ExecId, Signal: int32(syscall.SIGTERM)}); err != nil {
		t.Fatal(err)
	}
	waitGone(t, killed.Pid)
	if x := e.waitExit(sb.Id, killed.ExecId); x.Signal != int32(syscall.SIGTERM) || x.ExitCode != -1 {
		t.Errorf("exec killed after the restart: exit %v", x)
	}

	x := e.listExec(sb.Id, long.ExecId)
	if x == nil || !x.Background || x.Exit != nil || x.Pid != long.Pid || strings.Join(x.Argv, " ") != "sleep 1000" || x.StartedUnixMs == 0 {
		t.Fatalf("background exec after the restart: %v", x)
	}
	if x := e.listExec(sb.Id, short.ExecId); x == nil || x.Exit == nil || x.Exit.ExitCode != 3 {
		t.Errorf("background exec that exited while the server was down: %v", x)
	}
	if x := e.listExec(sb.Id, fg.ExecId); x != nil {
		t.Errorf("foreground exec listed after the restart: %v", x)
	}
	if _, err := e.c.KillExec(ctxT(t), &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: long.ExecId}); err != nil {
		t.Fatal(err)
	}
	waitGone(t, long.Pid)
	if x := e.waitExit(sb.Id, long.ExecId); x.Signal != int32(syscall.SIGKILL) {
		t.Errorf("exec killed after the restart: exit %v", x)
	}
	_, err := e.c.KillExec(ctxT(t), &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: long.ExecId})
	wantCode(t, err, codes.FailedPrecondition, "exited")

	// One started after the restart ends with its sandbox, as before.
	again, cancel := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sleep", "1000"}, Background: true})
	cancel()
	e.stop()
	e.start()
	if x := e.listExec(sb.Id, again.ExecId); x == nil || x.Exit != nil {
		t.Fatalf("background exec after a second restart: %v", x)
	}
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id})
	waitGone(t, again.Pid)
}
