package agent_test

import (
	"bytes"
	"context"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/client"
)

// startDetachedAgent starts an agent whose detached processes are killed
// at the end of the test (before the agent stops).
func startDetachedAgent(t *testing.T, cfg agent.Config) *testAgent {
	t.Helper()
	a := startAgent(t, cfg)
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := client.New(ctx, unixDialer(a.sock)) // a test may close a's
		if err != nil {
			t.Errorf("cleanup: %v", err)
			return
		}
		defer c.Close()
		ds, _ := c.ListDetached(ctx)
		for _, d := range ds {
			if !d.Exited {
				c.SignalDetached(ctx, d.ID, syscall.SIGKILL, true)
				c.WaitDetached(ctx, d.ID)
			}
		}
	})
	return a
}

// reconnect is a second client of a's agent, as a restarted host process
// would open.
func (a *testAgent) reconnect(t *testing.T) *client.Client {
	t.Helper()
	c, err := client.New(t.Context(), unixDialer(a.sock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// syncBuffer is a bytes.Buffer safe for a writer and a reader at once.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// waitFor polls cond for up to 10 seconds.
func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("timed out waiting")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestDetachedOutlivesItsCall(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	out := &syncBuffer{}
	p, err := a.Start(ctx, client.ExecOptions{
		Argv:     []string{"sh", "-c", "echo started; exec sleep 1000"},
		DetachID: "ex-0123abcd",
		Stdout:   out,
	})
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return out.String() == "started\n" })
	// The host side goes away: the call and its connection end.
	cancel()
	if _, err := p.Wait(); err == nil {
		t.Fatal("Wait after the call was cancelled: no error")
	}
	a.Client.Close()
	time.Sleep(100 * time.Millisecond)
	if gone(p.Pid()) {
		t.Fatalf("detached pid %d died with its call", p.Pid())
	}

	// A new client finds it.
	c := a.reconnect(t)
	tctx := testContext(t, 20*time.Second)
	ds, err := c.ListDetached(tctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(ds) != 1 {
		t.Fatalf("ListDetached: %+v", ds)
	}
	d := ds[0]
	if d.ID != "ex-0123abcd" || d.Pid != p.Pid() || d.Exited || strings.Join(d.Argv, " ") != "sh -c echo started; exec sleep 1000" ||
		time.Since(d.Started) > time.Minute || len(d.StdoutTail) != 0 {
		t.Fatalf("ListDetached: %+v (pid %d)", d, p.Pid())
	}
	wantCode(t, c.ForgetDetached(tctx, d.ID), codes.FailedPrecondition, "still runs")

	if err := c.SignalDetached(tctx, d.ID, syscall.SIGTERM, true); err != nil {
		t.Fatal(err)
	}
	w, err := c.WaitDetached(tctx, d.ID)
	if err != nil {
		t.Fatal(err)
	}
	if !w.Exited || w.Status.Signal != int(syscall.SIGTERM) || w.Status.Code != -1 || string(w.StdoutTail) != "started\n" {
		t.Fatalf("WaitDetached: %+v", w)
	}
	ds, _ = c.ListDetached(tctx)
	if len(ds) != 1 || !ds[0].Exited || ds[0].Status.Signal != int(syscall.SIGTERM) {
		t.Fatalf("ListDetached after exit: %+v", ds)
	}
	wantCode(t, c.SignalDetached(tctx, d.ID, syscall.SIGKILL, false), codes.FailedPrecondition, "exited")
	if err := c.ForgetDetached(tctx, d.ID); err != nil {
		t.Fatal(err)
	}
	if ds, _ := c.ListDetached(tctx); len(ds) != 0 {
		t.Fatalf("ListDetached after forget: %+v", ds)
	}
	wantCode(t, c.ForgetDetached(tctx, d.ID), codes.NotFound, d.ID)
}

func TestDetachedRunsToItsEnd(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{})
	ctx := testContext(t, 20*time.Second)
	var out, errOut bytes.Buffer
	st, err := a.Exec(ctx, client.ExecOptions{
		Argv:     []string{"sh", "-c", "cat; echo err >&2; exit 7"},
		DetachID: "job.1",
		Stdin:    strings.NewReader("in\n"),
		Stdout:   &out, Stderr: &errOut,
	})
	if err != nil {
		t.Fatal(err)
	}
	if st.Code != 7 || out.String() != "in\n" || errOut.String() != "err\n" {
		t.Fatalf("exec: %v, stdout %q, stderr %q", st, out.String(), errOut.String())
	}
	w, err := a.WaitDetached(ctx, "job.1")
	if err != nil {
		t.Fatal(err)
	}
	if w.Status.Code != 7 || string(w.StdoutTail) != "in\n" || string(w.StderrTail) != "err\n" {
		t.Fatalf("WaitDetached: %+v", w)
	}
	// The ID stays taken until forgotten.
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, DetachID: "job.1"})
	wantCode(t, err, codes.AlreadyExists, "job.1")
	if err := a.ForgetDetached(ctx, "job.1"); err != nil {
		t.Fatal(err)
	}
	if st, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, DetachID: "job.1"}); err != nil || !st.Success() {
		t.Fatalf("exec under a forgotten ID: %v %v", st, err)
	}
}

