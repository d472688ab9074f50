package daemon_test

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// liveExec is an Exec call whose output a test reads as it comes.
type liveExec struct {
	stream kilnpb.Kiln_ExecClient
	mu     sync.Mutex
	out    strings.Builder
	exit   chan *kilnpb.ExecExit
	id     string
}

func (e *env) liveExec(ctx context.Context, start *kilnpb.ExecStart) *liveExec {
	e.t.Helper()
	stream, err := e.c.Exec(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: start}})
	r, err := stream.Recv()
	if err != nil || r.GetStarted() == nil {
		e.t.Fatalf("exec start: %v %v", r, err)
	}
	x := &liveExec{stream: stream, exit: make(chan *kilnpb.ExecExit, 1), id: r.GetStarted().GetExecId()}
	go func() {
		for {
			r, err := stream.Recv()
			if err != nil {
				close(x.exit)
				return
			}
			x.mu.Lock()
			x.out.Write(r.GetStdout())
			x.out.Write(r.GetStderr())
			x.mu.Unlock()
			if r.GetExit() != nil {
				x.exit <- r.GetExit()
			}
		}
	}()
	return x
}

func (x *liveExec) output() string {
	x.mu.Lock()
	defer x.mu.Unlock()
	return strings.ReplaceAll(x.out.String(), "\r\n", "\n")
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	waitUntilFor(t, what, 10*time.Second, cond)
}

// waitUntilFor polls cond for up to d.
func waitUntilFor(t *testing.T, what string, d time.Duration, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(d); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestExecPtyAndUser: an exec on a terminal (size, resize, input), one as
// a named user, and the requests refused.
func TestExecPtyAndUser(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ctx := ctxT(t)
	x := e.liveExec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", `tty; stty size; echo ready; read l; stty size; echo "got $l"`},
		Pty: &kilnpb.PtySize{Rows: 24, Cols: 80}})
	waitUntil(t, "ready", func() bool { return strings.Contains(x.output(), "ready\n") })
	x.stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Resize{Resize: &kilnpb.PtySize{Rows: 50, Cols: 132}}})
	x.stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Stdin{Stdin: []byte("hi\n")}})
	if exit := <-x.exit; exit.GetExitCode() != 0 {
		t.Errorf("pty exec: %v: %q", exit, x.output())
	}
	for _, want := range []string{"/dev/pts/", "\n24 80\n", "\n50 132\n", "got hi\n"} {
		if !strings.Contains(x.output(), want) {
			t.Errorf("pty output %q lacks %q", x.output(), want)
		}
	}

	r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", `echo $(id -un) $USER`}, User: "nobody"})
	if r.err != nil || r.stdout != "nobody nobody\n" {
		t.Errorf("as nobody: %+v (%v)", r, r.err)
	}
	uid := uint32(0)
	for _, tt := range []struct {
		name  string
		start *kilnpb.ExecStart
		msg   string
	}{
		{"unknown user", &kilnpb.ExecStart{User: "no-such-user-here"}, "no-such-user-here"},
		{"user and uid", &kilnpb.ExecStart{User: "nobody", Uid: &uid}, "uid"},
		{"bad user", &kilnpb.ExecStart{User: "a:b"}, "user"},
		{"no rows", &kilnpb.ExecStart{Pty: &kilnpb.PtySize{Cols: 80}}, "pty"},
		{"huge", &kilnpb.ExecStart{Pty: &kilnpb.PtySize{Rows: 1 << 20, Cols: 80}}, "pty"},
	} {
		tt.start.SandboxId, tt.start.Argv = sb.Id, []string{"true"}
		r := e.exec(ctx, tt.start)
		wantCode(t, r.err, codes.InvalidArgument, tt.msg)
	}
}

