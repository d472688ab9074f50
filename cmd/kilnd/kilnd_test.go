package main

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/vmmproc"
)

// listOnly is a kiln.v1 service that answers ListSandboxes (with nothing)
// and records its Close: enough to see who gets through kilnd's door.
type listOnly struct {
	kilnpb.UnimplementedKilnServer
	closed atomic.Bool
}

func (s *listOnly) Register(r grpc.ServiceRegistrar) { kilnpb.RegisterKilnServer(r, s) }
func (s *listOnly) Close(context.Context) error      { s.closed.Store(true); return nil }
func (s *listOnly) ListSandboxes(context.Context, *kilnpb.ListSandboxesRequest) (*kilnpb.ListSandboxesResponse, error) {
	return &kilnpb.ListSandboxesResponse{}, nil
}

func TestParseListen(t *testing.T) {
	tests := []struct {
		in      string
		want    listenSpec
		wantErr string
	}{
		{in: "unix:/run/kiln/kilnd.sock", want: listenSpec{"unix", "/run/kiln/kilnd.sock"}},
		{in: "unix:///run/kiln/../kiln/kilnd.sock", want: listenSpec{"unix", "/run/kiln/kilnd.sock"}},
		{in: "tcp:127.0.0.1:7070", want: listenSpec{"tcp", "127.0.0.1:7070"}},
		{in: "tcp://127.0.0.1:7070", want: listenSpec{"tcp", "127.0.0.1:7070"}},
		{in: "tcp:[::1]:0", want: listenSpec{"tcp", "[::1]:0"}},
		{in: "unix:kilnd.sock", wantErr: "absolute"},
		{in: "tcp:127.0.0.1", wantErr: "tcp:HOST:PORT"},
		{in: "udp:127.0.0.1:1", wantErr: "unknown network"},
		{in: "/run/kiln/kilnd.sock", wantErr: "unix:PATH"},
		{in: "unix:", wantErr: "unix:PATH"},
	}
	for _, tt := range tests {
		got, err := parseListen(tt.in)
		if tt.wantErr != "" {
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Errorf("parseListen(%q) = %v, %v; want an error with %q", tt.in, got, err, tt.wantErr)
			}
			continue
		}
		if err != nil || got != tt.want {
			t.Errorf("parseListen(%q) = %v, %v; want %v", tt.in, got, err, tt.want)
		}
	}
}

func TestParseFlags(t *testing.T) {
	tok := filepath.Join(t.TempDir(), "token")
	tests := []struct {
		name      string
		args      []string
		wantErr   string
		wantLists string
	}{
		{name: "defaults", args: nil, wantLists: "unix:" + defaultSocket},
		{name: "tcp adds the default socket", args: []string{"--listen", "tcp:127.0.0.1:7070", "--token-file", tok},
			wantLists: "unix:" + defaultSocket + ",tcp:127.0.0.1:7070"},
		{name: "own socket", args: []string{"--listen", "unix:/tmp/k.sock"}, wantLists: "unix:/tmp/k.sock"},
		{name: "tcp without a token", args: []string{"--listen", "tcp:127.0.0.1:7070"}, wantErr: "--token-file"},
		{name: "bad listen", args: []string{"--listen", "tcp:nowhere"}, wantErr: "tcp:HOST:PORT"},
		{name: "stray argument", args: []string{"serve"}, wantErr: `unexpected argument "serve"`},
		{name: "empty state dir", args: []string{"--state-dir", ""}, wantErr: "--state-dir"},
		{name: "negative max", args: []string{"--max-sandboxes", "-1"}, wantErr: "negative"},
		{name: "negative lifetime", args: []string{"--default-lifetime", "-1s"}, wantErr: "negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cfg, err := parseFlags(tt.args, &bytes.Buffer{})
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("parseFlags(%q): %v; want an error with %q", tt.args, err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if got := (*listenFlag)(&cfg.listens).String(); got != tt.wantLists {
				t.Errorf("listens %s; want %s", got, tt.wantLists)
			}
			if cfg.stateDir != "/var/lib/kiln" || cfg.vmm != "" || cfg.kiln != "" {
				t.Errorf("state dir %q, vmm %q, kiln %q; want /var/lib/kiln and no VMM binary named (sandbox.FindVMM's)", cfg.stateDir, cfg.vmm, cfg.kiln)
			}
		})
	}
}

func TestLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:7070": true, "[::1]:7070": true, "localhost:1": true, "127.1.2.3:0": true,
		"0.0.0.0:7070": false, ":7070": false, "10.0.0.1:7070": false, "example.com:80": false, "nonsense": false,
	} {
		if got := loopback(addr); got != want {
			t.Errorf("loopback(%q) = %v; want %v", addr, got, want)
		}
	}
}