// TestDetachedOutputAfterItsCall checks that a detached process whose call
// is gone never blocks on its output (far more than a pipe holds), whose
// tail is kept.
func TestDetachedOutputAfterItsCall(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	_, err := a.Start(ctx, client.ExecOptions{
		Argv:     []string{"sh", "-c", "sleep 0.2; head -c 300000 /dev/zero | tr '\\0' a; printf END; echo oops >&2"},
		DetachID: "big",
	})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	w, err := a.WaitDetached(testContext(t, 20*time.Second), "big")
	if err != nil {
		t.Fatal(err)
	}
	if !w.Status.Success() || len(w.StdoutTail) != agentpb.DetachedTailSize || !bytes.HasSuffix(w.StdoutTail, []byte("aaaEND")) ||
		bytes.Count(w.StdoutTail, []byte("a")) != agentpb.DetachedTailSize-3 || string(w.StderrTail) != "oops\n" {
		t.Fatalf("WaitDetached: %v, stdout tail %d bytes ending %q, stderr %q", w.Status, len(w.StdoutTail), w.StdoutTail[max(0, len(w.StdoutTail)-8):], w.StderrTail)
	}
}

func TestDetachedTimeoutAfterItsCall(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{})
	ctx, cancel := context.WithCancel(t.Context())
	p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sleep", "1000"}, DetachID: "t", Timeout: 300 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	p.Wait()
	w, err := a.WaitDetached(testContext(t, 20*time.Second), "t")
	if err != nil {
		t.Fatal(err)
	}
	if !w.Status.TimedOut || w.Status.Signal != int(syscall.SIGKILL) {
		t.Fatalf("WaitDetached: %+v", w)
	}
}

func TestDetachedTableBound(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{MaxDetached: 3})
	ctx := testContext(t, 30*time.Second)
	start := func(id string, argv ...string) error {
		p, err := a.Start(ctx, client.ExecOptions{Argv: argv, DetachID: id})
		if err == nil {
			go p.Wait()
		}
		return err
	}
	for _, id := range []string{"a", "b", "c"} {
		if err := start(id, "sleep", "1000"); err != nil {
			t.Fatal(err)
		}
	}
	wantCode(t, start("d", "true"), codes.ResourceExhausted, "3 detached processes")
	// Room is made by forgetting the oldest exited one.
	for _, id := range []string{"b", "a"} {
		if err := a.SignalDetached(ctx, id, syscall.SIGKILL, false); err != nil {
			t.Fatal(err)
		}
		if _, err := a.WaitDetached(ctx, id); err != nil {
			t.Fatal(err)
		}
	}
	if err := start("d", "sleep", "1000"); err != nil {
		t.Fatal(err)
	}
	ds, err := a.ListDetached(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, d := range ds {
		ids = append(ids, d.ID)
	}
	if strings.Join(ids, " ") != "b c d" {
		t.Fatalf("ListDetached after making room: %v, want b c d (a, the oldest exited, forgotten)", ids)
	}
}

func TestDetachedInvalid(t *testing.T) {
	a := startDetachedAgent(t, agent.Config{})
	ctx := testContext(t, 20*time.Second)
	long := strings.Repeat("x", agentpb.MaxDetachedIDLen+1)
	for _, tc := range []struct {
		name, id, msg string
	}{
		{"too long", long, "want 1 to 128 bytes"},
		{"slash", "a/b", `is not one of`},
		{"space", "a b", `is not one of`},
		{"NUL", "a\x00", `is not one of`},
		{"non-ASCII", "é", `is not one of`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := a.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, DetachID: tc.id})
			wantCode(t, err, codes.InvalidArgument, tc.msg)
			wantCode(t, a.SignalDetached(ctx, tc.id, syscall.SIGKILL, true), codes.InvalidArgument, tc.msg)
			_, err = a.WaitDetached(ctx, tc.id)
			wantCode(t, err, codes.InvalidArgument, tc.msg)
			wantCode(t, a.ForgetDetached(ctx, tc.id), codes.InvalidArgument, tc.msg)
		})
	}
	wantCode(t, a.SignalDetached(ctx, "", syscall.SIGKILL, true), codes.InvalidArgument, "want 1 to 128 bytes")
	wantCode(t, a.SignalDetached(ctx, "nope", syscall.SIGKILL, true), codes.NotFound, "nope")
	_, err := a.WaitDetached(ctx, "nope")
	wantCode(t, err, codes.NotFound, "nope")
	// A missing binary leaves no entry behind.
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"no-such-binary-kiln"}, DetachID: "missing"})
	wantCode(t, err, codes.NotFound)
	if ds, _ := a.ListDetached(ctx); len(ds) != 0 {
		t.Fatalf("a failed start is listed: %+v", ds)
	}
	p, err := a.Start(ctx, client.ExecOptions{Argv: []string{"sleep", "1000"}, DetachID: "s"})
	if err != nil {
		t.Fatal(err)
	}
	go p.Wait()
	for _, sig := range []syscall.Signal{0, -1, 65} {
		wantCode(t, a.SignalDetached(ctx, "s", sig, false), codes.InvalidArgument, "want 1 to 64")
	}
	_, err = a.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, DetachID: "s"})
	wantCode(t, err, codes.AlreadyExists, `"s"`)
}

func TestSetHostname(t *testing.T) {
	a := startAgent(t, agent.Config{})
	ctx := testContext(t, 10*time.Second)
	if err := a.SetHostname(ctx, "sb-0123.pool"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, msg string }{
		{"", "want 1 to 64 bytes"},
		{strings.Repeat("h", 65), "want 1 to 64 bytes"},
		{"a b", "byte 1"},
		{"a\x00", "byte 1"},
		{"a\nb", "byte 1"},
		{"é", "byte 0"},
	} {
		wantCode(t, a.SetHostname(ctx, tc.name), codes.InvalidArgument, tc.msg)
	}
	a.sys.mu.Lock()
	defer a.sys.mu.Unlock()
	if strings.Join(a.sys.hostnames, ",") != "sb-0123.pool" {
		t.Fatalf("host names set: %q", a.sys.hostnames)
	}
}
