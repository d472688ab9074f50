package envd

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/filesystem/filesystempbconnect"
	processpb "github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/process"
	"github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/process/processpbconnect"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// env is a kilnd (daemon.Server over the daemontest double, on an
// in-memory connection) with envd's Handler in front, served over
// loopback HTTP at /sb/SANDBOX/.
type env struct {
	t    *testing.T
	kiln kilnpb.KilnClient
	h    *Handler
	srv  *httptest.Server
}

func newEnv(t *testing.T, opts ...Option) *env {
	t.Helper()
	be := &daemontest.Backend{}
	t.Cleanup(be.KillAll) // kilnd leaves its sandboxes' processes running
	srv, err := daemon.New(daemon.Config{StateDir: t.TempDir(), Backend: be, HostMemoryMiB: 16384, HostCPUs: 8,
		Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatal(err)
	}
	lis := bufconn.Listen(1 << 20)
	gs := grpc.NewServer()
	srv.Register(gs)
	go gs.Serve(lis)
	conn, err := grpc.NewClient("passthrough:///bufnet",
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return lis.DialContext(ctx) }),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	e := &env{t: t, kiln: kilnpb.NewKilnClient(conn)}
	e.h = New(e.kiln, nil, opts...)
	e.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rest, ok := strings.CutPrefix(r.URL.Path, "/sb/")
		id, p, _ := strings.Cut(rest, "/")
		if !ok {
			http.NotFound(w, r)
			return
		}
		r.URL.Path = "/" + p
		e.h.Serve(w, r, id)
	}))
	t.Cleanup(func() {
		e.srv.Close()
		e.h.Close()
		conn.Close()
		gs.Stop()
		srv.Close(context.Background())
	})
	return e
}

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// sandbox creates a sandbox and returns its ID.
func (e *env) sandbox() string {
	e.t.Helper()
	sb, err := e.kiln.CreateSandbox(ctxT(e.t), &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"},
		RequestId: fmt.Sprintf("envd-test-%d", reqSeq.Add(1))})
	if err != nil {
		e.t.Fatalf("create sandbox: %v", err)
	}
	return sb.GetId()
}

var reqSeq atomic.Int64

func (e *env) url(id string) string { return e.srv.URL + "/sb/" + id }

// codecs are the Connect codecs the SDKs use: JSON (JS) and binary.
var codecs = []struct {
	name string
	opts []connect.ClientOption
}{
	{"json", []connect.ClientOption{connect.WithProtoJSON()}},
	{"binary", nil},
}

func (e *env) process(id string, opts []connect.ClientOption) processpbconnect.ProcessClient {
	return processpbconnect.NewProcessClient(e.srv.Client(), e.url(id), opts...)
}

func (e *env) fs(id string, opts []connect.ClientOption) filesystempbconnect.FilesystemClient {
	return filesystempbconnect.NewFilesystemClient(e.srv.Client(), e.url(id), opts...)
}

// result is what a process stream carried.
type result struct {
	pid                 uint32
	stdout, stderr, pty string
	end                 *processpb.ProcessEvent_EndEvent
	keepalives          int
	err                 error
}

// eventStream is a Start's or Connect's stream, as its events.
type eventStream interface {
	Receive() bool
	Err() error
	Close() error
}

// drain reads s to its end; with wantStart its first event must be start.
func drain(s eventStream, event func() *processpb.ProcessEvent, wantStart ...bool) result {
	var r result
	first := len(wantStart) > 0 && wantStart[0]
	for s.Receive() {
		ev := event()
		if first {
			first = false
			if ev.GetStart() == nil {
				r.err = errors.New("the first event is not start")
				return r
			}
		}
		switch k := ev.GetEvent().(type) {
		case *processpb.ProcessEvent_Start:
			r.pid = k.Start.GetPid()
		case *processpb.ProcessEvent_Data:
			r.stdout += string(k.Data.GetStdout())
			r.stderr += string(k.Data.GetStderr())
			r.pty += string(k.Data.GetPty())
		case *processpb.ProcessEvent_End:
			r.end = k.End
		case *processpb.ProcessEvent_Keepalive:
			r.keepalives++
		}
	}
	r.err = s.Err()
	return r
}

func startReq(script string, mod ...func(*processpb.StartRequest)) *connect.Request[processpb.StartRequest] {
	m := &processpb.StartRequest{Process: &processpb.ProcessConfig{Cmd: "/bin/sh", Args: []string{"-c", script}}}
	for _, f := range mod {
		f(m)
	}
	return connect.NewRequest(m)
}

// run starts a process and follows it to its end.
func run(t *testing.T, c processpbconnect.ProcessClient, req *connect.Request[processpb.StartRequest]) result {
	t.Helper()
	s, err := c.Start(ctxT(t), req)
	if err != nil {
		return result{err: err}
	}
	defer s.Close()
	return drain(s, func() *processpb.ProcessEvent { return s.Msg().GetEvent() }, true)
}

func wantCode(t *testing.T, err error, code connect.Code) {
	t.Helper()
	if connect.CodeOf(err) != code {
		t.Fatalf("got %v, want %v", err, code)
	}
}

func basic(user string) string {
	return "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"))
}

// needs fails a test whose kiln.v1 call kilnd does not implement: every
// call envd makes must be there.
func needs(t *testing.T, err error, what string) {
	t.Helper()
	if status.Code(err) == codes.Unimplemented || connect.CodeOf(err) == connect.CodeUnimplemented {
		t.Fatalf("kilnd does not implement %s: %v", what, err)
	}
}

func readAll(t *testing.T, r io.Reader) string {
	t.Helper()
	b, err := io.ReadAll(r)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
