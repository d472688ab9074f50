package daemon_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// env is a server over the test double, served over an in-memory
// connection.
type env struct {
	t     *testing.T
	state string
	be    *daemontest.Backend
	clock *fakeClock
	cfg   daemon.Config
	srv   *daemon.Server
	gs    *grpc.Server
	c     kilnpb.KilnClient
}

func newEnv(t *testing.T, mod func(*daemon.Config)) *env {
	t.Helper()
	e := &env{t: t, state: t.TempDir(), be: &daemontest.Backend{}, clock: newFakeClock(time.Unix(1_800_000_000, 0))}
	// kilnd leaves sandboxes running when it stops: their stand-in VMM
	// processes, of every backend this test used (e.be may be replaced),
	// go with the test.
	t.Cleanup(func() { e.be.KillAll() })
	e.cfg = daemon.Config{StateDir: e.state, Backend: e.be, Clock: e.clock, HostMemoryMiB: 16384, HostCPUs: 8,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}
	if mod != nil {
		mod(&e.cfg)
	}
	e.start()
	t.Cleanup(func() { e.stop(); e.killAll() })
	return e
}

// subscribe watches every sandbox's events and returns once the server
// has the subscription (it sends the headers then).
func (e *env) subscribe() kilnpb.Kiln_WatchEventsClient {
	e.t.Helper()
	events, err := e.c.WatchEvents(ctxT(e.t), &kilnpb.WatchEventsRequest{})
	if err != nil {
		e.t.Fatal(err)
	}
	if _, err := events.Header(); err != nil { // subscribed
		e.t.Fatal(err)
	}
	return events
}

// start makes a server over the state folder and connects a client.
func (e *env) start() {
	e.t.Helper()
	srv, err := daemon.New(e.cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.srv = srv
	lis := bufconn.Listen(1 << 20)
	e.gs = grpc.NewServer()
	srv.Register(e.gs)
	go e.gs.Serve(lis)
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { conn.Close() })
	e.c = kilnpb.NewKilnClient(conn)
}

func (e *env) stop() {
	if e.gs != nil {
		e.gs.Stop()
		e.gs = nil
	}
	if e.srv != nil {
		e.srv.Close(context.Background())
		e.srv = nil
	}
}

// killAll destroys what the test left running, through a fresh server.
func (e *env) killAll() {
	ents, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "*", "vmm.pid"))
	more, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "fork-*", "vmm.pid"))
	for _, p := range append(ents, more...) {
		b, _ := os.ReadFile(p)
		var pid int
		for _, c := range strings.TrimSpace(string(b)) {
			pid = pid*10 + int(c-'0')
		}
		if pid > 0 {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return ctx
}

var reqN struct {
	sync.Mutex
	n int
}

func nextReq() string {
	reqN.Lock()
	defer reqN.Unlock()
	reqN.n++
	return "req-" + time.Now().Format("150405.000000") + "-" + string(rune('a'+reqN.n%26)) + strings.Repeat("x", reqN.n%7)
}

func (e *env) create(req *kilnpb.CreateSandboxRequest) *kilnpb.Sandbox {
	e.t.Helper()
	if req == nil {
		req = &kilnpb.CreateSandboxRequest{}
	}
	if req.Source == nil {
		req.Source = &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}
	}
	if req.RequestId == "" {
		req.RequestId = nextReq()
	}
	sb, err := e.c.CreateSandbox(ctxT(e.t), req)
	if err != nil {
		e.t.Fatalf("create: %v", err)
	}
	if sb.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		e.t.Fatalf("created sandbox is %v", sb.State)
	}
	return sb
}

// execResult is what an exec printed and how it ended.
type execResult struct {
	stdout, stderr string
	exit           *kilnpb.ExecExit
	execID         string
	err            error
}

