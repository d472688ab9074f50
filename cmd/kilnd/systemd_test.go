package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kilnvm/kiln/daemon/client"
)

// notifySocket plays systemd's side of the notify protocol: a unixgram
// socket whose datagrams are NOTIFY_SOCKET messages, one assignment a line.
type notifySocket struct {
	t    *testing.T
	path string
	conn *net.UnixConn
}

func newNotifySocket(t *testing.T, dir string) *notifySocket {
	t.Helper()
	p := filepath.Join(dir, "notify")
	c, err := net.ListenUnixgram("unixgram", &net.UnixAddr{Name: p, Net: "unixgram"})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &notifySocket{t: t, path: p, conn: c}
}

// next returns the next message's lines, or nil when none comes in d.
func (n *notifySocket) next(d time.Duration) []string {
	n.t.Helper()
	n.conn.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, 4096)
	k, err := n.conn.Read(buf)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		return nil
	}
	if err != nil {
		n.t.Fatalf("reading the notify socket: %v", err)
	}
	return strings.Split(string(buf[:k]), "\n")
}

// until reads messages until one has line want (returned with the lines
// of every message before it), failing after d.
func (n *notifySocket) until(want string, d time.Duration) (msg []string, before []string) {
	n.t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		m := n.next(time.Until(deadline))
		for _, l := range m {
			if l == want {
				return m, before
			}
		}
		before = append(before, m...)
	}
	n.t.Fatalf("no %s on the notify socket in %v; got %q", want, d, before)
	return nil, nil
}

// kilndChild is kilnd (this test binary over the test backend, TestMain)
// in a process of its own.
type kilndChild struct {
	cmd    *exec.Cmd
	stderr bytes.Buffer
	done   chan struct{}
	err    error
}

// startKilnd starts kilnd with args and extra environment; with files,
// they are its descriptors 3... and it is started through sh so that
// LISTEN_PID is its own pid (socket activation).
func startKilnd(t *testing.T, args, env []string, files ...*os.File) *kilndChild {
	t.Helper()
	k := &kilndChild{done: make(chan struct{})}
	if len(files) > 0 {
		k.cmd = exec.Command("/bin/sh", append([]string{"-c", `LISTEN_PID=$$ exec "$0" "$@"`, os.Args[0]}, args...)...)
		env = append(env, fmt.Sprintf("LISTEN_FDS=%d", len(files)))
		k.cmd.ExtraFiles = files
	} else {
		k.cmd = exec.Command(os.Args[0], args...)
	}
	k.cmd.Env = append(append(os.Environ(), testKilndEnv+"=1"), env...)
	k.cmd.Stderr = &k.stderr
	if err := k.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { k.err = k.cmd.Wait(); close(k.done) }()
	t.Cleanup(func() {
		select {
		case <-k.done:
		default:
			k.cmd.Process.Kill()
			<-k.done
		}
		if t.Failed() {
			t.Logf("kilnd %d's log:\n%s", k.cmd.Process.Pid, k.stderr.String())
		}
	})
	return k
}

func (k *kilndChild) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case <-k.done:
		return k.err
	case <-time.After(d):
		t.Fatalf("kilnd %d still runs after %v", k.cmd.Process.Pid, d)
		return nil
	}
}

// healthNow is one fail-fast health check on a Unix socket: it answers
// now or fails.
func healthNow(t *testing.T, sock string) error {
	t.Helper()
	return healthCheck(sock)
}

func healthCheck(sock string) error {
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "kiln.v1.Kiln"}, grpc.WaitForReady(false))
	if err != nil {
		return err
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("health: %s", resp.GetStatus())
	}
	return nil
}

// processState is /proc/PID/stat's state letter.
func processState(pid int) byte {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0
	}
	return b[i+2]
}

// watchdogUsec is the tests' WATCHDOG_USEC: kilnd pings every 150 ms.
const watchdogUsec = 300000

