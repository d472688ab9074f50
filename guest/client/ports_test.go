package client

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// fakeAgent plays the agent's forwarder on the far end of a pipe: it
// reads the request line, sends it on got, and runs reply.
func fakeAgent(t *testing.T, reply func(net.Conn)) (net.Conn, <-chan string) {
	t.Helper()
	host, guest := net.Pipe()
	t.Cleanup(func() { host.Close(); guest.Close() })
	got := make(chan string, 1)
	go func() {
		line, _ := readLine(guest)
		got <- line
		reply(guest)
	}()
	return host, got
}

func TestForwardHandshake(t *testing.T) {
	const reason = "nothing listens on port 8080 in the guest (connection refused)"
	// write answers s, then closes (the agent's side ends).
	write := func(s string) func(net.Conn) { return func(c net.Conn) { io.WriteString(c, s); c.Close() } }
	tests := []struct {
		name    string
		reply   func(net.Conn)
		timeout time.Duration // 0: 5 s
		ok      bool          // the handshake succeeds
		after   string        // what the connection carries after OK
		refused bool          // the error is a *PortError
		want    string        // in the error: its reason, if refused
	}{
		// The stream's first bytes come in the reply's write: none is lost.
		{name: "OK", reply: write("OK\nguest says hi"), ok: true, after: "guest says hi"},
		{name: "OK alone", reply: write("OK\n"), ok: true},
		{name: "ERR", reply: write("ERR " + reason + "\n"), refused: true, want: reason},
		{name: "ERR empty reason", reply: write("ERR \n"), refused: true},
		{name: "garbage", reply: write("HTTP/1.1 400 Bad Request\n"), want: `unexpected reply "HTTP/1.1 400 Bad Request"`},
		{name: "vsock reply", reply: write("OK 1025\n"), want: `unexpected reply "OK 1025"`},
		{name: "CRLF", reply: write("OK\r\n"), want: `unexpected reply "OK\r"`},
		{name: "ERR without a space", reply: write("ERR\n"), want: `unexpected reply "ERR"`},
		{name: "too long", reply: write(strings.Repeat("A", 4*agentpb.MaxForwardLine)), want: "reply longer than 256 bytes"},
		{name: "EOF", reply: write(""), want: "the agent closed the connection"},
		{name: "EOF mid-line", reply: write("O"), want: "the agent closed the connection"},
		{name: "silence", reply: func(net.Conn) {}, timeout: 100 * time.Millisecond, want: "i/o timeout"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, got := fakeAgent(t, tt.reply)
			timeout := tt.timeout
			if timeout == 0 {
				timeout = 5 * time.Second
			}
			err := forwardHandshake(t.Context(), c, 8080, timeout)
			if req := <-got; req != "TCP 8080\n" {
				t.Errorf("request %q, want %q", req, "TCP 8080\n")
			}
			var pe *PortError
			switch {
			case tt.ok:
				if err != nil {
					t.Fatal(err)
				}
				c.SetReadDeadline(time.Now().Add(5 * time.Second))
				if b, err := io.ReadAll(c); string(b) != tt.after || err != nil {
					t.Errorf("after OK: %q, %v; want %q then EOF", b, err, tt.after)
				}
			case tt.refused:
				if !errors.As(err, &pe) || pe.Reason != tt.want || pe.Port != 8080 {
					t.Fatalf("error %#v, want a *PortError for port 8080 with reason %q", err, tt.want)
				}
				if !strings.Contains(err.Error(), "port 8080") || !strings.Contains(err.Error(), tt.want) {
					t.Errorf("error %q does not name the port and %q", err, tt.want)
				}
			default:
				if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), "port 8080") {
					t.Fatalf("error %v, want one naming port 8080 and %q", err, tt.want)
				}
				if errors.As(err, &pe) {
					t.Errorf("error %v is a *PortError: not a guest's refusal", err)
				}
			}
		})
	}

	t.Run("cancelled", func(t *testing.T) {
		c, _ := fakeAgent(t, func(net.Conn) {})
		ctx, cancel := context.WithCancel(t.Context())
		time.AfterFunc(100*time.Millisecond, cancel)
		start := time.Now()
		err := forwardHandshake(ctx, c, 8080, time.Minute)
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("error %v, want context.Canceled", err)
		}
		if d := time.Since(start); d > 10*time.Second {
			t.Errorf("the handshake took %v to end", d)
		}
	})

	t.Run("context deadline first", func(t *testing.T) {
		c, _ := fakeAgent(t, func(net.Conn) {})
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		if err := forwardHandshake(ctx, c, 8080, time.Minute); !errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("error %v, want a deadline's", err)
		}
	})
}

// replayConn is a net.Conn that reads a fixed reply and takes any write.
type replayConn struct {
	net.Conn // nil: only what the handshake calls is implemented
	r        io.Reader
	read     int
}

func (c *replayConn) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.read += n
	return n, err
}
func (c *replayConn) Write(p []byte) (int, error)      { return len(p), nil }
func (c *replayConn) SetDeadline(time.Time) error      { return nil }
func (c *replayConn) SetReadDeadline(time.Time) error  { return nil }
func (c *replayConn) SetWriteDeadline(time.Time) error { return nil }