func (e *env) exec(ctx context.Context, start *kilnpb.ExecStart, stdin ...[]byte) execResult {
	var r execResult
	stream, err := e.c.Exec(ctx)
	if err != nil {
		r.err = err
		return r
	}
	if err := stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: start}}); err != nil {
		r.err = err
		return r
	}
	for _, in := range stdin {
		stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Stdin{Stdin: in}})
	}
	if start.HasStdin {
		stream.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_CloseStdin{CloseStdin: true}})
	}
	var out, errb bytes.Buffer
	for {
		resp, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			r.err = err
			break
		}
		switch k := resp.Kind.(type) {
		case *kilnpb.ExecResponse_Started:
			r.execID = k.Started.ExecId
		case *kilnpb.ExecResponse_Stdout:
			out.Write(k.Stdout)
		case *kilnpb.ExecResponse_Stderr:
			errb.Write(k.Stderr)
		case *kilnpb.ExecResponse_Exit:
			r.exit = k.Exit
		}
	}
	r.stdout, r.stderr = out.String(), errb.String()
	return r
}

func (e *env) sh(id, script string) execResult {
	e.t.Helper()
	r := e.exec(ctxT(e.t), &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", script}})
	if r.err != nil {
		e.t.Fatalf("exec %q: %v", script, r.err)
	}
	return r
}

func (e *env) get(id string) *kilnpb.Sandbox {
	e.t.Helper()
	sb, err := e.c.GetSandbox(ctxT(e.t), &kilnpb.GetSandboxRequest{Id: id})
	if err != nil {
		e.t.Fatalf("get %s: %v", id, err)
	}
	return sb
}

// waitState waits for sandbox id to be in state.
func (e *env) waitState(id string, state kilnpb.SandboxState) *kilnpb.Sandbox {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		sb := e.get(id)
		if sb.State == state {
			return sb
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("sandbox %s is %v (%s), want %v", id, sb.State, sb.Reason, state)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func wantCode(t *testing.T, err error, code codes.Code, msgPart string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want code %v", err, code)
	}
	if msgPart != "" && !strings.Contains(status.Convert(err).Message(), msgPart) {
		t.Fatalf("message %q does not name %q", status.Convert(err).Message(), msgPart)
	}
}

func TestCreateExecDestroy(t *testing.T) {
	e := newEnv(t, nil)
	events := e.subscribe()
	sb := e.create(&kilnpb.CreateSandboxRequest{Labels: map[string]string{"job": "a"}, Env: []string{"GREETING=hello"}})
	if sb.Pid == 0 || sb.Resources.GetCpus() != 1 || sb.Resources.GetMemoryMib() != 512 {
		t.Errorf("sandbox %v: want a PID and the default resources", sb)
	}
	r := e.sh(sb.Id, `echo "$GREETING out"; echo err >&2; exit 3`)
	if r.stdout != "hello out\n" || r.stderr != "err\n" || r.exit.GetExitCode() != 3 || r.execID == "" {
		t.Errorf("exec: %+v", r)
	}
	dir := filepath.Join(e.state, "sandboxes", sb.Id)
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("sandbox folder: %v", err)
	}
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	got := e.get(sb.Id)
	if got.State != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED || got.Pid != 0 {
		t.Errorf("after destroy: %v", got)
	}
	if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("sandbox folder left after destroy: %v", err)
	}
	if syscall.Kill(int(sb.Pid), 0) == nil {
		t.Errorf("VMM process %d left after destroy", sb.Pid)
	}
	if n := e.be.Live(); n != 0 {
		t.Errorf("%d sandboxes left running", n)
	}
	// Destroying again changes nothing.
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Errorf("second destroy: %v", err)
	}
	var kinds []kilnpb.Event_Kind
	for len(kinds) < 3 {
		ev, err := events.Recv()
		if err != nil {
			t.Fatal(err)
		}
		kinds = append(kinds, ev.Kind)
	}
	want := []kilnpb.Event_Kind{kilnpb.Event_KIND_CREATED, kilnpb.Event_KIND_READY, kilnpb.Event_KIND_EXITED}
	for i := range want {
		if kinds[i] != want[i] {
			t.Fatalf("events %v, want %v", kinds, want)
		}
	}
}

