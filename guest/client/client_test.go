package client

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"net"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// fakeUDS serves a Unix socket, handing each connection to handle.
func fakeUDS(t *testing.T, handle func(net.Conn)) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "vsock.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				handle(conn)
			}()
		}
	}()
	return path
}

// readRequest reads the CONNECT line.
func readRequest(conn net.Conn) string {
	line, _ := readLine(conn)
	return line
}

func TestHandshake(t *testing.T) {
	tests := []struct {
		name  string
		port  uint32
		reply func(net.Conn)
		want  string // substring of the error; "" for success
	}{
		{"ok", 1024, func(c net.Conn) { io.WriteString(c, "OK 1073741824\nguest says hi") }, ""},
		{"ok crlf", 52, func(c net.Conn) { io.WriteString(c, "OK 7\r\nguest says hi") }, ""},
		{"error line", 1024, func(c net.Conn) { io.WriteString(c, "ERR no listener\n") }, `unexpected reply "ERR no listener\n"`},
		{"closed", 1024, func(net.Conn) {}, "connection closed before a reply"},
		{"partial then closed", 1024, func(c net.Conn) { io.WriteString(c, "OK 12") }, `connection closed before a reply (got "OK 12"`},
		{"bad port", 1024, func(c net.Conn) { io.WriteString(c, "OK x\n") }, "bad port"},
		{"too long", 1024, func(c net.Conn) { io.WriteString(c, strings.Repeat("A", 200)) }, "longer than"},
		{"silence", 1024, func(c net.Conn) { time.Sleep(2 * time.Second) }, "i/o timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := make(chan string, 1)
			path := fakeUDS(t, func(c net.Conn) {
				got <- readRequest(c)
				tt.reply(c)
			})
			conn, err := VsockDialer(path, tt.port, 300*time.Millisecond)(t.Context())
			if tt.want != "" {
				if err == nil {
					conn.Close()
					t.Fatal("no error")
				}
				if !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), path) {
					t.Fatalf("error %q does not mention %q and the socket", err, tt.want)
				}
			} else {
				if err != nil {
					t.Fatal(err)
				}
				defer conn.Close()
				// Nothing past the reply line was consumed.
				b, err := io.ReadAll(conn)
				if err != nil || string(b) != "guest says hi" {
					t.Errorf("after the handshake: %q, %v", b, err)
				}
			}
			if want := "CONNECT " + itoa(tt.port) + "\n"; <-got != want {
				t.Errorf("request was not %q", want)
			}
		})
	}

	t.Run("no socket", func(t *testing.T) {
		_, err := VsockDialer(filepath.Join(t.TempDir(), "none"), 1024, time.Second)(t.Context())
		if err == nil || !strings.Contains(err.Error(), "none") {
			t.Fatalf("error %v", err)
		}
	})

	t.Run("cancelled", func(t *testing.T) {
		path := fakeUDS(t, func(c net.Conn) { time.Sleep(2 * time.Second) })
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(100*time.Millisecond, cancel)
		_, err := VsockDialer(path, 1024, 10*time.Second)(ctx)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("error %v, want context.Canceled", err)
		}
	})
}

func itoa(n uint32) string {
	var b []byte
	for {
		b = append([]byte{byte('0' + n%10)}, b...)
		n /= 10
		if n == 0 {
			return string(b)
		}
	}
}

func TestParseConnectReply(t *testing.T) {
	for _, tt := range []struct {
		in   string
		port uint32
		ok   bool
	}{
		{"OK 1073741824\n", 1073741824, true},
		{"OK 0\n", 0, true},
		{"OK 4294967295\r\n", 4294967295, true},
		{"OK 4294967296\n", 0, false},
		{"OK 12", 0, false},
		{"OK\n", 0, false},
		{"ok 12\n", 0, false},
		{"OK -1\n", 0, false},
		{"OK 1 2\n", 0, false},
		{"", 0, false},
	} {
		port, err := ParseConnectReply(tt.in)
		if (err == nil) != tt.ok || port != tt.port {
			t.Errorf("ParseConnectReply(%q) = %d, %v", tt.in, port, err)
		}
	}
}

func FuzzParseConnectReply(f *testing.F) {
	f.Add("OK 1073741824\n")
	f.Add("OK 12\r\n")
	f.Add("ERR x\n")
	f.Add("OK +1\n")
	f.Fuzz(func(t *testing.T, s string) {
		port, err := ParseConnectReply(s)
		if err != nil {
			if port != 0 || !strings.Contains(err.Error(), "reply") {
				t.Errorf("ParseConnectReply(%q) = %d, %v", s, port, err)
			}
			return
		}
		if !strings.HasPrefix(s, "OK ") || !strings.HasSuffix(s, "\n") {
			t.Errorf("ParseConnectReply accepted %q", s)
		}
	})
}

// healthAgent is an agent that only answers Health.
type healthAgent struct {
	agentpb.UnimplementedAgentServer
	calls atomic.Int32
}