// TestAttachExec: calls attached to a background and to a foreground exec
// see their output and exit; an exited exec answers at once.
func TestAttachExec(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ctx := ctxT(t)
	tick := []string{"sh", "-c", "while :; do echo tick; echo tock >&2; sleep 0.02; done"}
	for _, background := range []bool{true, false} {
		x := e.liveExec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: tick, Background: background})
		type attached struct {
			mu        sync.Mutex
			started   bool
			out, errb strings.Builder
			exit      *kilnpb.ExecExit
			err       error
		}
		var as [2]attached
		var wg sync.WaitGroup
		for i := range as {
			a := &as[i]
			wg.Go(func() {
				st, err := e.c.AttachExec(ctx, &kilnpb.AttachExecRequest{SandboxId: sb.Id, ExecId: x.id})
				if err != nil {
					a.err = err
					return
				}
				for {
					r, err := st.Recv()
					a.mu.Lock()
					if err != nil {
						a.err = err
						a.mu.Unlock()
						return
					}
					a.started = a.started || r.GetStarted().GetExecId() == x.id
					a.out.Write(r.GetStdout())
					a.errb.Write(r.GetStderr())
					if r.GetExit() != nil {
						a.exit = r.GetExit()
						a.mu.Unlock()
						return
					}
					a.mu.Unlock()
				}
			})
		}
		for i := range as {
			a := &as[i]
			waitUntil(t, "output", func() bool {
				a.mu.Lock()
				defer a.mu.Unlock()
				return a.err != nil || strings.Contains(a.out.String(), "tick") && strings.Contains(a.errb.String(), "tock")
			})
		}
		if _, err := e.c.KillExec(ctx, &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: x.id}); err != nil {
			t.Fatal(err)
		}
		wg.Wait()
		for i := range as {
			a := &as[i]
			if a.err != nil || !a.started || a.exit.GetSignal() != 9 {
				t.Errorf("background %v: attacher %d: started %v, exit %v, err %v", background, i, a.started, a.exit, a.err)
			}
		}
		// Exited: its exit at once.
		st, err := e.c.AttachExec(ctx, &kilnpb.AttachExecRequest{SandboxId: sb.Id, ExecId: x.id})
		if err != nil {
			t.Fatal(err)
		}
		var exit *kilnpb.ExecExit
		for {
			r, err := st.Recv()
			if err != nil {
				break
			}
			if r.GetExit() != nil {
				exit = r.GetExit()
			}
		}
		if exit.GetSignal() != 9 {
			t.Errorf("background %v: attach after the exit: %v", background, exit)
		}
	}
	st, err := e.c.AttachExec(ctx, &kilnpb.AttachExecRequest{SandboxId: sb.Id, ExecId: "ex-nope"})
	if err == nil {
		_, err = st.Recv()
	}
	wantCode(t, err, codes.NotFound, "ex-nope")
}

