package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

func TestParsePortSpec(t *testing.T) {
	tests := []struct {
		in   string
		want portSpec
		err  string // in the error; "" for none
	}{
		{in: "8080", want: portSpec{"127.0.0.1", 8080, 8080}},
		{in: "8080:80", want: portSpec{"127.0.0.1", 8080, 80}},
		{in: "0:80", want: portSpec{"127.0.0.1", 0, 80}},
		{in: ":80", want: portSpec{"127.0.0.1", 0, 80}},
		{in: "65535:1", want: portSpec{"127.0.0.1", 65535, 1}},
		{in: "0.0.0.0:8080:80", want: portSpec{"0.0.0.0", 8080, 80}},
		{in: "localhost:8080:80", want: portSpec{"localhost", 8080, 80}},
		{in: "[::1]:8080:80", want: portSpec{"::1", 8080, 80}},
		{in: "[::]:0:443", want: portSpec{"::", 0, 443}},
		{in: "127.0.0.1::80", want: portSpec{"127.0.0.1", 0, 80}},
		{in: "", err: "the sandbox's port"},
		{in: "0", err: "the sandbox's port \"0\""},
		{in: "8080:0", err: "the sandbox's port \"0\""},
		{in: "8080:", err: "the sandbox's port \"\""},
		{in: "65536", err: "not 1 to 65535"},
		{in: "65536:80", err: "the local port \"65536\""},
		{in: "-1:80", err: "the local port"},
		{in: "+80", err: "the sandbox's port"},
		{in: "http", err: "the sandbox's port"},
		{in: "080x", err: "the sandbox's port"},
		{in: " 80", err: "the sandbox's port"},
		{in: "99999999999999999999", err: "the sandbox's port"},
		{in: "::1:8080:80", err: "in brackets"},
		{in: "[127.0.0.1]:8080:80", err: "only an IPv6 address"},
		{in: "[localhost]:8080:80", err: "only an IPv6 address"},
		{in: ":8080:80", err: "the address \"\""},
		{in: "[]:8080:80", err: "in brackets"},
		{in: "[:8080:80", err: "in brackets"},
		{in: "a b:8080:80", err: "not a host name or IP address"},
		{in: "a/b:8080:80", err: "not a host name or IP address"},
		{in: "[fe80::1%eth0]:8080:80", want: portSpec{"fe80::1%eth0", 8080, 80}},
		{in: "[[:]::1", err: "only an IPv6 address goes in brackets"},
		{in: "[::ffff:1.2.3.4]:1:2", want: portSpec{"::ffff:1.2.3.4", 1, 2}},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got, err := parsePortSpec(tt.in)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) || !strings.Contains(err.Error(), "[ADDR:]LOCALPORT:PORT") {
					t.Fatalf("%+v, %v; want an error naming %q and the form", got, err, tt.err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Fatalf("%+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

func FuzzParsePortSpec(f *testing.F) {
	for _, s := range []string{"80", "8080:80", ":80", "[::1]:0:80", "0.0.0.0:1:65535", "::1:80", "[x]:1:2", "1:2:3:4", "[[:]::1"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		spec, err := parsePortSpec(s)
		if err != nil {
			return
		}
		if spec.port < 1 || spec.port > 65535 || spec.localPort < 0 || spec.localPort > 65535 || spec.addr == "" {
			t.Fatalf("%q: %+v", s, spec)
		}
		// What it listens on splits back into the address and port.
		host, port, err := net.SplitHostPort(spec.listenAddr())
		if err != nil || host != spec.addr || port != strconv.Itoa(spec.localPort) {
			t.Fatalf("%q: listens on %q (%q, %q, %v)", s, spec.listenAddr(), host, port, err)
		}
	})
}

func TestPortForwardUsage(t *testing.T) {
	t.Setenv("KILN_HOST", "unix:"+t.TempDir()+"/none.sock")
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"sandbox", "port-forward"}, "requires at least 2 arg"},
		{[]string{"sandbox", "port-forward", "id"}, "requires at least 2 arg"},
		{[]string{"sandbox", "port-forward", "id", "8080:0"}, "sandbox port-forward: port \"8080:0\""},
		{[]string{"sandbox", "port-forward", "id", "80", "x:y"}, "port \"x:y\""},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			code, out, errOut := kilnIn(t, "", tt.args...)
			if code != exitUsage || out != "" || !strings.Contains(errOut, tt.want) {
				t.Errorf("exit %d, stdout %q, stderr %q; want exit %d and %q", code, out, errOut, exitUsage, tt.want)
			}
		})
	}
}

