package client

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// portAPI is a kiln.v1 client whose ForwardPort call is a fakePortStream:
// no daemon, no gRPC connection.
type portAPI struct {
	kilnpb.KilnClient // nil: only ForwardPort is called
	stream            *fakePortStream
}

func (a *portAPI) ForwardPort(ctx context.Context, _ ...grpc.CallOption) (kilnpb.Kiln_ForwardPortClient, error) {
	a.stream.ctx = ctx
	return a.stream, nil
}

// fakePortStream is the client's side of a ForwardPort call: the test
// hands it responses (or the call's end, as Recv would return it) and
// sees what was sent.
type fakePortStream struct {
	grpc.ClientStream // nil: only what portConn calls is implemented
	ctx               context.Context
	recv              chan recvResult

	mu        sync.Mutex
	sent      []*kilnpb.ForwardPortRequest
	closeSend int
}

type recvResult struct {
	m   *kilnpb.ForwardPortResponse
	err error
}

func newFakePortStream() *fakePortStream { return &fakePortStream{recv: make(chan recvResult, 16)} }

// respond queues a response with data (and eof).
func (s *fakePortStream) respond(data string, eof bool) {
	s.recv <- recvResult{m: &kilnpb.ForwardPortResponse{Data: []byte(data), Eof: eof}}
}

func (s *fakePortStream) Recv() (*kilnpb.ForwardPortResponse, error) {
	select {
	case r := <-s.recv:
		return r.m, r.err
	case <-s.ctx.Done():
		return nil, status.FromContextError(s.ctx.Err()).Err()
	}
}

func (s *fakePortStream) Send(m *kilnpb.ForwardPortRequest) error {
	if s.ctx.Err() != nil {
		return io.EOF // as gRPC's: the status comes from Recv
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sent = append(s.sent, &kilnpb.ForwardPortRequest{SandboxId: m.GetSandboxId(), Port: m.GetPort(), Data: bytes.Clone(m.GetData())})
	return nil
}

func (s *fakePortStream) CloseSend() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closeSend++
	return nil
}

func (s *fakePortStream) requests() ([]*kilnpb.ForwardPortRequest, int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]*kilnpb.ForwardPortRequest(nil), s.sent...), s.closeSend
}

// dialFake dials a forwarded connection over a fakePortStream whose first
// response carries first.
func dialFake(t *testing.T, first string) (net.Conn, *fakePortStream) {
	t.Helper()
	s := newFakePortStream()
	s.respond(first, false)
	c, err := DialPort(t.Context(), &portAPI{stream: s}, "sb-1", 8080)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	if reqs, _ := s.requests(); len(reqs) != 1 || reqs[0].GetSandboxId() != "sb-1" || reqs[0].GetPort() != 8080 {
		t.Fatalf("first requests %v, want sb-1's port 8080", reqs)
	}
	return c, s
}

// readIn reads once, within d.
func readIn(t *testing.T, c net.Conn, d time.Duration) (string, error) {
	t.Helper()
	type result struct {
		s   string
		err error
	}
	ch := make(chan result, 1)
	go func() {
		b := make([]byte, 64)
		n, err := c.Read(b)
		ch <- result{string(b[:n]), err}
	}()
	select {
	case r := <-ch:
		return r.s, r.err
	case <-time.After(d):
		t.Fatalf("Read did not return within %v", d)
		return "", nil
	}
}

func TestDialPortRefused(t *testing.T) {
	tests := []struct {
		name string
		port int
		recv error // the first Recv's
		code codes.Code
	}{
		{"nothing listens", 8080, status.Error(codes.Unavailable, "port 8080 of sandbox sb-1: nothing listens"), codes.Unavailable},
		{"no such sandbox", 8080, status.Error(codes.NotFound, "no sandbox sb-1"), codes.NotFound},
		{"port 0", 0, nil, codes.Unknown},
		{"port 65536", 65536, nil, codes.Unknown},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := newFakePortStream()
			if tt.recv != nil {
				s.recv <- recvResult{err: tt.recv}
			}
			c, err := DialPort(t.Context(), &portAPI{stream: s}, "sb-1", tt.port)
			if err == nil {
				c.Close()
				t.Fatal("no error")
			}
			if status.Code(err) != tt.code {
				t.Errorf("error %v: code %v, want %v", err, status.Code(err), tt.code)
			}
		})
	}
}

