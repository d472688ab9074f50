package client

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestParseHost(t *testing.T) {
	tests := []struct {
		host    string
		want    Address
		wantErr string
	}{
		{host: "unix:///run/kiln/kilnd.sock", want: Address{"unix", "/run/kiln/kilnd.sock"}},
		{host: "unix:/run/kiln/kilnd.sock", want: Address{"unix", "/run/kiln/kilnd.sock"}},
		{host: "unix:kilnd.sock", want: Address{"unix", "kilnd.sock"}},
		{host: "tcp://127.0.0.1:7070", want: Address{"tcp", "127.0.0.1:7070"}},
		{host: "tcp://[::1]:7070", want: Address{"tcp", "[::1]:7070"}},
		{host: "tcp://localhost:7070", want: Address{"tcp", "localhost:7070"}},
		{host: "unix://relative.sock", wantErr: "absolute path"},
		{host: "unix:", wantErr: "no socket path"},
		{host: "tcp://127.0.0.1", wantErr: "tcp://HOST:PORT"},
		{host: "tcp://127.0.0.1:", wantErr: "tcp://HOST:PORT"},
		{host: "/run/kiln/kilnd.sock", wantErr: "want unix:///path"},
		{host: "http://127.0.0.1:7070", wantErr: "want unix:///path"},
		{host: "", wantErr: "want unix:///path"},
	}
	for _, tt := range tests {
		t.Run(tt.host, func(t *testing.T) {
			got, err := ParseHost(tt.host)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("ParseHost(%q) = %v, %v; want an error with %q", tt.host, got, err, tt.wantErr)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("ParseHost(%q) = %v, %v; want %v", tt.host, got, err, tt.want)
			}
			// String gives a host that parses back to the same address.
			if again, err := ParseHost(got.String()); err != nil || again != got {
				t.Fatalf("ParseHost(%q) = %v, %v; want %v", got.String(), again, err, got)
			}
		})
	}
}

func dial(t *testing.T, sock string, opts ...Option) *Client {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := Dial(ctx, "unix:"+sock, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func testContext(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func wantCode(t *testing.T, err error, want codes.Code, what string) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("%s: got %v (%v), want %v", what, got, err, want)
	}
}

func TestDialNoDaemon(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "none.sock")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	_, err := Dial(ctx, "unix:"+sock)
	if err == nil || !strings.Contains(err.Error(), sock) {
		t.Fatalf("Dial to a missing socket: %v; want an error naming %s", err, sock)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Dial took %v to fail; want it to fail fast", d)
	}
	if _, err := Dial(ctx, "bogus"); err == nil {
		t.Fatal("Dial(bogus) succeeded")
	}
}

func TestSandboxLifecycle(t *testing.T) {
	sock, _ := serveHost(t)
	c, ctx := dial(t, sock), testContext(t)

	a, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{
		Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Labels: map[string]string{"team": "a"}, RequestId: "r1"})
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{
		Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Labels: map[string]string{"team": "a"}, RequestId: "r1"})
	if err != nil || again.GetId() != a.GetId() {
		t.Fatalf("retried create: %v, %v; want the same sandbox %s", again.GetId(), err, a.GetId())
	}
	b, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{
		Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Labels: map[string]string{"team": "b"}})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Template{Template: "nope"}})
	wantCode(t, err, codes.NotFound, "create from an unknown template")
	var ce *Error
	if !errors.As(err, &ce) || ce.Op != "create sandbox" || ce.Code != codes.NotFound ||
		err.Error() != `kiln: create sandbox: NotFound: no template "nope"` {
		t.Errorf("error %q (%#v): want an *Error naming the call, its code and the daemon's message", err, ce)
	}
	if st, ok := status.FromError(err); !ok || st.Message() != `no template "nope"` {
		t.Errorf("status.FromError(%v) = %v, %v", err, st, ok)
	}
	_, err = c.CreateSandbox(ctx, nil)
	wantCode(t, err, codes.InvalidArgument, "create with a nil request")

	list, err := c.ListSandboxes(ctx, ListOptions{Labels: map[string]string{"team": "b"}})
	if err != nil || len(list) != 1 || list[0].GetId() != b.GetId() {
		t.Fatalf("list team=b: %v, %v; want [%s]", list, err, b.GetId())
	}
	if err := c.DestroySandbox(ctx, a.GetId()); err != nil {
		t.Fatal(err)
	}
	got, err := c.GetSandbox(ctx, a.GetId())
	if err != nil || got.GetState() != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED {
		t.Fatalf("get after destroy: %v, %v; want destroyed", got.GetState(), err)
	}
	wantCode(t, c.DestroySandbox(ctx, a.GetId()), codes.FailedPrecondition, "destroy twice")
	_, err = c.GetSandbox(ctx, "sb-missing")
	wantCode(t, err, codes.NotFound, "get unknown")
	list, err = c.ListSandboxes(ctx, ListOptions{})
	if err != nil || len(list) != 1 {
		t.Fatalf("list live: %v, %v; want only %s", list, err, b.GetId())
	}
}