// answerOnEOF serves connections on a loopback port: each is read to
// EOF, then answered "got: " and what was read, and closed.
func answerOnEOF(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(20 * time.Second))
				b, _ := io.ReadAll(c)
				io.WriteString(c, "got: "+string(b))
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).Port
}

// closedLoopbackPort is a port that nothing listens on (one just closed).
func closedLoopbackPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

// roundTrip writes req through addr, half-closes, and reads the answer
// to EOF.
func roundTrip(t *testing.T, addr, req string) (string, error) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		return "", err
	}
	if err := c.(*net.TCPConn).CloseWrite(); err != nil {
		return "", err
	}
	b, err := io.ReadAll(c)
	return string(b), err
}

// reported collects what a forwarder reports.
type reported struct {
	mu   sync.Mutex
	errs []error
	ch   chan struct{}
}

func newReported() *reported { return &reported{ch: make(chan struct{}, 16)} }

func (r *reported) report(err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
	select {
	case r.ch <- struct{}{}:
	default:
	}
}

func (r *reported) wait(t *testing.T, n int) []error {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for {
		r.mu.Lock()
		errs := append([]error(nil), r.errs...)
		r.mu.Unlock()
		if len(errs) >= n {
			return errs
		}
		select {
		case <-r.ch:
		case <-deadline:
			t.Fatalf("%d errors reported in 20 s (%v), want %d", len(errs), errs, n)
		}
	}
}

// TestForwardPorts: the forwarder without kilnd: dial reaches loopback
// ports of this host.
func TestForwardPorts(t *testing.T) {
	answer := answerOnEOF(t)
	closed := closedLoopbackPort(t)
	// reset accepts and resets: the remote side fails mid-connection.
	resetLn, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer resetLn.Close()
	go func() {
		for {
			c, err := resetLn.Accept()
			if err != nil {
				return
			}
			c.(*net.TCPConn).SetLinger(0)
			time.Sleep(50 * time.Millisecond)
			c.Close()
		}
	}()

	var target sync.Map // local port → remote address
	dial := func(ctx context.Context, local string) (net.Conn, error) {
		v, _ := target.Load(local)
		var d net.Dialer
		return d.DialContext(ctx, "tcp4", v.(string))
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	rep := newReported()
	var ended []chan error // forwardPorts's returns
	listen := func(remotePort int) string {
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().String()
		target.Store(addr, "127.0.0.1:"+strconv.Itoa(remotePort))
		done := make(chan error, 1)
		ended = append(ended, done)
		go func() {
			done <- forwardPorts(ctx, ln, func(ctx context.Context) (net.Conn, error) { return dial(ctx, addr) }, rep.report)
		}()
		return addr
	}
	toAnswer, toClosed, toReset := listen(answer), listen(closed), listen(resetLn.Addr().(*net.TCPAddr).Port)

	// Half-closes both ways: the target reads to EOF before it answers.
	for i := range 3 {
		req := strings.Repeat(fmt.Sprintf("request %d ", i), 10000)
		if got, err := roundTrip(t, toAnswer, req); err != nil || got != "got: "+req {
			t.Fatalf("round trip %d: %d bytes, %v; want %d", i, len(got), err, len("got: "+req))
		}
	}

	// A refused dial is reported; the forwarder goes on.
	if got, err := roundTrip(t, toClosed, "x"); got != "" {
		t.Errorf("through a refused dial: %q, %v; want nothing", got, err)
	}
	errs := rep.wait(t, 1)
	if !errors.Is(errs[0], syscall.ECONNREFUSED) {
		t.Errorf("reported %v, want the refused dial", errs[0])
	}
	// A remote side that fails is reported too.
	c, err := net.Dial("tcp", toReset)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	errs = rep.wait(t, 2)
	if !errors.Is(errs[1], syscall.ECONNRESET) {
		t.Errorf("reported %v, want the remote side's reset", errs[1])
	}
	if got, err := roundTrip(t, toAnswer, "again"); err != nil || got != "got: again" {
		t.Fatalf("after the failures: %q, %v", got, err)
	}

	// The context's end ends the connections open, and the listeners.
	open, err := net.Dial("tcp", toAnswer)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Close()
	io.WriteString(open, "never finished")
	time.Sleep(50 * time.Millisecond)
	cancel()
	open.SetDeadline(time.Now().Add(20 * time.Second))
	if _, err := io.ReadAll(open); err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("an open connection after the end: %v, want EOF", err)
	}
	for _, done := range ended {
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("forwardPorts returned %v, want nil", err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("forwardPorts did not return within 20 s of its context's end")
		}
	}
	if c, err := net.Dial("tcp", toAnswer); err == nil {
		c.Close()
		t.Error("the listener still accepts after the end")
	}
	if errs := rep.wait(t, 2); len(errs) != 2 {
		t.Errorf("reported %v; want the two failures only", errs)
	}
}