func TestReadToken(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if tok, err := readToken(write("ok", "  0123456789abcdef0123  \nignored\n")); err != nil || string(tok) != "0123456789abcdef0123" {
		t.Errorf("readToken: %q, %v", tok, err)
	}
	if _, err := readToken(write("short", "abc\n")); err == nil || !strings.Contains(err.Error(), "at least 16") {
		t.Errorf("a short token: %v", err)
	}
	if _, err := readToken(filepath.Join(dir, "missing")); err == nil {
		t.Error("a missing token file was accepted")
	}
}

// TestListenUnix: the folder is made, the socket is 0660, a stale socket
// is replaced, and a live one is refused.
func TestListenUnix(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "run", "kiln", "kilnd.sock")
	l := listenSpec{"unix", sock}
	ln, err := listen(l, -1)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(sock)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o660 {
		t.Errorf("socket mode %v; want a socket, 0660", fi.Mode())
	}
	if _, err := listen(l, -1); err == nil || !strings.Contains(err.Error(), "another daemon") {
		t.Errorf("listening on a live socket: %v; want refused", err)
	}
	// A socket left behind by a daemon that died.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	ln, err = listen(l, -1)
	if err != nil {
		t.Fatalf("listening over a stale socket: %v", err)
	}
	ln.Close()
	// --socket-group: the socket gets that group.
	gsock := filepath.Join(t.TempDir(), "g.sock")
	gid := os.Getgid()
	ln, err = listen(listenSpec{"unix", gsock}, gid)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(gsock); err != nil || fi.Sys().(*syscall.Stat_t).Gid != uint32(gid) {
		t.Errorf("socket with --socket-group %d: %v, %v", gid, fi, err)
	}
	ln.Close()
	if g, err := lookupGroup(strconv.Itoa(gid)); err != nil || g != gid {
		t.Errorf("lookupGroup(%d) = %d, %v", gid, g, err)
	}
	if _, err := lookupGroup("no-such-group-kiln"); err == nil {
		t.Error("lookupGroup of an unknown group succeeded")
	}
	plain := filepath.Join(t.TempDir(), "file")
	os.WriteFile(plain, nil, 0o600)
	if _, err := listen(listenSpec{"unix", plain}, -1); err == nil || !strings.Contains(err.Error(), "not a socket") {
		t.Errorf("listening over a plain file: %v; want refused", err)
	}
}

// serveTest serves a listOnly on a Unix socket and 127.0.0.1:0 with token
// and returns the two addresses and a stop function that waits for serve.
func serveTest(t *testing.T, token string) (sock, tcp string, svc *listOnly, stop func() error) {
	t.Helper()
	sock = filepath.Join(t.TempDir(), "kilnd.sock")
	uln, err := listen(listenSpec{"unix", sock}, -1)
	if err != nil {
		t.Fatal(err)
	}
	tln, err := listen(listenSpec{"tcp", "127.0.0.1:0"}, -1)
	if err != nil {
		t.Fatal(err)
	}
	svc = &listOnly{}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- serve(ctx, []net.Listener{uln, tln}, auth{token: []byte(token)}, svc, discardLogger(), serveOptions{})
	}()
	var stopped bool
	stop = func() error {
		if stopped {
			return nil
		}
		stopped = true
		cancel()
		return <-done
	}
	t.Cleanup(func() { stop() })
	return sock, tln.Addr().String(), svc, stop
}

func rawConn(t *testing.T, target string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(target, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func TestTokenAuth(t *testing.T) {
	const token = "0123456789abcdef-secret"
	sock, tcp, _, _ := serveTest(t, token)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	tests := []struct {
		name string
		host string
		opts []client.Option
		want codes.Code
	}{
		{name: "tcp without a token", host: "tcp://" + tcp, want: codes.Unauthenticated},
		{name: "tcp with a wrong token", host: "tcp://" + tcp, opts: []client.Option{client.WithToken("0123456789abcdef-secreT")}, want: codes.Unauthenticated},
		{name: "tcp with a prefix of the token", host: "tcp://" + tcp, opts: []client.Option{client.WithToken("0123456789abcdef")}, want: codes.Unauthenticated},
		{name: "tcp with the token", host: "tcp://" + tcp, opts: []client.Option{client.WithToken(token)}, want: codes.OK},
		{name: "unix without a token", host: "unix:" + sock, want: codes.OK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := client.Dial(ctx, tt.host, tt.opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			_, err = c.ListSandboxes(ctx, client.ListOptions{})
			if got := status.Code(err); got != tt.want {
				t.Fatalf("ListSandboxes: %v (%v); want %v", got, err, tt.want)
			}
			// Streams are checked too.
			_, serr := c.WatchEvents(ctx)
			want := tt.want
			if want == codes.OK {
				want = codes.Unimplemented // listOnly serves no events
			}
			if got := status.Code(serr); got != want {
				t.Fatalf("WatchEvents: %v (%v); want %v", got, serr, want)
			}
			// So are the health and reflection services.
			_, err = healthpb.NewHealthClient(c.Conn()).Check(ctx, &healthpb.HealthCheckRequest{Service: "kiln.v1.Kiln"})
			if got := status.Code(err); got != tt.want {
				t.Fatalf("health: %v (%v); want %v", got, err, tt.want)
			}
		})
	}
}

func TestHealthAndReflection(t *testing.T) {
	sock, _, svc, stop := serveTest(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	conn := rawConn(t, "unix://"+sock)
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
	if err != nil || resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health: %v, %v; want SERVING", resp, err)
	}
	rc, err := reflectionpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rc.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}})
	rr, err := rc.Recv()
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range rr.GetListServicesResponse().GetService() {
		names = append(names, s.GetName())
	}
	if !strings.Contains(strings.Join(names, " "), "kiln.v1.Kiln") {
		t.Errorf("reflection lists %v; want kiln.v1.Kiln among them", names)
	}
	rc.CloseSend()

	if err := stop(); err != nil {
		t.Fatal(err)
	}
	if !svc.closed.Load() {
		t.Error("the service was not closed on stop")
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("the socket is left after a clean stop: %v", err)
	}
}