func newSandbox(t *testing.T, ctx context.Context, c *Client) string {
	t.Helper()
	sb, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
	if err != nil {
		t.Fatal(err)
	}
	return sb.GetId()
}

// TestRequestIDs: a request without an ID gets a fresh one (the caller's
// message is left alone); one with an ID keeps it.
func TestRequestIDs(t *testing.T) {
	sock, hs := serveHost(t)
	c, ctx := dial(t, sock), testContext(t)
	req := &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}}
	a, err := c.CreateSandbox(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.CreateSandbox(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if a.GetId() == b.GetId() || req.GetRequestId() != "" {
		t.Errorf("two creates without request IDs: %s and %s, request ID %q left; want two sandboxes, the request untouched",
			a.GetId(), b.GetId(), req.GetRequestId())
	}
	hs.mu.Lock()
	n := len(hs.requests)
	hs.mu.Unlock()
	if n != 2 {
		t.Errorf("the server saw %d request IDs; want 2", n)
	}
	if x, y := NewRequestID(), NewRequestID(); x == y || len(x) != 32 {
		t.Errorf("NewRequestID: %q, %q", x, y)
	}
}

func TestExec(t *testing.T) {
	sock, _ := serveHost(t)
	c, ctx := dial(t, sock), testContext(t)
	id := newSandbox(t, ctx, c)
	big := strings.Repeat("0123456789abcdef", 20000) // several stdin chunks

	tests := []struct {
		name       string
		opts       ExecOptions
		wantOut    string
		wantErrOut string
		wantCode   int
		wantSignal int
		timedOut   bool
	}{
		{name: "stdout", opts: ExecOptions{Argv: []string{"echo", "hello"}}, wantOut: "hello\n"},
		{name: "stderr and code", opts: ExecOptions{Argv: []string{"sh", "-c", "echo oops >&2; exit 3"}}, wantErrOut: "oops\n", wantCode: 3},
		{name: "env", opts: ExecOptions{Argv: []string{"sh", "-c", "echo $KILN_X"}, Env: []string{"KILN_X=42"}}, wantOut: "42\n"},
		{name: "stdin", opts: ExecOptions{Argv: []string{"cat"}, Stdin: strings.NewReader(big)}, wantOut: big},
		{name: "empty stdin", opts: ExecOptions{Argv: []string{"cat"}, Stdin: strings.NewReader("")}},
		{name: "timeout", opts: ExecOptions{Argv: []string{"sleep", "10"}, Timeout: 200 * time.Millisecond},
			wantCode: -1, wantSignal: int(syscall.SIGKILL), timedOut: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			tt.opts.Stdout, tt.opts.Stderr = &out, &errOut
			res, err := c.Exec(ctx, id, tt.opts)
			if err != nil {
				t.Fatal(err)
			}
			if !res.Exited || res.ExitCode != tt.wantCode || res.Signal != tt.wantSignal || res.TimedOut != tt.timedOut {
				t.Errorf("result %+v; want exit %d, signal %d, timed out %v", res, tt.wantCode, tt.wantSignal, tt.timedOut)
			}
			if res.ExecID == "" || res.PID == 0 {
				t.Errorf("result %+v has no exec ID or PID", res)
			}
			if out.String() != tt.wantOut {
				t.Errorf("stdout %d bytes %.40q; want %d bytes %.40q", out.Len(), out.String(), len(tt.wantOut), tt.wantOut)
			}
			if errOut.String() != tt.wantErrOut {
				t.Errorf("stderr %q; want %q", errOut.String(), tt.wantErrOut)
			}
		})
	}
}