func TestCreateInvalid(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.DefaultLifetime = time.Hour })
	img := &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}
	tests := []struct {
		name string
		req  *kilnpb.CreateSandboxRequest
		code codes.Code
		msg  string
	}{
		{"no request ID", &kilnpb.CreateSandboxRequest{Source: img}, codes.InvalidArgument, "request_id is empty"},
		{"huge request ID", &kilnpb.CreateSandboxRequest{Source: img, RequestId: strings.Repeat("r", 129)}, codes.InvalidArgument, "129 bytes"},
		{"no source", &kilnpb.CreateSandboxRequest{RequestId: "r1"}, codes.InvalidArgument, "no source"},
		{"template", &kilnpb.CreateSandboxRequest{RequestId: "r2", Source: &kilnpb.CreateSandboxRequest_Template{Template: "py"}}, codes.NotFound, `no template "py"`},
		{"unknown checkpoint", &kilnpb.CreateSandboxRequest{RequestId: "r3", Source: &kilnpb.CreateSandboxRequest_Checkpoint{Checkpoint: "ck-nope"}}, codes.NotFound, "ck-nope"},
		{"too many CPUs", &kilnpb.CreateSandboxRequest{RequestId: "r4", Source: img, Resources: &kilnpb.Resources{Cpus: 4096}}, codes.InvalidArgument, "cpus"},
		{"more memory than the host", &kilnpb.CreateSandboxRequest{RequestId: "r5", Source: img, Resources: &kilnpb.Resources{MemoryMib: 1 << 20}}, codes.InvalidArgument, "more than the host has"},
		{"tiny memory", &kilnpb.CreateSandboxRequest{RequestId: "r6", Source: img, Resources: &kilnpb.Resources{MemoryMib: 8}}, codes.InvalidArgument, "memory_mib"},
		{"disk cap over memory", &kilnpb.CreateSandboxRequest{RequestId: "r7", Source: img, Resources: &kilnpb.Resources{MemoryMib: 256, DiskMib: 300}}, codes.InvalidArgument, "at most memory_mib"},
		{"lifetime under idle", &kilnpb.CreateSandboxRequest{RequestId: "r8", Source: img, LifetimeMs: 1000, IdleTimeoutMs: 5000}, codes.InvalidArgument, "shorter than the idle timeout"},
		{"default lifetime under idle", &kilnpb.CreateSandboxRequest{RequestId: "r9", Source: img, IdleTimeoutMs: 2 * 3600 * 1000}, codes.InvalidArgument, "shorter than the idle timeout"},
		{"negative idle", &kilnpb.CreateSandboxRequest{RequestId: "r10", Source: img, IdleTimeoutMs: -1}, codes.InvalidArgument, "idle_timeout_ms"},
		{"bad env", &kilnpb.CreateSandboxRequest{RequestId: "r11", Source: img, Env: []string{"NOEQUALS"}}, codes.InvalidArgument, "NAME=VALUE"},
		{"empty label key", &kilnpb.CreateSandboxRequest{RequestId: "r12", Source: img, Labels: map[string]string{"": "v"}}, codes.InvalidArgument, "label key"},
		{"empty image", &kilnpb.CreateSandboxRequest{RequestId: "r13", Source: &kilnpb.CreateSandboxRequest_Image{}}, codes.InvalidArgument, "image"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := e.c.CreateSandbox(ctxT(t), tc.req)
			wantCode(t, err, tc.code, tc.msg)
		})
	}
	// A negative lifetime is none: any idle timeout goes.
	sb := e.create(&kilnpb.CreateSandboxRequest{LifetimeMs: -1, IdleTimeoutMs: 5 * 3600 * 1000})
	if sb.ExpiresUnixMs != 0 {
		t.Errorf("negative lifetime: expires at %d", sb.ExpiresUnixMs)
	}
	if e.be.Live() != 1 {
		t.Errorf("%d sandboxes run, want the one valid request's", e.be.Live())
	}
}

func TestUnknownIDs(t *testing.T) {
	e := newEnv(t, nil)
	ctx := ctxT(t)
	calls := []struct {
		name string
		call func() error
	}{
		{"get", func() error { _, err := e.c.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: "sb-nope"}); return err }},
		{"destroy", func() error {
			_, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: "sb-nope"})
			return err
		}},
		{"pause", func() error { _, err := e.c.PauseSandbox(ctx, &kilnpb.PauseSandboxRequest{Id: "sb-nope"}); return err }},
		{"exec", func() error {
			return e.exec(ctx, &kilnpb.ExecStart{SandboxId: "sb-nope", Argv: []string{"true"}}).err
		}},
		{"stat", func() error {
			_, err := e.c.Stat(ctx, &kilnpb.StatRequest{SandboxId: "sb-nope", Path: "/"})
			return err
		}},
		{"list execs", func() error {
			_, err := e.c.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: "sb-nope"})
			return err
		}},
		{"checkpoint", func() error {
			_, err := e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: "sb-nope"})
			return err
		}},
		{"delete checkpoint", func() error {
			_, err := e.c.DeleteCheckpoint(ctx, &kilnpb.DeleteCheckpointRequest{Id: "ck-nope"})
			return err
		}},
	}
	for _, tc := range calls {
		t.Run(tc.name, func(t *testing.T) { wantCode(t, tc.call(), codes.NotFound, "nope") })
	}
	_, err := e.c.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: "../etc"})
	wantCode(t, err, codes.InvalidArgument, "sandbox ID")
}

