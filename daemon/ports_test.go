package daemon_test

import (
	"bytes"
	"io"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// TestForwardPort: a connection carried both ways with a half-close (the
// double's ports are the host's loopback), and what the call refuses: a
// port out of range, an unknown or hibernated sandbox, too much data in
// one request, a port nothing listens on.
func TestForwardPort(t *testing.T) {
	e := newEnv(t, nil)
	sb := e.create(nil)
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { // reads to EOF, then answers and closes
				defer c.Close()
				b, _ := io.ReadAll(c)
				io.WriteString(c, "got "+strings.ToUpper(string(b)))
			}()
		}
	}()
	port := uint32(ln.Addr().(*net.TCPAddr).Port)
	free, _ := net.Listen("tcp4", "127.0.0.1:0")
	freePort := uint32(free.Addr().(*net.TCPAddr).Port)
	free.Close()

	call := func(first *kilnpb.ForwardPortRequest, more ...[]byte) ([]byte, error) {
		t.Helper()
		st, err := e.c.ForwardPort(ctxT(t))
		if err != nil {
			return nil, err
		}
		st.Send(first)
		for _, d := range more {
			st.Send(&kilnpb.ForwardPortRequest{Data: d})
		}
		st.CloseSend()
		var out bytes.Buffer
		for {
			m, err := st.Recv()
			if err == io.EOF {
				return out.Bytes(), nil
			}
			if err != nil {
				return out.Bytes(), err
			}
			out.Write(m.GetData())
		}
	}
	got, err := call(&kilnpb.ForwardPortRequest{SandboxId: sb.Id, Port: port, Data: []byte("hello ")}, []byte("there"))
	if err != nil || string(got) != "got HELLO THERE" {
		t.Errorf("round trip: %q %v", got, err)
	}

	hib := e.create(nil)
	e.hibernate(hib.Id)
	for _, tc := range []struct {
		name string
		req  *kilnpb.ForwardPortRequest
		more [][]byte
		code codes.Code
		msg  string
	}{
		{"port 0", &kilnpb.ForwardPortRequest{SandboxId: sb.Id}, nil, codes.InvalidArgument, "port 0"},
		{"port 65536", &kilnpb.ForwardPortRequest{SandboxId: sb.Id, Port: 65536}, nil, codes.InvalidArgument, "65535"},
		{"unknown sandbox", &kilnpb.ForwardPortRequest{SandboxId: "sb-nope", Port: port}, nil, codes.NotFound, "sb-nope"},
		{"hibernated sandbox", &kilnpb.ForwardPortRequest{SandboxId: hib.Id, Port: port}, nil, codes.FailedPrecondition, "hibernated"},
		{"too much data first", &kilnpb.ForwardPortRequest{SandboxId: sb.Id, Port: port, Data: make([]byte, daemon.MaxForwardData+1)}, nil, codes.InvalidArgument, "at most"},
		{"too much data after", &kilnpb.ForwardPortRequest{SandboxId: sb.Id, Port: port}, [][]byte{make([]byte, daemon.MaxForwardData+1)}, codes.InvalidArgument, "at most"},
		{"nothing listens", &kilnpb.ForwardPortRequest{SandboxId: sb.Id, Port: freePort}, nil, codes.Unavailable, "refused"},
	} {
		_, err := call(tc.req, tc.more...)
		wantCode(t, err, tc.code, tc.msg)
	}
}