func (h *healthAgent) Health(context.Context, *agentpb.HealthRequest) (*agentpb.HealthResponse, error) {
	h.calls.Add(1)
	return &agentpb.HealthResponse{Ok: true}, nil
}

// TestWaitReady: the vsock socket closes connections until the "guest
// agent" comes up, then does the handshake and carries gRPC.
func TestWaitReady(t *testing.T) {
	g := grpc.NewServer()
	h := &healthAgent{}
	agentpb.RegisterAgentServer(g, h)
	defer g.Stop()
	conns := make(chan net.Conn)
	ln := &chanListener{conns: conns, done: make(chan struct{})}
	go g.Serve(ln)

	var up atomic.Bool
	var refused atomic.Int32
	path := fakeUDS(t, func(c net.Conn) {
		if readRequest(c) != "CONNECT 1024\n" || !up.Load() {
			refused.Add(1)
			return
		}
		io.WriteString(c, "OK 99\n")
		// Hand the connection to the gRPC server and keep it open.
		done := make(chan struct{})
		conns <- &notifyConn{Conn: c, closed: done}
		<-done
	})

	ctx, cancel := context.WithTimeout(t.Context(), 300*time.Millisecond)
	_, err := WaitReady(ctx, path, WithRetryInterval(10*time.Millisecond))
	cancel()
	if err == nil || !strings.Contains(err.Error(), "not ready after") || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitReady while down: %v", err)
	}
	if refused.Load() < 2 {
		t.Errorf("only %d attempts", refused.Load())
	}

	time.AfterFunc(100*time.Millisecond, func() { up.Store(true) })
	ctx, cancel = context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	c, err := WaitReady(ctx, path, WithRetryInterval(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if err := c.Health(ctx); err != nil {
		t.Fatal(err)
	}
	if h.calls.Load() < 2 {
		t.Errorf("%d health calls", h.calls.Load())
	}
	if _, err := c.Info(ctx); err == nil {
		t.Error("Info on a health-only agent succeeded")
	}
}

// chanListener is a net.Listener fed by a channel.
type chanListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  atomic.Bool
}

func (l *chanListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *chanListener) Close() error {
	if l.once.CompareAndSwap(false, true) {
		close(l.done)
	}
	return nil
}

func (l *chanListener) Addr() net.Addr { return &net.UnixAddr{Name: "chan", Net: "unix"} }

// notifyConn closes closed when closed.
type notifyConn struct {
	net.Conn
	closed chan struct{}
	once   atomic.Bool
}

func (c *notifyConn) Close() error {
	if c.once.CompareAndSwap(false, true) {
		close(c.closed)
	}
	return c.Conn.Close()
}

func TestExitStatus(t *testing.T) {
	for _, tt := range []struct {
		st      ExitStatus
		shell   int
		success bool
		str     string
	}{
		{ExitStatus{}, 0, true, "exit code 0"},
		{ExitStatus{Code: 3}, 3, false, "exit code 3"},
		{ExitStatus{Code: -1, Signal: 15}, 143, false, "killed by signal 15 (terminated)"},
		{ExitStatus{Code: -1, Signal: 9, TimedOut: true}, 137, false, "killed by signal 9 (killed), timed out"},
		{ExitStatus{Code: -1, Signal: 9, OOMKilled: true}, 137, false, "killed by signal 9 (killed), OOM-killed"},
	} {
		if tt.st.ShellCode() != tt.shell || tt.st.Success() != tt.success || tt.st.String() != tt.str {
			t.Errorf("%+v: shell %d, success %v, %q", tt.st, tt.st.ShellCode(), tt.st.Success(), tt.st.String())
		}
	}
}

func TestFileModes(t *testing.T) {
	for _, tt := range []struct {
		st   uint32
		mode fs.FileMode
	}{
		{0o100644, 0o644},
		{0o040755, fs.ModeDir | 0o755},
		{0o120777, fs.ModeSymlink | 0o777},
		{0o104755, fs.ModeSetuid | 0o755},
		{0o041777, fs.ModeDir | fs.ModeSticky | 0o777},
		{0o020620, fs.ModeDevice | fs.ModeCharDevice | 0o620},
		{0o060660, fs.ModeDevice | 0o660},
		{0o010600, fs.ModeNamedPipe | 0o600},
		{0o140755, fs.ModeSocket | 0o755},
		{0o102755, fs.ModeSetgid | 0o755},
	} {
		if got := FileModeOf(tt.st); got != tt.mode {
			t.Errorf("FileModeOf(%#o) = %v, want %v", tt.st, got, tt.mode)
		}
		if got := unixPerm(tt.mode); got != tt.st&0o7777 {
			t.Errorf("unixPerm(%v) = %#o, want %#o", tt.mode, got, tt.st&0o7777)
		}
	}
	if got := unixPerm(0o4755); got != 0o4755 {
		t.Errorf("unixPerm(0o4755) = %#o", got)
	}
}

func TestStartValidation(t *testing.T) {
	c := &Client{}
	if _, err := c.Start(t.Context(), ExecOptions{}); err == nil {
		t.Error("Start with empty argv succeeded")
	}
}