var forwardingLine = regexp.MustCompile(`(?m)^forwarding (127\.0\.0\.1:\d+) -> (\S+):(\d+)$`)

// TestSandboxPortForward: kiln sandbox port-forward through kilnd, over
// the test backend, whose sandboxes' ports are this host's loopback.
func TestSandboxPortForward(t *testing.T) {
	startKilnd(t)
	code, out, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox")
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	id := oneID(t, "create", out)
	if code, _, errOut := kilnIn(t, "", "sandbox", "port-forward", "no-such-sandbox", "80"); code != exitFailed || !strings.Contains(errOut, "NotFound") {
		t.Errorf("an unknown sandbox: exit %d, %q; want 1 and NotFound", code, errOut)
	}

	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s", r.URL.Path)
	}))
	defer srv.Close()
	httpPort := srv.Listener.Addr().(*net.TCPAddr).Port
	answer, closed := answerOnEOF(t), closedLoopbackPort(t)

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	stdout, stderr, done := kilnAsync(ctx, &cli{}, "sandbox", "port-forward", id,
		"0:"+strconv.Itoa(httpPort), ":"+strconv.Itoa(closed), "127.0.0.1:0:"+strconv.Itoa(answer))
	stdout.waitFor(t, id+":"+strconv.Itoa(answer)+"\n", done)
	local := map[int]string{} // the sandbox's port → where it is forwarded from
	for _, m := range forwardingLine.FindAllStringSubmatch(stdout.String(), -1) {
		if m[2] != id {
			t.Errorf("forwarding line names %q, want %q", m[2], id)
		}
		p, _ := strconv.Atoi(m[3])
		local[p] = m[1]
	}
	if len(local) != 3 || strings.Count(stdout.String(), "\n") != 3 {
		t.Fatalf("stdout %q; want a forwarding line for each of the three ports", stdout.String())
	}

	hc := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: 20 * time.Second}
	get := func() {
		t.Helper()
		resp, err := hc.Get("http://" + local[httpPort] + "/through")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		if err != nil || string(b) != "hello from /through" {
			t.Fatalf("GET: %q, %v", b, err)
		}
	}
	get()
	if got, err := roundTrip(t, local[answer], "half-closed"); err != nil || got != "got: half-closed" {
		t.Errorf("through the half-close: %q, %v", got, err)
	}

	// Nothing listens on closed: reported, and the forwarder goes on.
	if got, _ := roundTrip(t, local[closed], "x"); got != "" {
		t.Errorf("through a refused port: %q; want nothing", got)
	}
	stderr.waitFor(t, "Unavailable", done)
	t.Logf("reported: %s", stderr)
	if !strings.Contains(stderr.String(), "port "+strconv.Itoa(closed)) {
		t.Errorf("stderr %q does not name the port", stderr.String())
	}
	get()

	cancel()
	if code := waitExit(t, done); code != 0 {
		t.Errorf("exit %d after the context's end, want 0; stderr %q", code, stderr.String())
	}
	for _, addr := range local {
		if c, err := net.Dial("tcp", addr); err == nil {
			c.Close()
			t.Errorf("%s still accepts after the end", addr)
		}
	}
}