func TestPortConnRead(t *testing.T) {
	t.Run("data then EOF", func(t *testing.T) {
		c, s := dialFake(t, "first ")
		s.respond("second ", false)
		s.respond("last", true)
		b, err := io.ReadAll(c)
		if err != nil || string(b) != "first second last" {
			t.Fatalf("%q, %v; want %q then EOF", b, err, "first second last")
		}
		if _, err := c.Read(make([]byte, 1)); err != io.EOF {
			t.Errorf("Read after EOF: %v, want io.EOF", err)
		}
		// Half-closed by the guest: writes still go.
		if n, err := c.Write([]byte("more")); n != 4 || err != nil {
			t.Errorf("Write after the guest's EOF: %d, %v", n, err)
		}
	})

	t.Run("the call fails", func(t *testing.T) {
		c, s := dialFake(t, "")
		s.respond("partial", false)
		s.recv <- recvResult{err: status.Error(codes.Unavailable, "the sandbox stopped running")}
		b, err := io.ReadAll(c)
		var e *Error
		if string(b) != "partial" || !errors.As(err, &e) || e.Code != codes.Unavailable {
			t.Fatalf("%q, %v; want the data, then the call's Unavailable", b, err)
		}
	})

	t.Run("deadlines", func(t *testing.T) {
		c, s := dialFake(t, "")
		// A deadline that passes while Read waits.
		c.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
		_, err := readIn(t, c, 5*time.Second)
		var ne net.Error
		if !errors.Is(err, os.ErrDeadlineExceeded) || !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("Read past its deadline: %v, want os.ErrDeadlineExceeded", err)
		}
		// It stays passed until it is moved.
		if _, err := readIn(t, c, 5*time.Second); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("a second Read: %v, want os.ErrDeadlineExceeded", err)
		}
		// Cleared: the connection is intact, and data still comes.
		c.SetReadDeadline(time.Time{})
		s.respond("after", false)
		if got, err := readIn(t, c, 5*time.Second); got != "after" || err != nil {
			t.Fatalf("Read after clearing the deadline: %q, %v", got, err)
		}
		// One in the past, then one in the future: Read waits for data.
		c.SetDeadline(time.Now().Add(-time.Second))
		if _, err := readIn(t, c, 5*time.Second); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("Read past a deadline in the past: %v", err)
		}
		if _, err := c.Write([]byte("x")); !errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("Write past a deadline in the past: %v", err)
		}
		c.SetDeadline(time.Now().Add(time.Hour))
		time.AfterFunc(50*time.Millisecond, func() { s.respond("later", false) })
		if got, err := readIn(t, c, 5*time.Second); got != "later" || err != nil {
			t.Fatalf("Read under a far deadline: %q, %v", got, err)
		}
		// A deadline cleared before it passes does not fire later.
		c.SetReadDeadline(time.Now().Add(30 * time.Millisecond))
		c.SetReadDeadline(time.Time{})
		time.AfterFunc(100*time.Millisecond, func() { s.respond("kept", false) })
		if got, err := readIn(t, c, 5*time.Second); got != "kept" || err != nil {
			t.Fatalf("Read after a cleared deadline's time: %q, %v", got, err)
		}
	})

	t.Run("close", func(t *testing.T) {
		c, s := dialFake(t, "")
		time.AfterFunc(50*time.Millisecond, func() { c.Close() })
		if _, err := readIn(t, c, 5*time.Second); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Read when closed: %v, want net.ErrClosed", err)
		}
		if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
			t.Errorf("Write after Close: %v, want net.ErrClosed", err)
		}
		select {
		case <-s.ctx.Done():
		case <-time.After(5 * time.Second):
			t.Error("Close left the call running")
		}
		if err := c.Close(); err != nil {
			t.Errorf("a second Close: %v", err)
		}
	})
}

// TestPortConnReadAfterClose: every Read after Close is net.ErrClosed, not
// the call's end (Canceled, by Close itself).
func TestPortConnReadAfterClose(t *testing.T) {
	c, s := dialFake(t, "")
	c.Close()
	<-s.ctx.Done()
	time.Sleep(20 * time.Millisecond) // for the receiving goroutine to see the call's end
	for i := range 50 {
		if _, err := c.Read(make([]byte, 1)); !errors.Is(err, net.ErrClosed) {
			t.Fatalf("Read %d after Close: %v, want net.ErrClosed", i, err)
		}
	}
}

func TestPortConnWrite(t *testing.T) {
	c, s := dialFake(t, "")
	big := bytes.Repeat([]byte("0123456789abcdef"), (2*maxForwardWrite+100)/16)
	if n, err := c.Write(big); n != len(big) || err != nil {
		t.Fatalf("Write: %d, %v", n, err)
	}
	cw, ok := c.(interface{ CloseWrite() error })
	if !ok {
		t.Fatalf("%T has no CloseWrite", c)
	}
	for range 2 {
		if err := cw.CloseWrite(); err != nil {
			t.Fatalf("CloseWrite: %v", err)
		}
	}
	if _, err := c.Write([]byte("x")); err == nil {
		t.Error("Write after CloseWrite succeeded")
	}
	reqs, closes := s.requests()
	var got []byte
	for _, r := range reqs[1:] {
		if len(r.GetData()) > maxForwardWrite || r.GetPort() != 0 || r.GetSandboxId() != "" {
			t.Errorf("a data request of %d bytes, port %d, sandbox %q", len(r.GetData()), r.GetPort(), r.GetSandboxId())
		}
		got = append(got, r.GetData()...)
	}
	if !bytes.Equal(got, big) || len(reqs) != 1+3 {
		t.Errorf("sent %d bytes in %d requests; want the %d written, in 3", len(got), len(reqs)-1, len(big))
	}
	if closes != 1 {
		t.Errorf("CloseSend called %d times, want once", closes)
	}
	// The guest's side still comes after the half-close.
	s.respond("answer", true)
	if b, err := io.ReadAll(c); string(b) != "answer" || err != nil {
		t.Errorf("after CloseWrite: %q, %v", b, err)
	}
	if got, want := c.RemoteAddr().String(), "sb-1:8080"; got != want {
		t.Errorf("RemoteAddr %q, want %q", got, want)
	}
}