// TestTCPWithoutToken: a daemon with no token refuses every TCP call.
func TestTCPWithoutToken(t *testing.T) {
	_, tcp, _, _ := serveTest(t, "")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := client.Dial(ctx, "tcp://"+tcp, client.WithToken(""))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_, err = c.ListSandboxes(ctx, client.ListOptions{})
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("ListSandboxes: %v; want Unauthenticated", err)
	}
}

// TestRun runs kilnd's main path with a stand-in service until its
// context ends, and checks its refusals.
func TestRun(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kilnd.sock")
	svc := &listOnly{}
	newSvc := func(cfg config, _ *slog.Logger) (service, error) {
		if cfg.stateDir != filepath.Join(dir, "state") {
			t.Errorf("state dir %q", cfg.stateDir)
		}
		return svc, nil
	}
	// systemd's notify socket: kilnd says READY=1 there once it serves.
	ns := newNotifySocket(t, dir)
	t.Setenv("NOTIFY_SOCKET", ns.path)

	ctx, cancel := context.WithCancel(context.Background())
	var stderr bytes.Buffer
	done := make(chan int, 1)
	args := []string{"--config=", "--listen", "unix:" + sock, "--state-dir", filepath.Join(dir, "state"), "--vmm", "/bin/true"}
	go func() { done <- run(ctx, args, &stderr, newSvc) }()
	ns.until("READY=1", 20*time.Second)

	dctx, dcancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer dcancel()
	// READY=1 comes once the socket is served: the first dial succeeds.
	c, err := client.Dial(dctx, "unix:"+sock)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.ListSandboxes(dctx, client.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	c.Close()

	// A second kilnd on the same socket stops before making its service.
	var stderr2 bytes.Buffer
	if code := run(context.Background(), args, &stderr2, func(config, *slog.Logger) (service, error) {
		t.Error("a second kilnd made its service")
		return svc, nil
	}); code != 1 || !strings.Contains(stderr2.String(), "another daemon") {
		t.Errorf("second kilnd: exit %d, %q", code, stderr2.String())
	}

	cancel()
	ns.until("STOPPING=1", 20*time.Second)
	if code := <-done; code != 0 {
		t.Fatalf("kilnd exited %d: %s", code, stderr.String())
	}
	if !svc.closed.Load() {
		t.Error("the service was not closed")
	}
	if code := run(context.Background(), []string{"--listen", "tcp:127.0.0.1:0"}, &stderr, newSvc); code != 2 {
		t.Errorf("TCP without a token: exit %d; want 2", code)
	}
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// TestRestartKeepsSandboxes runs kilnd's main path over package daemon
// and its test backend: a sandbox made before a clean stop is still
// running after it, and the next kilnd over the same state folder lists it
// with the same ID and runs execs in it.
func TestRestartKeepsSandboxes(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kilnd.sock")
	state := filepath.Join(dir, "state")
	be := &daemontest.Backend{}
	newSvc := func(cfg config, log *slog.Logger) (service, error) {
		return daemon.New(daemon.Config{StateDir: cfg.stateDir, Backend: be, HostMemoryMiB: 16384, HostCPUs: 8, Logger: log})
	}
	args := []string{"--config=", "--listen", "unix:" + sock, "--state-dir", state, "--vmm", "/bin/true"}
	start := func() (stop func()) {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan int, 1)
		var stderr bytes.Buffer
		go func() { done <- run(ctx, args, &stderr, newSvc) }()
		return func() {
			cancel()
			if code := <-done; code != 0 {
				t.Errorf("kilnd exited %d: %s", code, stderr.String())
			}
		}
	}
	dialUp := func(ctx context.Context) *client.Client {
		for {
			c, err := client.Dial(ctx, "unix:"+sock)
			if err == nil {
				return c
			}
			if ctx.Err() != nil {
				t.Fatal(err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	stop := start()
	c := dialUp(ctx)
	sb, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
	if err != nil {
		t.Fatal(err)
	}
	c.Close()
	stop()
	if err := syscall.Kill(int(sb.GetPid()), 0); err != nil {
		t.Fatalf("the sandbox's process %d is gone after kilnd stopped: %v", sb.GetPid(), err)
	}

	stop = start()
	defer stop()
	c = dialUp(ctx)
	defer c.Close()
	got, err := c.GetSandbox(ctx, sb.GetId())
	if err != nil || got.GetState() != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || got.GetPid() != sb.GetPid() {
		t.Fatalf("after a restart: %v, %v; want %s running as pid %d", got, err, sb.GetId(), sb.GetPid())
	}
	var out bytes.Buffer
	res, err := c.Exec(ctx, sb.GetId(), client.ExecOptions{Argv: []string{"echo", "still here"}, Stdout: &out})
	if err != nil || res.ExitCode != 0 || out.String() != "still here\n" {
		t.Fatalf("exec after a restart: %+v, %v, %q", res, err, out.String())
	}
	if err := c.DestroySandbox(ctx, sb.GetId()); err != nil {
		t.Fatal(err)
	}
	if n := be.Live(); n != 0 {
		t.Errorf("%d sandboxes live after destroy", n)
	}
}

func FuzzParseListen(f *testing.F) {
	for _, s := range []string{"unix:/run/kiln/kilnd.sock", "unix:///a/b", "tcp:127.0.0.1:7070", "tcp://[::1]:0", "udp:x", ":", "unix:"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		l, err := parseListen(s)
		if err != nil {
			return
		}
		// What parses names a network and an address, and parses again
		// to itself.
		if (l.network != "unix" && l.network != "tcp") || l.addr == "" {
			t.Fatalf("parseListen(%q) = %+v", s, l)
		}
		if again, err := parseListen(l.String()); err != nil || again != l {
			t.Fatalf("parseListen(%q) = %+v, %v; want %+v", l.String(), again, err, l)
		}
	})
}

// testKilndEnv makes the test binary run as kilnd (TestMain): over the
// test backend when it is "1", for TestSIGTERM; as kilnd itself (main,
// the real backend) when it is testKilndReal, for TestKVMKilnd.
const testKilndEnv = "KILND_TEST_AS_KILND"

// testKilndReal is testKilndEnv's value that runs kilnd's main.
const testKilndReal = "real"

func TestMain(m *testing.M) {
	// A VMM process that the real backend started (--vmm this binary):
	// what kiln-vmm runs. First, since it inherits testKilndEnv.
	if os.Getenv(vmmproc.SocketEnv) != "" {
		os.Exit(vmmproc.Main(context.Background(), nil))
	}
	switch os.Getenv(testKilndEnv) {
	case testKilndReal:
		main()
	case "1":
		ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer cancel()
		be := &daemontest.Backend{}
		os.Exit(run(ctx, os.Args[1:], os.Stderr, func(cfg config, log *slog.Logger) (service, error) {
			return daemon.New(daemon.Config{StateDir: cfg.stateDir, Backend: be, HostMemoryMiB: 16384, HostCPUs: 8, Logger: log})
		}))
	}
	os.Exit(m.Run())
}

// TestSIGTERM runs kilnd as a process of its own and stops it with
// SIGTERM, as systemd does: it exits 0, removes its socket, and the
// sandbox's process runs on.
func TestSIGTERM(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kilnd.sock")
	cmd := exec.Command(os.Args[0], "--config=", "--listen", "unix:"+sock, "--state-dir", filepath.Join(dir, "state"), "--vmm", "/bin/true")
	cmd.Env = append(os.Environ(), testKilndEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer cmd.Process.Kill()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var c *client.Client
	for {
		var err error
		if c, err = client.Dial(ctx, "unix:"+sock); err == nil {
			break
		}
		if ctx.Err() != nil {
			t.Fatalf("kilnd never served: %v: %s", err, stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
	defer c.Close()
	sb, err := c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(int(sb.GetPid()), syscall.SIGKILL)

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatalf("kilnd after SIGTERM: %v: %s", err, stderr.String())
	}
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("the socket is left after SIGTERM: %v", err)
	}
	if err := syscall.Kill(int(sb.GetPid()), 0); err != nil {
		t.Errorf("the sandbox's process %d died with kilnd: %v", sb.GetPid(), err)
	}
}