func TestRequestID(t *testing.T) {
	e := newEnv(t, nil)
	req := &kilnpb.CreateSandboxRequest{RequestId: "job-7", Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}}
	var wg sync.WaitGroup
	ids := make([]string, 8)
	errs := make([]error, 8)
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sb, err := e.c.CreateSandbox(ctxT(t), req)
			errs[i] = err
			if err == nil {
				ids[i] = sb.Id
			}
		}()
	}
	wg.Wait()
	for i := range ids {
		if errs[i] != nil || ids[i] != ids[0] {
			t.Fatalf("retry %d: %s, %v; want %s", i, ids[i], errs[i], ids[0])
		}
	}
	if e.be.Live() != 1 {
		t.Errorf("%d sandboxes for one request ID", e.be.Live())
	}
	other := &kilnpb.CreateSandboxRequest{RequestId: "job-7", Source: &kilnpb.CreateSandboxRequest_Image{Image: "alpine"}}
	_, err := e.c.CreateSandbox(ctxT(t), other)
	wantCode(t, err, codes.AlreadyExists, "job-7")
	// The request ID is remembered across a restart.
	e.stop()
	e.start()
	sb, err := e.c.CreateSandbox(ctxT(t), req)
	if err != nil || sb.Id != ids[0] {
		t.Errorf("retry after a restart: %v, %v; want %s", sb.GetId(), err, ids[0])
	}
}

func TestHostLimits(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.MaxSandboxes = 2; c.MaxMemoryMiB = 1024 })
	e.create(&kilnpb.CreateSandboxRequest{Resources: &kilnpb.Resources{MemoryMib: 256}})
	_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: "big", Source: &kilnpb.CreateSandboxRequest_Image{Image: "x"}, Resources: &kilnpb.Resources{MemoryMib: 1000}})
	wantCode(t, err, codes.ResourceExhausted, "limit of 1024 MiB")
	b := e.create(nil)
	_, err = e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: "third", Source: &kilnpb.CreateSandboxRequest_Image{Image: "x"}})
	wantCode(t, err, codes.ResourceExhausted, "limit is 2")
	// An ended sandbox no longer counts.
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: b.Id})
	e.create(nil)
}

func TestCreateFailure(t *testing.T) {
	e := newEnv(t, nil)
	e.be.Images = []string{"busybox"}
	_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: "r", Source: &kilnpb.CreateSandboxRequest_Image{Image: "nosuch"}})
	wantCode(t, err, codes.NotFound, "nosuch")
	list, _ := e.c.ListSandboxes(ctxT(t), &kilnpb.ListSandboxesRequest{States: []kilnpb.SandboxState{kilnpb.SandboxState_SANDBOX_STATE_FAILED}})
	if len(list.GetSandboxes()) != 1 || !strings.Contains(list.Sandboxes[0].Reason, "nosuch") {
		t.Fatalf("failed sandboxes: %v", list.GetSandboxes())
	}
	if _, err := os.Stat(filepath.Join(e.state, "sandboxes", list.Sandboxes[0].Id)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a failed start left its folder: %v", err)
	}
}

