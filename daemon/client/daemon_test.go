package client

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// serveDaemon serves package daemon over its test backend (host folders,
// host processes) on a Unix socket and returns a client of it.
func serveDaemon(t *testing.T) (*Client, *daemontest.Backend) {
	t.Helper()
	be := &daemontest.Backend{}
	t.Cleanup(be.KillAll)
	srv, err := daemon.New(daemon.Config{StateDir: t.TempDir(), Backend: be, HostMemoryMiB: 16384, HostCPUs: 8,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "kilnd.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	go gs.Serve(ln)
	c := dial(t, sock)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		sbs, _ := c.ListSandboxes(ctx, ListOptions{})
		for _, sb := range sbs {
			c.DestroySandbox(ctx, sb.GetId())
		}
		gs.Stop()
		srv.Close(ctx)
	})
	return c, be
}

func image() *kilnpb.CreateSandboxRequest {
	return &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}}
}

// TestDaemonExecs: concurrent execs in one sandbox, background execs that
// are listed and killed, and a foreground exec killed when its caller
// goes away.
func TestDaemonExecs(t *testing.T) {
	c, _ := serveDaemon(t)
	ctx := testContext(t)
	sb, err := c.CreateSandbox(ctx, image())
	if err != nil {
		t.Fatal(err)
	}
	id := sb.GetId()

	var wg sync.WaitGroup
	errs := make(chan error, 20)
	for i := range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var out bytes.Buffer
			res, err := c.Exec(ctx, id, ExecOptions{Argv: []string{"sh", "-c", fmt.Sprintf("sleep 0.1; echo %d; exit %d", i, i%3)}, Stdout: &out})
			switch {
			case err != nil:
				errs <- err
			case res.ExitCode != i%3 || out.String() != fmt.Sprintf("%d\n", i):
				errs <- fmt.Errorf("exec %d: %+v, %q", i, res, out.String())
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	bg, err := c.Exec(ctx, id, ExecOptions{Argv: []string{"sleep", "30"}, Background: true})
	if err != nil || bg.Exited {
		t.Fatalf("background exec: %+v, %v", bg, err)
	}
	execs, err := c.ListExecs(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range execs {
		if e.GetExecId() == bg.ExecID {
			found = e.GetBackground() && e.GetExit() == nil
		}
	}
	if !found {
		t.Fatalf("ListExecs %v: want %s running in the background", execs, bg.ExecID)
	}
	if err := c.KillExec(ctx, id, bg.ExecID, 0); err != nil {
		t.Fatal(err)
	}
	waitExit(t, ctx, c, id, bg.ExecID, int32(syscall.SIGKILL))
	wantCode(t, c.KillExec(ctx, id, "ex-missing", 0), codes.NotFound, "kill an unknown exec")

	// A foreground exec dies with its call.
	cctx, cancel := context.WithCancel(ctx)
	started := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(cctx, id, ExecOptions{Argv: []string{"sleep", "30"}, Started: func(e string, _ int32) { started <- e }})
		done <- err
	}()
	fg := <-started
	cancel()
	wantCode(t, <-done, codes.Canceled, "exec whose caller went away")
	waitExit(t, ctx, c, id, fg, int32(syscall.SIGKILL))
}

// waitExit waits until ListExecs reports execID ended by signal sig.
func waitExit(t *testing.T, ctx context.Context, c *Client, id, execID string, sig int32) {
	t.Helper()
	for {
		execs, err := c.ListExecs(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range execs {
			if e.GetExecId() == execID && e.GetExit() != nil {
				if e.GetExit().GetSignal() != sig {
					t.Fatalf("exec %s ended %v; want signal %d", execID, e.GetExit(), sig)
				}
				return
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("exec %s never ended: %v", execID, execs)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestDaemonFilesCheckpointsForks: file calls with the daemon's path
// rules, then a checkpoint tree, a rollback and forks.
func TestDaemonFilesCheckpointsForks(t *testing.T) {
	c, be := serveDaemon(t)
	ctx := testContext(t)
	req := image()
	req.RequestId = "create-1"
	sb, err := c.CreateSandbox(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.CreateSandbox(ctx, req)
	if err != nil || again.GetId() != sb.GetId() {
		t.Fatalf("a retried create: %v, %v; want %s again", again.GetId(), err, sb.GetId())
	}
	id := sb.GetId()

	if _, err := c.WriteFile(ctx, id, "/etc/kiln/hello", strings.NewReader("hello\n"), WriteFileOptions{MakeParents: true}); err != nil {
		t.Fatal(err)
	}
	var back bytes.Buffer
	if _, err := c.ReadFile(ctx, id, "/etc/kiln/hello", &back); err != nil || back.String() != "hello\n" {
		t.Fatalf("read back %q, %v", back.String(), err)
	}
	for _, p := range []string{"/../../etc/passwd", "relative", ""} {
		_, err := c.ReadFile(ctx, id, p, &back)
		wantCode(t, err, codes.InvalidArgument, fmt.Sprintf("read %q", p))
	}
	_, err = c.Stat(ctx, id, "/etc/kiln/missing")
	wantCode(t, err, codes.NotFound, "stat a missing file")

	ck1, err := c.Checkpoint(ctx, id, CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Remove(ctx, id, "/etc/kiln/hello"); err != nil {
		t.Fatal(err)
	}
	ck2, err := c.Checkpoint(ctx, id, CheckpointOptions{})
	if err != nil || ck2.GetParentId() != ck1.GetId() {
		t.Fatalf("second checkpoint %v, %v; want a child of %s", ck2, err, ck1.GetId())
	}
	rb, err := c.Rollback(ctx, id, ck1.GetId())
	if err != nil || rb.GetId() != id {
		t.Fatalf("rollback: %v, %v", rb, err)
	}
	back.Reset()
	if _, err := c.ReadFile(ctx, id, "/etc/kiln/hello", &back); err != nil || back.String() != "hello\n" {
		t.Fatalf("after the rollback: %q, %v; want the file back", back.String(), err)
	}

	var kids []string
	for k, err := range c.Fork(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: ck2.GetId()}, Count: 2}) {
		if err != nil {
			t.Fatal(err)
		}
		kids = append(kids, k.GetId())
	}
	if len(kids) != 2 {
		t.Fatalf("fork 2: %v", kids)
	}
	for _, k := range kids {
		if _, err := c.Stat(ctx, k, "/etc/kiln/hello"); err == nil {
			t.Errorf("child %s of %s has the file removed before that checkpoint", k, ck2.GetId())
		}
	}
	var ferr error
	for _, err := range c.Fork(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: "ck-0000000000000000"}, Count: 1}) {
		ferr = err
	}
	wantCode(t, ferr, codes.NotFound, "fork of an unknown checkpoint")

	for _, k := range append(kids, id) {
		if err := c.DestroySandbox(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	if n := be.Live(); n != 0 {
		t.Errorf("%d sandboxes live after destroying them all", n)
	}
}

// TestDaemonEvents: a watcher sees a sandbox created, ready and exited,
// in that order.
func TestDaemonEvents(t *testing.T) {
	c, _ := serveDaemon(t)
	ctx := testContext(t)
	w, err := c.WatchEvents(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	// Every change after WatchEvents returns is delivered: no wait here.
	sb, err := c.CreateSandbox(ctx, image())
	if err != nil {
		t.Fatal(err)
	}
	if err := c.DestroySandbox(ctx, sb.GetId()); err != nil {
		t.Fatal(err)
	}
	var kinds []kilnpb.Event_Kind
	for ev, err := range w.All() {
		if err != nil {
			t.Fatal(err)
		}
		if ev.GetSandboxId() != sb.GetId() {
			continue
		}
		kinds = append(kinds, ev.GetKind())
		if ev.GetKind() == kilnpb.Event_KIND_EXITED {
			break
		}
	}
	want := []kilnpb.Event_Kind{kilnpb.Event_KIND_CREATED, kilnpb.Event_KIND_READY, kilnpb.Event_KIND_EXITED}
	if fmt.Sprint(kinds) != fmt.Sprint(want) {
		t.Errorf("events of %s: %v; want %v", sb.GetId(), kinds, want)
	}
}