// FuzzReadForwardReply feeds the handshake what a guest might answer: the
// host reads at most one line's bound of it, never panics, and takes it
// for a connection only after "OK\n" and for a refusal only after "ERR ".
func FuzzReadForwardReply(f *testing.F) {
	for _, s := range []string{"OK\n", "OK\nstream", "ERR nothing listens\n", "ERR \n", "", "OK", "OK\r\n",
		"\n", "ERR\n", strings.Repeat("E", 300), "ERR " + strings.Repeat("x", 251) + "\n", "\x00\xff\n"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		c := &replayConn{r: bytes.NewReader(in)}
		line, err := readForwardReply(c)
		if c.read > agentpb.MaxForwardLine+1 {
			t.Fatalf("read %d bytes of a reply, bound %d", c.read, agentpb.MaxForwardLine+1)
		}
		if len(line) > agentpb.MaxForwardLine || strings.Contains(line, "\n") {
			t.Fatalf("line %q: too long or with a newline", line)
		}
		if err == nil && !bytes.HasPrefix(in, []byte(line+"\n")) {
			t.Fatalf("line %q is not the input's first (%q)", line, in)
		}

		c = &replayConn{r: bytes.NewReader(in)}
		err = forwardHandshake(context.Background(), c, 80, time.Second)
		if bytes.HasPrefix(in, []byte("OK\n")) && err != nil {
			t.Fatalf("%q: %v", in, err)
		}
		var pe *PortError
		switch {
		case err == nil:
			if !bytes.HasPrefix(in, []byte("OK\n")) {
				t.Fatalf("%q taken for OK", in)
			}
			if c.read != 3 {
				t.Fatalf("%q: the handshake read %d bytes, want 3", in, c.read)
			}
		case errors.As(err, &pe):
			if !bytes.HasPrefix(in, []byte("ERR ")) || pe.Port != 80 || strings.Contains(pe.Reason, "\n") {
				t.Fatalf("%q taken for a refusal %#v", in, pe)
			}
		}
	})
}

// TestDialPort: DialPort through a stand-in for the VMM's vsock socket
// (the CONNECT handshake) and the agent's forwarder behind it.
func TestDialPort(t *testing.T) {
	tests := []struct {
		name  string
		agent func(t *testing.T, c net.Conn) // after CONNECT's OK
		want  string                         // in the error; "" for none
		port  bool                           // the error is a *PortError
	}{
		{
			name: "stream with half-close",
			agent: func(t *testing.T, c net.Conn) {
				if req, _ := readLine(c); req != "TCP 8080\n" {
					t.Errorf("request %q", req)
					return
				}
				io.WriteString(c, "OK\n")
				// Read to the host's half-close, then answer and close.
				b, _ := io.ReadAll(c)
				io.WriteString(c, "got: "+string(b))
			},
		},
		{
			name: "refused",
			agent: func(t *testing.T, c net.Conn) {
				readLine(c)
				io.WriteString(c, "ERR nothing listens on port 8080 in the guest (connection refused)\n")
			},
			want: "nothing listens", port: true,
		},
		{
			// It reads the request first: a close before then may meet
			// the request's write (a broken pipe).
			name:  "closed without a reply",
			agent: func(t *testing.T, c net.Conn) { readLine(c) },
			want:  "the agent closed the connection",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			connect := make(chan string, 1)
			path := fakeUDS(t, func(c net.Conn) {
				connect <- readRequest(c)
				io.WriteString(c, "OK 1\n")
				tt.agent(t, c)
			})
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			c, err := DialPort(ctx, path, 8080)
			if want := "CONNECT 1025\n"; <-connect != want {
				t.Errorf("the vsock request was not %q", want)
			}
			if tt.want != "" {
				var pe *PortError
				if err == nil || !strings.Contains(err.Error(), tt.want) || errors.As(err, &pe) != tt.port {
					t.Fatalf("error %v, want one naming %q (a *PortError: %v)", err, tt.want, tt.port)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			io.WriteString(c, "hello")
			cw, ok := c.(interface{ CloseWrite() error })
			if !ok {
				t.Fatalf("%T has no CloseWrite", c)
			}
			if err := cw.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			if b, err := io.ReadAll(c); err != nil || string(b) != "got: hello" {
				t.Errorf("answer %q, %v; want %q then EOF", b, err, "got: hello")
			}
		})
	}

	t.Run("bad port", func(t *testing.T) {
		for _, p := range []int{0, -1, 65536} {
			if c, err := DialPort(t.Context(), noSocket(t), p); err == nil || !strings.Contains(err.Error(), "want 1 to 65535") {
				if c != nil {
					c.Close()
				}
				t.Errorf("port %d: %v", p, err)
			}
		}
	})
}

// noSocket is a socket path nothing listens on.
func noSocket(t *testing.T) string { return t.TempDir() + "/none.sock" }