func TestListSandboxes(t *testing.T) {
	e := newEnv(t, nil)
	a := e.create(&kilnpb.CreateSandboxRequest{Labels: map[string]string{"team": "rl", "run": "1"}})
	e.clock.Advance(time.Millisecond) // listed oldest first
	b := e.create(&kilnpb.CreateSandboxRequest{Labels: map[string]string{"team": "rl", "run": "2"}})
	c := e.create(&kilnpb.CreateSandboxRequest{Labels: map[string]string{"team": "web"}})
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: c.Id})
	ids := func(req *kilnpb.ListSandboxesRequest) string {
		r, err := e.c.ListSandboxes(ctxT(t), req)
		if err != nil {
			t.Fatal(err)
		}
		var out []string
		for _, sb := range r.Sandboxes {
			out = append(out, sb.Id)
		}
		return strings.Join(out, ",")
	}
	tests := []struct {
		name string
		req  *kilnpb.ListSandboxesRequest
		want string
	}{
		{"live", &kilnpb.ListSandboxesRequest{}, a.Id + "," + b.Id},
		{"label", &kilnpb.ListSandboxesRequest{Labels: map[string]string{"run": "2"}}, b.Id},
		{"labels", &kilnpb.ListSandboxesRequest{Labels: map[string]string{"team": "rl", "run": "1"}}, a.Id},
		{"destroyed", &kilnpb.ListSandboxesRequest{States: []kilnpb.SandboxState{kilnpb.SandboxState_SANDBOX_STATE_DESTROYED}}, c.Id},
		{"no match", &kilnpb.ListSandboxesRequest{Labels: map[string]string{"team": "none"}}, ""},
	}
	for _, tc := range tests {
		if got := ids(tc.req); got != tc.want {
			t.Errorf("%s: %s, want %s", tc.name, got, tc.want)
		}
	}
	_, err := e.c.ListSandboxes(ctxT(t), &kilnpb.ListSandboxesRequest{States: []kilnpb.SandboxState{99}})
	wantCode(t, err, codes.InvalidArgument, "99")
}

func TestPauseResume(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	p, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id})
	if err != nil || p.State != kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
		t.Fatalf("pause: %v %v", p, err)
	}
	r := e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"true"}})
	wantCode(t, r.err, codes.FailedPrecondition, "paused")
	if _, err := e.c.ResumeSandbox(ctxT(t), &kilnpb.ResumeSandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if r := e.sh(sb.Id, "echo ok"); r.stdout != "ok\n" {
		t.Errorf("exec after resume: %+v", r)
	}
}

// TestSlowCreate: while a sandbox starts it is listed as starting, a
// retry of its request waits for it, and a destroy waits for the start
// and then leaves nothing.
func TestSlowCreate(t *testing.T) {
	e := newEnv(t, nil)
	release := make(chan struct{})
	e.be.CreateHook = func(ctx context.Context, spec daemon.CreateSpec) error {
		select {
		case <-release:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	req := &kilnpb.CreateSandboxRequest{RequestId: "slow", Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}}
	type result struct {
		sb  *kilnpb.Sandbox
		err error
	}
	results := make(chan result, 2)
	for range 2 {
		go func() {
			sb, err := e.c.CreateSandbox(ctxT(t), req)
			results <- result{sb, err}
		}()
	}
	var starting *kilnpb.Sandbox
	deadline := time.Now().Add(5 * time.Second)
	for starting == nil {
		list, err := e.c.ListSandboxes(ctxT(t), &kilnpb.ListSandboxesRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(list.Sandboxes) == 1 {
			starting = list.Sandboxes[0]
		}
		if time.Now().After(deadline) {
			t.Fatal("no starting sandbox listed")
		}
		time.Sleep(time.Millisecond)
	}
	if starting.State != kilnpb.SandboxState_SANDBOX_STATE_STARTING {
		t.Errorf("listed while starting as %v", starting.State)
	}
	r := e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: starting.Id, Argv: []string{"true"}})
	wantCode(t, r.err, codes.FailedPrecondition, "starting")
	destroyed := make(chan error, 1)
	go func() {
		_, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: starting.Id})
		destroyed <- err
	}()
	time.Sleep(20 * time.Millisecond)
	close(release)
	for range 2 {
		res := <-results
		if res.err != nil || res.sb.Id != starting.Id {
			t.Errorf("create: %v %v, want %s", res.sb, res.err, starting.Id)
		}
	}
	if err := <-destroyed; err != nil {
		t.Fatal(err)
	}
	e.waitState(starting.Id, kilnpb.SandboxState_SANDBOX_STATE_DESTROYED)
	if n := e.be.Live(); n != 0 {
		t.Errorf("%d sandboxes left", n)
	}
}