func TestExecSignalsAndBackground(t *testing.T) {
	sock, _ := serveHost(t)
	c, ctx := dial(t, sock), testContext(t)
	id := newSandbox(t, ctx, c)

	sigs := make(chan syscall.Signal, 1)
	started := make(chan int32, 1)
	go func() {
		<-started
		sigs <- syscall.SIGTERM
	}()
	res, err := c.Exec(ctx, id, ExecOptions{Argv: []string{"sleep", "30"}, Signals: sigs,
		Started: func(_ string, pid int32) { started <- pid }})
	if err != nil {
		t.Fatal(err)
	}
	if res.Signal != int(syscall.SIGTERM) {
		t.Errorf("after SIGTERM: %+v; want signal %d", res, syscall.SIGTERM)
	}

	bg, err := c.Exec(ctx, id, ExecOptions{Argv: []string{"true"}, Background: true})
	if err != nil || bg.Exited || bg.ExecID == "" {
		t.Fatalf("background exec: %+v, %v; want started, not exited", bg, err)
	}

	_, err = c.Exec(ctx, id, ExecOptions{})
	if err == nil || !strings.Contains(err.Error(), "no command") {
		t.Errorf("exec without argv: %v", err)
	}
	_, err = c.Exec(ctx, "sb-missing", ExecOptions{Argv: []string{"true"}})
	wantCode(t, err, codes.NotFound, "exec in an unknown sandbox")

	// A write error on stdout ends the call with that error.
	_, err = c.Exec(ctx, id, ExecOptions{Argv: []string{"echo", "x"}, Stdout: failWriter{}})
	if err == nil || !strings.Contains(err.Error(), "writing stdout") {
		t.Errorf("exec into a failing writer: %v", err)
	}
	// Cancelling ctx ends the call.
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = c.Exec(cctx, id, ExecOptions{Argv: []string{"sleep", "30"}})
	wantCode(t, err, codes.DeadlineExceeded, "exec past its context's deadline")
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestFiles(t *testing.T) {
	sock, _ := serveHost(t)
	c, ctx := dial(t, sock), testContext(t)
	id := newSandbox(t, ctx, c)

	data := make([]byte, 300<<10)
	rand.Read(data)
	fi, err := c.WriteFile(ctx, id, "/a/b/data.bin", bytes.NewReader(data), WriteFileOptions{Mode: 0o600, MakeParents: true})
	if err != nil {
		t.Fatal(err)
	}
	if fi.GetSize() != int64(len(data)) || fi.GetMode()&0o777 != 0o600 {
		t.Errorf("written file info %v; want size %d mode 0600", fi, len(data))
	}
	var back bytes.Buffer
	n, err := c.ReadFile(ctx, id, "/a/b/data.bin", &back)
	if err != nil || n != int64(len(data)) || !bytes.Equal(back.Bytes(), data) {
		t.Fatalf("read back %d bytes, %v; want the %d written", n, err, len(data))
	}
	if _, err := c.WriteFile(ctx, id, "/empty", strings.NewReader(""), WriteFileOptions{}); err != nil {
		t.Fatal(err)
	}
	if fi, err := c.Stat(ctx, id, "/empty"); err != nil || fi.GetSize() != 0 || fi.GetIsDir() {
		t.Fatalf("stat /empty: %v, %v", fi, err)
	}
	if _, err := c.MakeDir(ctx, id, "/a/c", MakeDirOptions{}); err != nil {
		t.Fatal(err)
	}
	ents, err := c.ListDir(ctx, id, "/a")
	if err != nil || len(ents) != 2 || ents[0].GetName() != "b" || !ents[1].GetIsDir() {
		t.Fatalf("list /a: %v, %v; want b and c", ents, err)
	}
	wantCode(t, c.Remove(ctx, id, "/a"), codes.FailedPrecondition, "remove a non-empty directory")
	if err := c.RemoveAll(ctx, id, "/a"); err != nil {
		t.Fatal(err)
	}
	_, err = c.Stat(ctx, id, "/a")
	wantCode(t, err, codes.NotFound, "stat a removed directory")
	_, err = c.ReadFile(ctx, id, "/a/b/data.bin", io.Discard)
	wantCode(t, err, codes.NotFound, "read a removed file")
	_, err = c.WriteFile(ctx, id, "/../escape", strings.NewReader("x"), WriteFileOptions{})
	wantCode(t, err, codes.InvalidArgument, "write outside the sandbox")
	_, err = c.WriteFile(ctx, "sb-missing", "/x", strings.NewReader("x"), WriteFileOptions{})
	wantCode(t, err, codes.NotFound, "write into an unknown sandbox")
	_, err = c.WriteFile(ctx, id, "/x", iotestErrReader{}, WriteFileOptions{})
	if err == nil || !strings.Contains(err.Error(), "reading the source") {
		t.Errorf("write from a failing reader: %v", err)
	}
}

type iotestErrReader struct{}

func (iotestErrReader) Read([]byte) (int, error) { return 0, errors.New("bad sector") }

func TestCheckpointsForksTemplates(t *testing.T) {
	sock, _ := serveHost(t)
	c, ctx := dial(t, sock), testContext(t)
	id := newSandbox(t, ctx, c)

	c1, err := c.Checkpoint(ctx, id, CheckpointOptions{})
	if err != nil {
		t.Fatal(err)
	}
	c2, err := c.Checkpoint(ctx, id, CheckpointOptions{Persist: true})
	if err != nil || c2.GetParentId() != c1.GetId() || !c2.GetPersisted() {
		t.Fatalf("second checkpoint %v, %v; want a persisted child of %s", c2, err, c1.GetId())
	}
	sb, err := c.Rollback(ctx, id, c1.GetId())
	if err != nil || sb.GetId() != id || sb.GetCheckpoint() != c1.GetId() {
		t.Fatalf("rollback: %v, %v", sb, err)
	}
	_, err = c.Rollback(ctx, id, "ck-missing")
	wantCode(t, err, codes.NotFound, "rollback to an unknown checkpoint")
	cks, err := c.ListCheckpoints(ctx, id)
	if err != nil || len(cks) != 2 {
		t.Fatalf("list checkpoints: %v, %v", cks, err)
	}

	var kids []string
	for sb, err := range c.Fork(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_CheckpointId{CheckpointId: c2.GetId()}, Count: 3}) {
		if err != nil {
			t.Fatal(err)
		}
		kids = append(kids, sb.GetId())
	}
	if len(kids) != 3 {
		t.Fatalf("fork 3: got %v", kids)
	}
	n := 0
	for _, err := range c.Fork(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: id}, Count: 5}) {
		if err != nil {
			t.Fatal(err)
		}
		if n++; n == 2 {
			break
		}
	}
	var ferr error
	for _, err := range c.Fork(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: id}}) {
		ferr = err
	}
	wantCode(t, ferr, codes.InvalidArgument, "fork of 0 children")

	tp, err := c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "py", Image: "python:3", Setup: []string{"pip", "install", "x"}})
	if err != nil {
		t.Fatal(err)
	}
	tps, err := c.ListTemplates(ctx)
	if err != nil || len(tps) != 1 || tps[0].GetName() != "py" {
		t.Fatalf("list templates: %v, %v", tps, err)
	}
	if err := c.DeleteTemplate(ctx, tp.GetId(), false); err != nil {
		t.Fatal(err)
	}
	wantCode(t, c.DeleteTemplate(ctx, tp.GetId(), false), codes.NotFound, "delete a deleted template")
}

