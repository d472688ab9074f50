package client

import (
	"bytes"
	"context"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// lockedBuffer is a bytes.Buffer for one writer and a reader at once.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *lockedBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *lockedBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.ReplaceAll(b.b.String(), "\r\n", "\n")
}

func until(t *testing.T, what string, cond func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
	}
}

// TestDaemonTerminalsAndFiles: the wrappers of exec on a pty with
// resizes, AttachExec, Move, WatchDir and ListDirDepth, against the real
// daemon over its test backend.
func TestDaemonTerminalsAndFiles(t *testing.T) {
	c, _ := serveDaemon(t)
	ctx := testContext(t)
	sb, err := c.CreateSandbox(ctx, image())
	if err != nil {
		t.Fatal(err)
	}
	id := sb.GetId()

	// A pty: its size, a resize, input.
	var out lockedBuffer
	stdinR, stdinW := io.Pipe()
	resize := make(chan PtySize, 1)
	done := make(chan error, 1)
	go func() {
		res, err := c.Exec(ctx, id, ExecOptions{Argv: []string{"sh", "-c", `stty size; echo ready; while read l; do stty size; done; exit 3`},
			Pty: &PtySize{Rows: 10, Cols: 40}, Resize: resize, Stdin: stdinR, Stdout: &out})
		if err == nil && res.ExitCode != 3 {
			err = status.Errorf(codes.Unknown, "exit %d", res.ExitCode)
		}
		done <- err
	}()
	until(t, "ready", func() bool { return strings.Contains(out.String(), "ready\n") })
	resize <- PtySize{Rows: 11, Cols: 41}
	// Resizes and input go by separate goroutines: ask until the new
	// size shows, then end the input (^D).
	until(t, "the new size", func() bool {
		io.WriteString(stdinW, "\n")
		return strings.Contains(out.String(), "11 41\n")
	})
	stdinW.Close()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if got := out.String(); !strings.Contains(got, "10 40\n") || !strings.Contains(got, "11 41\n") {
		t.Errorf("pty output %q", got)
	}

	// AttachExec to a background exec, until it is killed.
	bg, err := c.Exec(ctx, id, ExecOptions{Argv: []string{"sh", "-c", "while :; do echo tick; sleep 0.02; done"}, Background: true})
	if err != nil {
		t.Fatal(err)
	}
	var seen lockedBuffer
	attached := make(chan *ExecResult, 1)
	go func() {
		res, err := c.AttachExec(ctx, id, bg.ExecID, &seen, nil)
		if err != nil {
			t.Error(err)
		}
		attached <- res
	}()
	until(t, "tick", func() bool { return strings.Contains(seen.String(), "tick") })
	if err := c.KillExec(ctx, id, bg.ExecID, 0); err != nil {
		t.Fatal(err)
	}
	if res := <-attached; res == nil || !res.Exited || res.Signal != 9 || res.PID != bg.PID {
		t.Errorf("attach: %+v", res)
	}
	if _, err := c.AttachExec(ctx, id, "ex-nope", nil, nil); status.Code(err) != codes.NotFound {
		t.Errorf("attach to an unknown exec: %v", err)
	}

	// Files: owned write, depth, move, watch.
	if fi, err := c.WriteFile(ctx, id, "/d/e/f", strings.NewReader("f"), WriteFileOptions{MakeParents: true, User: "nobody"}); err != nil || fi.GetOwner() != "nobody" {
		t.Fatalf("owned write: %v %v", fi, err)
	}
	if fi, err := c.MakeDir(ctx, id, "/d/g", MakeDirOptions{User: "nobody"}); err != nil || fi.GetOwner() != "nobody" {
		t.Errorf("owned mkdir: %v %v", fi, err)
	}
	ents, err := c.ListDirDepth(ctx, id, "/d", 3)
	var paths []string
	for _, e := range ents {
		paths = append(paths, e.GetPath())
	}
	if err != nil || strings.Join(paths, " ") != "/d/e /d/e/f /d/g" {
		t.Errorf("depth 3: %q %v", paths, err)
	}
	if fi, err := c.Move(ctx, id, "/d/e/f", "/d/g/f"); err != nil || fi.GetPath() != "/d/g/f" {
		t.Errorf("move: %v %v", fi, err)
	}
	wctx, cancel := context.WithCancel(ctx)
	events := make(chan *kilnpb.WatchEvent, 64)
	werr := make(chan error, 1)
	go func() {
		werr <- c.WatchDir(wctx, id, "/d", true, func(ev *kilnpb.WatchEvent) error {
			events <- ev
			return nil
		})
	}()
	if ev := <-events; !ev.GetStarted() {
		t.Fatalf("first event %v", ev)
	}
	if _, err := c.WriteFile(ctx, id, "/d/g/new", strings.NewReader("n"), WriteFileOptions{}); err != nil {
		t.Fatal(err)
	}
	for ev := range events {
		if ev.GetOp() == kilnpb.WatchEvent_OP_CREATE && ev.GetName() == "g/new" {
			break
		}
	}
	cancel()
	if err := <-werr; err != nil {
		t.Errorf("watch ended by its context: %v", err)
	}
}
