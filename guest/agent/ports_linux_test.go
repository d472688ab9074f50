package agent_test

import (
	"bufio"
	"context"
	"io"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/agentpb"
)

// servePorts runs agent.ServePorts on a TCP loopback listener, which
// stands for the vsock one, and returns its address, a cancel that stops
// it, and the channel of its return value.
func servePorts(t *testing.T) (addr string, cancel context.CancelFunc, done <-chan error) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	ch := make(chan error, 1)
	go func() {
		ch <- agent.ServePorts(ctx, ln, nil)
		close(ch) // the cleanup's receive, after the test's
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Error("ServePorts did not return within 10 s of its context's end")
		}
	})
	return ln.Addr().String(), cancel, ch
}

// echoOnEOF listens on network's loopback and serves one connection: it
// reads to EOF, then answers "got: " and what it read, and closes.
func echoOnEOF(t *testing.T, network, addr string) (port int, served <-chan string) {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Skipf("listening on %s %s: %v", network, addr, err)
	}
	t.Cleanup(func() { ln.Close() })
	ch := make(chan string, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		b, err := io.ReadAll(c)
		if err != nil {
			ch <- "error: " + err.Error()
			return
		}
		ch <- string(b)
		io.WriteString(c, "got: "+string(b))
	}()
	return ln.Addr().(*net.TCPAddr).Port, ch
}

// request dials the forwarder, writes req and returns the connection and
// its reply line (with its "\n").
func request(t *testing.T, addr, req string) (*net.TCPConn, *bufio.Reader, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, req); err != nil {
		t.Fatal(err)
	}
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		t.Fatalf("reading the reply to %q: %q, %v", req, line, err)
	}
	return c.(*net.TCPConn), br, line
}

// closedPort is a loopback port that nothing listens on (one just
// closed).
func closedPort(t *testing.T) int {
	t.Helper()
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	return port
}

func TestServePortsForwards(t *testing.T) {
	addr, _, _ := servePorts(t)
	tests := []struct {
		name    string
		network string // of the target's listener
		listen  string
	}{
		{"IPv4 loopback", "tcp4", "127.0.0.1:0"},
		{"IPv6 loopback only", "tcp6", "[::1]:0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			port, served := echoOnEOF(t, tt.network, tt.listen)
			// The first bytes of the stream come in the request's write:
			// the agent reads the request byte by byte and loses none.
			c, br, line := request(t, addr, "TCP "+strconv.Itoa(port)+"\nhello, ")
			if line != "OK\n" {
				t.Fatalf("reply %q, want OK", line)
			}
			if _, err := io.WriteString(c, "guest"); err != nil {
				t.Fatal(err)
			}
			// Half-close: the target reads to EOF, then answers.
			if err := c.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			rest, err := io.ReadAll(br)
			if err != nil {
				t.Fatalf("after the half-close: %q, %v", rest, err)
			}
			if got := <-served; got != "hello, guest" {
				t.Errorf("the target read %q, want %q", got, "hello, guest")
			}
			if string(rest) != "got: hello, guest" {
				t.Errorf("the answer %q, want %q then EOF", rest, "got: hello, guest")
			}
		})
	}
}

func TestServePortsRefuses(t *testing.T) {
	addr, _, _ := servePorts(t)
	tests := []struct {
		name string
		req  string // written whole: the agent reads all of it
		want string // in the ERR line
	}{
		{"nothing listens", "TCP " + strconv.Itoa(closedPort(t)) + "\n", "nothing listens"},
		{"empty", "\n", "bad request"},
		{"no port", "TCP\n", "bad request"},
		{"port 0", "TCP 0\n", "bad port"},
		{"port 65536", "TCP 65536\n", "bad port"},
		{"leading zero", "TCP 08\n", "bad port"},
		{"sign", "TCP +80\n", "bad port"},
		{"two spaces", "TCP  80\n", "bad port"},
		{"UDP", "UDP 80\n", "bad request"},
		{"lower case", "tcp 80\n", "bad request"},
		// One byte past the bound and no newline: the agent stops there,
		// having read all of it (unread bytes would make its close a
		// reset, which could overtake the reply).
		{"too long", strings.Repeat("A", agentpb.MaxForwardLine+1), "longer than"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, br, line := request(t, addr, tt.req)
			if !strings.HasPrefix(line, "ERR ") || !strings.Contains(line, tt.want) || len(line) > agentpb.MaxForwardLine {
				t.Errorf("reply %q, want an ERR line naming %q", line, tt.want)
			}
			if rest, err := io.ReadAll(br); err != nil || len(rest) > 0 {
				t.Errorf("after the ERR line: %q, %v; want EOF", rest, err)
			}
		})
	}
}

// TestServePortsStops: ServePorts returns nil once its context ends, and
// ends the connections it forwards.
func TestServePortsStops(t *testing.T) {
	addr, cancel, done := servePorts(t)
	// A target that holds its connection open.
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			defer c.Close()
			io.Copy(io.Discard, c)
		}
	}()
	_, br, line := request(t, addr, "TCP "+strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)+"\n")
	if line != "OK\n" {
		t.Fatalf("reply %q, want OK", line)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("ServePorts returned %v, want nil", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("ServePorts did not return within 10 s of its context's end")
	}
	if _, err := io.ReadAll(br); err != nil && !strings.Contains(err.Error(), "reset") {
		t.Errorf("the forwarded connection after the end: %v, want EOF", err)
	}
	if _, err := net.Dial("tcp", addr); err == nil {
		t.Error("the listener still accepts")
	}
}

func FuzzParseForwardRequest(f *testing.F) {
	for _, s := range []string{"TCP 80", "TCP 65535", "TCP 1", "TCP 0", "TCP 65536", "TCP 08", "TCP 80\r",
		"UDP 80", "", "TCP", "TCP -1", "TCP 1e3", "TCP ٣", strings.Repeat("9", 300)} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		p, err := agent.ParseForwardRequest(s)
		if err != nil {
			// The reason fits a reply line whole.
			if n := len(err.Error()); n > agentpb.MaxForwardLine-len("ERR \n") {
				t.Errorf("error for %q is %d bytes: %v", s, n, err)
			}
			return
		}
		if p < 1 || p > 65535 {
			t.Fatalf("%q: port %d accepted", s, p)
		}
		canon := "TCP " + strconv.Itoa(p)
		if s != canon && s != canon+"\r" {
			t.Errorf("%q accepted as port %d, whose request is %q", s, p, canon)
		}
		if q, err := agent.ParseForwardRequest(canon); err != nil || q != p {
			t.Errorf("%q: %d, %v; want %d", canon, q, err, p)
		}
	})
}