// TestNotifyProtocol plays systemd for a kilnd process: STATUS= lines
// come, READY=1 comes once the API answers (a fail-fast health check at
// that moment succeeds), WATCHDOG=1 pings come about every
// WATCHDOG_USEC/2; a stopped (wedged) kilnd pings no more, so "systemd"
// kills it with SIGABRT, and a new kilnd over the same state folder and
// socket comes up READY.
func TestNotifyProtocol(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "kilnd.sock")
	ns := newNotifySocket(t, dir)
	args := []string{"--config=", "--listen", "unix:" + sock, "--state-dir", filepath.Join(dir, "state"), "--vmm", "/bin/true"}
	env := []string{"NOTIFY_SOCKET=" + ns.path, fmt.Sprintf("WATCHDOG_USEC=%d", watchdogUsec)}

	// A client's dial loop: when its first call succeeds, noted for the log.
	firstAnswer := make(chan time.Time, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		for ctx.Err() == nil {
			if c, err := net.Dial("unix", sock); err == nil {
				c.Close()
				if healthCheck(sock) == nil {
					firstAnswer <- time.Now()
					return
				}
			}
			time.Sleep(time.Millisecond)
		}
	}()

	began := time.Now()
	k := startKilnd(t, args, env)
	ready, before := ns.until("READY=1", 30*time.Second)
	readyAt := time.Now()
	if err := healthNow(t, sock); err != nil {
		t.Fatalf("READY=1 came but the API does not answer: %v", err)
	}
	if !strings.Contains(strings.Join(before, "\n"), "STATUS=adopting sandboxes") {
		t.Errorf("before READY=1: %q; want STATUS=adopting sandboxes", before)
	}
	if !strings.Contains(strings.Join(ready, "\n"), "STATUS=serving: 0 sandboxes") {
		t.Errorf("READY=1 came with %q; want STATUS=serving: 0 sandboxes", ready)
	}
	select {
	case at := <-firstAnswer:
		t.Logf("READY=1 %v after start; the dial loop's first answer %v after", readyAt.Sub(began).Round(time.Millisecond), at.Sub(began).Round(time.Millisecond))
	case <-time.After(10 * time.Second):
		t.Error("the dial loop never got an answer")
	}

	// WATCHDOG=1 every 150 ms: over 1.5 s, at least 2 (about 10).
	pings := 0
	for end := time.Now().Add(1500 * time.Millisecond); time.Now().Before(end); {
		for _, l := range ns.next(time.Until(end)) {
			if l == "WATCHDOG=1" {
				pings++
			}
		}
	}
	t.Logf("%d WATCHDOG=1 pings in 1.5 s (WATCHDOG_USEC=%d)", pings, watchdogUsec)
	if pings < 2 {
		t.Fatalf("%d WATCHDOG=1 pings in 1.5 s; want at least 2", pings)
	}

	// Wedged: SIGSTOP. Once stopped, drain what it sent before; then no
	// ping comes within WATCHDOG_USEC (twice over), and "systemd" sends
	// WatchdogSignal=SIGABRT (then SIGCONT, as systemd does).
	pid := k.cmd.Process.Pid
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); processState(pid) != 'T'; {
		if time.Now().After(deadline) {
			t.Fatalf("kilnd %d is not stopped: state %c", pid, processState(pid))
		}
		time.Sleep(time.Millisecond)
	}
	for ns.next(10*time.Millisecond) != nil {
	}
	for end := time.Now().Add(2 * watchdogUsec * time.Microsecond); time.Now().Before(end); {
		if m := ns.next(time.Until(end)); m != nil {
			t.Fatalf("a stopped kilnd sent %q", m)
		}
	}
	syscall.Kill(pid, syscall.SIGABRT)
	syscall.Kill(pid, syscall.SIGCONT)
	var exit *exec.ExitError
	if err := k.wait(t, 30*time.Second); !errors.As(err, &exit) || exit.Success() {
		t.Fatalf("kilnd after SIGABRT: %v; want it dead", err)
	}
	if !strings.Contains(k.stderr.String(), "SIGABRT") {
		t.Errorf("kilnd's stderr after SIGABRT has no SIGABRT dump:\n%s", k.stderr.String())
	}

	// "systemd" restarts it: same state folder, a stale socket to replace.
	k2 := startKilnd(t, args, env)
	ns.until("READY=1", 30*time.Second)
	if err := healthNow(t, sock); err != nil {
		t.Fatalf("the restarted kilnd: READY=1 but %v", err)
	}
	if m, _ := ns.until("WATCHDOG=1", 10*time.Second); m == nil {
		t.Fatal("the restarted kilnd does not ping")
	}
	k2.cmd.Process.Signal(syscall.SIGTERM)
	ns.until("STOPPING=1", 30*time.Second)
	if err := k2.wait(t, 30*time.Second); err != nil {
		t.Fatalf("kilnd after SIGTERM: %v", err)
	}
}