// TestFilesOwnersDepthMoveWatch: owned writes and directories, owner
// names, deep listings, moves and a watch seeing what execs and file
// calls do.
func TestFilesOwnersDepthMoveWatch(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ctx := ctxT(t)
	fi, err := e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: sb.Id, Path: "/home/n/f", MakeParents: true, User: "nobody"}, []byte("x"))
	if err != nil || fi.Owner != "nobody" || fi.Uid == 0 {
		t.Fatalf("owned write: %v %v", fi, err)
	}
	if d, err := e.c.Stat(ctx, &kilnpb.StatRequest{SandboxId: sb.Id, Path: "/home/n"}); err != nil || d.Owner != "nobody" {
		t.Errorf("parent made by the write: %v %v", d, err)
	}
	if d, err := e.c.MakeDir(ctx, &kilnpb.MakeDirRequest{SandboxId: sb.Id, Path: "/home/m", User: "nobody"}); err != nil || d.Owner != "nobody" || d.Group == "" {
		t.Errorf("owned mkdir: %v %v", d, err)
	}
	_, err = e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: sb.Id, Path: "/x", User: "no-such-user-here"}, nil)
	wantCode(t, err, codes.InvalidArgument, "no-such-user-here")

	l, err := e.c.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: sb.Id, Path: "/home", Depth: 2})
	var paths []string
	for _, x := range l.GetEntries() {
		paths = append(paths, x.Path)
	}
	if err != nil || strings.Join(paths, " ") != "/home/m /home/n /home/n/f" {
		t.Errorf("depth 2: %q %v", paths, err)
	}
	_, err = e.c.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: sb.Id, Path: "/home", Depth: 1 << 20})
	wantCode(t, err, codes.InvalidArgument, "depth")

	mv, err := e.c.Move(ctx, &kilnpb.MoveRequest{SandboxId: sb.Id, Source: "/home/n/f", Destination: "/home/m/g"})
	if err != nil || mv.Path != "/home/m/g" || mv.Size != 1 {
		t.Errorf("move: %v %v", mv, err)
	}
	_, err = e.c.Move(ctx, &kilnpb.MoveRequest{SandboxId: sb.Id, Source: "/home/n/f", Destination: "/home/m/h"})
	wantCode(t, err, codes.NotFound, "/home/n/f")
	_, err = e.c.Move(ctx, &kilnpb.MoveRequest{SandboxId: sb.Id, Source: "/home/../etc", Destination: "/e"})
	wantCode(t, err, codes.InvalidArgument, "source")
	_, err = e.c.Move(ctx, &kilnpb.MoveRequest{SandboxId: sb.Id, Source: "/home", Destination: "/"})
	wantCode(t, err, codes.InvalidArgument, "root")

	// A recursive watch: started first, then what an exec and the file
	// calls do, named relative to the directory.
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := e.c.WatchDir(wctx, &kilnpb.WatchDirRequest{SandboxId: sb.Id, Path: "/home", Recursive: true})
	if err != nil {
		t.Fatal(err)
	}
	first, err := w.Recv()
	if err != nil || !first.Started {
		t.Fatalf("first event: %v %v", first, err)
	}
	events := make(chan *kilnpb.WatchEvent, 100)
	go func() {
		for {
			ev, err := w.Recv()
			if err != nil {
				close(events)
				return
			}
			events <- ev
		}
	}()
	want := func(op kilnpb.WatchEvent_Op, name string) {
		t.Helper()
		timeout := time.After(10 * time.Second)
		for {
			select {
			case ev, ok := <-events:
				if !ok {
					t.Fatalf("the watch ended before %v %s", op, name)
				}
				if ev.Op == op && ev.Name == name {
					if op == kilnpb.WatchEvent_OP_CREATE && ev.GetEntry().GetPath() != "/home/"+name {
						t.Errorf("entry of %s: %v", name, ev.Entry)
					}
					return
				}
			case <-timeout:
				t.Fatalf("no %v %s", op, name)
			}
		}
	}
	e.sh(sb.Id, `echo hi > "$KILN_TEST_ROOT/home/by-exec"`)
	want(kilnpb.WatchEvent_OP_CREATE, "by-exec")
	e.c.MakeDir(ctx, &kilnpb.MakeDirRequest{SandboxId: sb.Id, Path: "/home/sub"})
	want(kilnpb.WatchEvent_OP_CREATE, "sub")
	e.writeFile(ctx, &kilnpb.WriteFileHeader{SandboxId: sb.Id, Path: "/home/sub/deep"}, []byte("d"))
	want(kilnpb.WatchEvent_OP_CREATE, "sub/deep") // renamed into place
	e.c.Remove(ctx, &kilnpb.RemoveRequest{SandboxId: sb.Id, Path: "/home/sub/deep"})
	want(kilnpb.WatchEvent_OP_REMOVE, "sub/deep")
	cancel()
	for range events {
	}

	ws, err := e.c.WatchDir(ctx, &kilnpb.WatchDirRequest{SandboxId: sb.Id, Path: "rel"})
	if err == nil {
		_, err = ws.Recv()
	}
	wantCode(t, err, codes.InvalidArgument, "path")
}