func TestCloseEndsWatchers(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	events, err := e.c.WatchEvents(ctxT(t), &kilnpb.WatchEventsRequest{SandboxIds: []string{sb.Id}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := events.Header(); err != nil { // subscribed
		t.Fatal(err)
	}
	e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id})
	if ev, err := events.Recv(); err != nil || ev.Kind != kilnpb.Event_KIND_PAUSED {
		t.Fatalf("event %v %v, want paused", ev, err)
	}
	e.srv.Close(ctxT(t))
	_, err = events.Recv()
	wantCode(t, err, codes.Unavailable, "shutting down")
	if e.be.Live() != 1 {
		t.Error("Close stopped a sandbox")
	}
}

// TestManySandboxes: 50 concurrent creates with an exec each, then
// destroys: no error, every output right, nothing left.
func TestManySandboxes(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.MaxMemoryMiB, c.MemoryOvercommit = 64<<10, 4 }) // 50 × 512 MiB
	const n = 50
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx := ctxT(t)
			sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: "many-" + string(rune('A'+i)), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
			if err != nil {
				errs <- err
				return
			}
			r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"echo", sb.Id}})
			if r.err != nil || r.stdout != sb.Id+"\n" {
				errs <- errors.New("exec in " + sb.Id + ": " + r.stdout)
			}
			if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if n := e.be.Live(); n != 0 {
		t.Errorf("%d sandboxes left", n)
	}
	left, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "sb-*[^n]"))
	if len(left) != 0 {
		t.Errorf("folders left: %v", left)
	}
}

func TestRetryAfterFailedCreate(t *testing.T) {
	e := newEnv(t, nil)
	fail := true
	var mu sync.Mutex
	e.be.CreateHook = func(context.Context, daemon.CreateSpec) error {
		mu.Lock()
		defer mu.Unlock()
		if fail {
			fail = false
			return errors.New("the first start fails")
		}
		return nil
	}
	req := &kilnpb.CreateSandboxRequest{RequestId: "again", Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}}
	_, err := e.c.CreateSandbox(ctxT(t), req)
	wantCode(t, err, codes.Internal, "the first start fails")
	sb, err := e.c.CreateSandbox(ctxT(t), req)
	if err != nil || sb.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		t.Fatalf("retry after a failed start: %v %v", sb, err)
	}
}

func TestKeepEnded(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.KeepEnded = 2 })
	var ids []string
	for range 4 {
		sb := e.create(nil)
		e.clock.Advance(time.Millisecond)
		e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id})
		ids = append(ids, sb.Id)
	}
	for i, id := range ids {
		_, err := e.c.GetSandbox(ctxT(t), &kilnpb.GetSandboxRequest{Id: id})
		if i < 2 {
			wantCode(t, err, codes.NotFound, id)
		} else if err != nil {
			t.Errorf("recent ended sandbox %s: %v", id, err)
		}
	}
	recs, _ := filepath.Glob(filepath.Join(e.state, "sandboxes", "*.json"))
	if len(recs) != 2 {
		t.Errorf("records kept: %v", recs)
	}
}

func TestDestroyPaused(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	if _, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	waitGone(t, sb.Pid)
	_, err := e.c.ResumeSandbox(ctxT(t), &kilnpb.ResumeSandboxRequest{Id: sb.Id})
	wantCode(t, err, codes.FailedPrecondition, "destroyed")
}

// TestCreateWritableCap: resources.disk_mib reaches the backend as the
// writable layer's cap and is reported back, also after a restart.
func TestCreateWritableCap(t *testing.T) {
	e := newEnv(t, nil)
	var got daemon.CreateSpec
	e.be.CreateHook = func(_ context.Context, spec daemon.CreateSpec) error {
		got = spec
		return nil
	}
	sb := e.create(&kilnpb.CreateSandboxRequest{Resources: &kilnpb.Resources{MemoryMib: 256, DiskMib: 128}})
	if got.WritableMiB != 128 || got.MemoryMiB != 256 {
		t.Errorf("backend spec %+v, want 128 MiB writable of 256", got)
	}
	if r := sb.GetResources(); r.GetDiskMib() != 128 {
		t.Errorf("sandbox resources %+v, want disk_mib 128", r)
	}
	again, err := e.c.GetSandbox(ctxT(t), &kilnpb.GetSandboxRequest{Id: sb.Id})
	if err != nil || again.GetResources().GetDiskMib() != 128 {
		t.Errorf("GetSandbox: %v %v", again, err)
	}
}