// TestSocketActivation: kilnd serves on the socket systemd passes (fd 3,
// LISTEN_FDS=1, LISTEN_PID its pid) instead of its default socket, also
// on a --listen, skips a --listen naming the passed socket, and on exit
// leaves the passed socket in place; a call made while no kilnd runs
// waits in the socket's backlog and is answered by the next kilnd.
func TestSocketActivation(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "activated.sock")
	other := filepath.Join(dir, "other.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(true)
	defer ln.Close()
	f, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	_, defaultErr := os.Lstat(defaultSocket)

	ns := newNotifySocket(t, dir)
	args := []string{"--config=", "--state-dir", filepath.Join(dir, "state"), "--vmm", "/bin/true",
		"--listen", "unix:" + other, "--listen", "unix:" + sock}
	env := []string{"NOTIFY_SOCKET=" + ns.path}
	k := startKilnd(t, args, env, f)
	ns.until("READY=1", 30*time.Second)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, s := range []string{sock, other} {
		c, err := client.Dial(ctx, "unix:"+s)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.ListSandboxes(ctx, client.ListOptions{}); err != nil {
			t.Errorf("ListSandboxes on %s: %v", s, err)
		}
		c.Close()
	}
	if _, err := os.Lstat(defaultSocket); (err == nil) != (defaultErr == nil) {
		t.Errorf("kilnd with a passed socket touched the default %s: %v (before: %v)", defaultSocket, err, defaultErr)
	}
	k.cmd.Process.Signal(syscall.SIGTERM)
	if err := k.wait(t, 30*time.Second); err != nil {
		t.Fatalf("kilnd after SIGTERM: %v", err)
	}
	if fi, err := os.Lstat(sock); err != nil || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("the passed socket after kilnd's exit: %v, %v; want it in place", fi, err)
	}
	if _, err := os.Lstat(other); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("kilnd's own socket %s after its exit: %v; want it removed", other, err)
	}

	// No kilnd runs: a call connects (the backlog) and waits; the next
	// kilnd, passed the same socket, answers it.
	conn := rawConn(t, "unix://"+sock)
	answered := make(chan error, 1)
	go func() {
		_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(true))
		answered <- err
	}()
	select {
	case err := <-answered:
		t.Fatalf("a call with no kilnd running returned: %v", err)
	case <-time.After(200 * time.Millisecond):
	}
	k2 := startKilnd(t, args, env, f)
	if err := <-answered; err != nil {
		t.Fatalf("the call made before the second kilnd: %v", err)
	}
	k2.cmd.Process.Signal(syscall.SIGTERM)
	if err := k2.wait(t, 30*time.Second); err != nil {
		t.Fatalf("the second kilnd after SIGTERM: %v", err)
	}
}

// TestWatchdogNeedsSelfCheck: the watchdog pings only while the health
// check over kilnd's own socket passes, over a Unix socket or, with the
// bearer token, over TCP.
func TestWatchdogNeedsSelfCheck(t *testing.T) {
	const token = "0123456789abcdef-watchdog"
	for _, network := range []string{"unix", "tcp"} {
		t.Run(network, func(t *testing.T) {
			dir := t.TempDir()
			ns := newNotifySocket(t, dir)
			t.Setenv("NOTIFY_SOCKET", ns.path)
			var ln net.Listener
			var err error
			if network == "unix" {
				ln, err = listen(listenSpec{"unix", filepath.Join(dir, "k.sock")}, -1)
			} else {
				ln, err = listen(listenSpec{"tcp", "0.0.0.0:0"}, -1)
			}
			if err != nil {
				t.Fatal(err)
			}
			a := auth{token: []byte(token)}
			srv := grpc.NewServer(grpc.ChainUnaryInterceptor(a.unary))
			hs := health.NewServer()
			healthpb.RegisterHealthServer(srv, hs)
			hs.SetServingStatus("kiln.v1.Kiln", healthpb.HealthCheckResponse_NOT_SERVING)
			go srv.Serve(ln)
			defer srv.Stop()

			self, err := dialSelf([]net.Listener{ln}, a)
			if err != nil {
				t.Fatal(err)
			}
			defer self.Close()
			ctx, cancel := context.WithCancel(context.Background())
			done := make(chan struct{})
			go func() { self.watchdog(ctx, 100*time.Millisecond, discardLogger()); close(done) }()
			defer func() { cancel(); <-done }()

			for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); {
				if m := ns.next(time.Until(end)); m != nil {
					t.Fatalf("pinged %q while the health check says NOT_SERVING", m)
				}
			}
			hs.SetServingStatus("kiln.v1.Kiln", healthpb.HealthCheckResponse_SERVING)
			ns.until("WATCHDOG=1", 10*time.Second)
			hs.SetServingStatus("kiln.v1.Kiln", healthpb.HealthCheckResponse_NOT_SERVING)
			for ns.next(200*time.Millisecond) != nil {
			}
			for end := time.Now().Add(500 * time.Millisecond); time.Now().Before(end); {
				if m := ns.next(time.Until(end)); m != nil {
					t.Fatalf("pinged %q after the health check failed again", m)
				}
			}
		})
	}
	// Without the token a TCP self-check fails: it is the check's token
	// that lets it in above.
	ln, err := listen(listenSpec{"tcp", "127.0.0.1:0"}, -1)
	if err != nil {
		t.Fatal(err)
	}
	a := auth{token: []byte(token)}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(a.unary))
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	hs.SetServingStatus("kiln.v1.Kiln", healthpb.HealthCheckResponse_SERVING)
	go srv.Serve(ln)
	defer srv.Stop()
	self, err := dialSelf([]net.Listener{ln}, auth{})
	if err != nil {
		t.Fatal(err)
	}
	defer self.Close()
	if err := self.check(context.Background(), 5*time.Second); err == nil || !strings.Contains(err.Error(), "Unauthenticated") {
		t.Errorf("a TCP self-check without the token: %v; want Unauthenticated", err)
	}
}