func TestWatchEvents(t *testing.T) {
	sock, _ := serveHost(t)
	c, ctx := dial(t, sock), testContext(t)
	id := newSandbox(t, ctx, c)
	w, err := c.WatchEvents(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ev, err := w.Recv()
	if err != nil || ev.GetSandboxId() != id {
		t.Fatalf("event %v, %v; want one for %s", ev, err, id)
	}
	w.Close()
	if ev, err := w.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("Recv after Close: %v, %v; want io.EOF", ev, err)
	}
	n := 0
	for _, err := range w.All() {
		if err != nil {
			t.Fatal(err)
		}
		n++
	}
	if n != 0 {
		t.Errorf("All after Close yielded %d events", n)
	}
}

// TestToken checks that WithToken's bearer token reaches the server on
// every kind of call.
func TestToken(t *testing.T) {
	seen := make(chan string, 10)
	auth := func(ctx context.Context) {
		md, _ := metadata.FromIncomingContext(ctx)
		seen <- strings.Join(md.Get("authorization"), ",")
	}
	sock, _ := serveHost(t,
		grpc.UnaryInterceptor(func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
			auth(ctx)
			return h(ctx, req)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
			auth(ss.Context())
			return h(srv, ss)
		}))
	c, ctx := dial(t, sock, WithToken("s3cret")), testContext(t)
	id := newSandbox(t, ctx, c)
	if _, err := c.Exec(ctx, id, ExecOptions{Argv: []string{"true"}}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if got := <-seen; got != "Bearer s3cret" {
			t.Fatalf("authorization %q; want %q", got, "Bearer s3cret")
		}
	}
}

func FuzzParseHost(f *testing.F) {
	for _, s := range []string{"unix:///run/kiln/kilnd.sock", "unix:kilnd.sock", "tcp://127.0.0.1:7070", "tcp://[::1]:1", "unix://", "tcp://:", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		a, err := ParseHost(s)
		if err != nil {
			return
		}
		if (a.Network != "unix" && a.Network != "tcp") || a.Addr == "" {
			t.Fatalf("ParseHost(%q) = %+v", s, a)
		}
		if again, err := ParseHost(a.String()); err != nil || again != a {
			t.Fatalf("ParseHost(%q) = %+v, %v; want %+v", a.String(), again, err, a)
		}
	})
}
