package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// hostServer is a small kiln.v1 server for these tests: its "sandboxes"
// are host folders, its execs host processes (run in the folder), its
// files paths under the folder. Checkpoints and forks copy no state; they
// keep the tree of IDs that the API promises.
type hostServer struct {
	kilnpb.UnimplementedKilnServer
	root string

	mu        sync.Mutex
	next      int
	sandboxes map[string]*kilnpb.Sandbox
	requests  map[string]string // request ID → sandbox ID
	ckpts     map[string]*kilnpb.CheckpointInfo
	last      map[string]string // sandbox → its last checkpoint
	templates map[string]*kilnpb.Template
}

// serveHost starts a hostServer on a Unix socket in a temporary folder and
// returns the socket's path and the server.
func serveHost(t *testing.T, opts ...grpc.ServerOption) (string, *hostServer) {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "kilnd.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	hs := &hostServer{
		root:      filepath.Join(dir, "sandboxes"),
		sandboxes: map[string]*kilnpb.Sandbox{},
		requests:  map[string]string{},
		ckpts:     map[string]*kilnpb.CheckpointInfo{},
		last:      map[string]string{},
		templates: map[string]*kilnpb.Template{},
	}
	srv := grpc.NewServer(opts...)
	kilnpb.RegisterKilnServer(srv, hs)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return sock, hs
}

// clone copies m, so that a reply is not marshalled while the server
// changes it.
func clone[T proto.Message](m T) T { return proto.Clone(m).(T) }

func (s *hostServer) id(prefix string) string {
	s.next++
	return fmt.Sprintf("%s-%04d", prefix, s.next)
}

func (s *hostServer) newSandbox(labels map[string]string, res *kilnpb.Resources) (*kilnpb.Sandbox, error) {
	id := s.id("sb")
	if err := os.MkdirAll(filepath.Join(s.root, id), 0o755); err != nil {
		return nil, status.Errorf(codes.Internal, "sandbox folder: %v", err)
	}
	sb := &kilnpb.Sandbox{Id: id, State: kilnpb.SandboxState_SANDBOX_STATE_RUNNING, Labels: labels,
		Resources: res, CreatedUnixMs: time.Now().UnixMilli(), Pid: int32(os.Getpid())}
	s.sandboxes[id] = sb
	return sb, nil
}

func (s *hostServer) CreateSandbox(_ context.Context, req *kilnpb.CreateSandboxRequest) (*kilnpb.Sandbox, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if req.GetSource() == nil {
		return nil, status.Error(codes.InvalidArgument, "no source: set image, template or checkpoint")
	}
	if id, ok := s.requests[req.GetRequestId()]; ok && req.GetRequestId() != "" {
		return clone(s.sandboxes[id]), nil
	}
	if t := req.GetTemplate(); t != "" {
		if _, ok := s.templates[t]; !ok {
			return nil, status.Errorf(codes.NotFound, "no template %q", t)
		}
	}
	if c := req.GetCheckpoint(); c != "" {
		if _, ok := s.ckpts[c]; !ok {
			return nil, status.Errorf(codes.NotFound, "no checkpoint %q", c)
		}
	}
	sb, err := s.newSandbox(req.GetLabels(), req.GetResources())
	if err != nil {
		return nil, err
	}
	sb.Image, sb.Template, sb.Checkpoint = req.GetImage(), req.GetTemplate(), req.GetCheckpoint()
	if req.GetRequestId() != "" {
		s.requests[req.GetRequestId()] = sb.Id
	}
	return clone(sb), nil
}

func (s *hostServer) get(id string) (*kilnpb.Sandbox, error) {
	sb, ok := s.sandboxes[id]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no sandbox %q", id)
	}
	return sb, nil
}

func (s *hostServer) live(id string) (*kilnpb.Sandbox, error) {
	sb, err := s.get(id)
	if err == nil && sb.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING {
		err = status.Errorf(codes.FailedPrecondition, "sandbox %s is %s", id, sb.State)
	}
	return sb, err
}

func (s *hostServer) GetSandbox(_ context.Context, req *kilnpb.GetSandboxRequest) (*kilnpb.Sandbox, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, err := s.get(req.GetId())
	if err != nil {
		return nil, err
	}
	return clone(sb), nil
}

func (s *hostServer) ListSandboxes(_ context.Context, req *kilnpb.ListSandboxesRequest) (*kilnpb.ListSandboxesResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []*kilnpb.Sandbox
outer:
	for _, sb := range s.sandboxes {
		for k, v := range req.GetLabels() {
			if sb.Labels[k] != v {
				continue outer
			}
		}
		states := req.GetStates()
		if len(states) == 0 {
			states = []kilnpb.SandboxState{kilnpb.SandboxState_SANDBOX_STATE_RUNNING}
		}
		for _, st := range states {
			if sb.State == st {
				out = append(out, clone(sb))
				continue outer
			}
		}
	}
	return &kilnpb.ListSandboxesResponse{Sandboxes: out}, nil
}

func (s *hostServer) DestroySandbox(_ context.Context, req *kilnpb.DestroySandboxRequest) (*kilnpb.DestroySandboxResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, err := s.live(req.GetId())
	if err != nil {
		return nil, err
	}
	sb.State = kilnpb.SandboxState_SANDBOX_STATE_DESTROYED
	return &kilnpb.DestroySandboxResponse{}, os.RemoveAll(filepath.Join(s.root, sb.Id))
}

// path maps a sandbox path into its folder, refusing one that escapes.
func (s *hostServer) path(id, p string) (string, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.live(id); err != nil {
		return "", err
	}
	if !filepath.IsAbs(p) || strings.Contains(p, "..") {
		return "", status.Errorf(codes.InvalidArgument, "path %q: want an absolute path without ..", p)
	}
	return filepath.Join(s.root, id, p), nil
}

func fileErr(err error) error {
	switch {
	case errors.Is(err, syscall.ENOTEMPTY):
		return status.Error(codes.FailedPrecondition, err.Error())
	case errors.Is(err, os.ErrNotExist):
		return status.Error(codes.NotFound, err.Error())
	case errors.Is(err, os.ErrExist):
		return status.Error(codes.AlreadyExists, err.Error())
	}
	return status.Error(codes.FailedPrecondition, err.Error())
}

func info(p string, fi os.FileInfo) *kilnpb.FileInfo {
	return &kilnpb.FileInfo{Path: p, Name: fi.Name(), Size: fi.Size(), Mode: uint32(fi.Mode().Perm()),
		IsDir: fi.IsDir(), MtimeUnixNanos: fi.ModTime().UnixNano()}
}

func (s *hostServer) Exec(st kilnpb.Kiln_ExecServer) error {
	m, err := st.Recv()
	if err != nil {
		return err
	}
	start := m.GetStart()
	if start == nil {
		return status.Error(codes.InvalidArgument, "the first message must be start")
	}
	dir, err := s.path(start.GetSandboxId(), "/")
	if err != nil {
		return err
	}
	if len(start.GetArgv()) == 0 {
		return status.Error(codes.InvalidArgument, "empty argv")
	}
	ctx := st.Context()
	if ms := start.GetTimeoutMs(); ms > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Duration(ms)*time.Millisecond)
		defer cancel()
	}
	cmd := exec.CommandContext(ctx, start.GetArgv()[0], start.GetArgv()[1:]...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), start.GetEnv()...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	var sendMu sync.Mutex
	send := func(r *kilnpb.ExecResponse) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return st.Send(r)
	}
	cmd.Stdout = writerFunc(func(p []byte) error {
		return send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Stdout{Stdout: append([]byte(nil), p...)}})
	})
	cmd.Stderr = writerFunc(func(p []byte) error {
		return send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Stderr{Stderr: append([]byte(nil), p...)}})
	})
	var stdin io.WriteCloser
	if start.GetHasStdin() {
		if stdin, err = cmd.StdinPipe(); err != nil {
			return err
		}
	}
	if err := cmd.Start(); err != nil {
		return status.Errorf(codes.NotFound, "start %q: %v", start.GetArgv()[0], err)
	}
	if err := send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Started{Started: &kilnpb.ExecStarted{ExecId: "ex-1", Pid: int32(cmd.Process.Pid)}}}); err != nil {
		return err
	}
	go func() {
		for {
			m, err := st.Recv()
			if err != nil {
				return
			}
			switch k := m.Kind.(type) {
			case *kilnpb.ExecRequest_Stdin:
				if stdin != nil {
					stdin.Write(k.Stdin)
				}
			case *kilnpb.ExecRequest_CloseStdin:
				if stdin != nil {
					stdin.Close()
				}
			case *kilnpb.ExecRequest_Signal:
				syscall.Kill(-cmd.Process.Pid, syscall.Signal(k.Signal.GetSignal()))
			}
		}
	}()
	werr := cmd.Wait()
	exit := &kilnpb.ExecExit{ExitCode: int32(cmd.ProcessState.ExitCode())}
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		exit.Signal = int32(ws.Signal())
	}
	exit.TimedOut = errors.Is(ctx.Err(), context.DeadlineExceeded)
	_ = werr
	return send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Exit{Exit: exit}})
}

type writerFunc func([]byte) error

func (f writerFunc) Write(p []byte) (int, error) {
	if err := f(p); err != nil {
		return 0, err
	}
	return len(p), nil
}

func (s *hostServer) WriteFile(st kilnpb.Kiln_WriteFileServer) error {
	m, err := st.Recv()
	if err != nil {
		return err
	}
	h := m.GetHeader()
	if h == nil {
		return status.Error(codes.InvalidArgument, "the first message must be the header")
	}
	p, err := s.path(h.GetSandboxId(), h.GetPath())
	if err != nil {
		return err
	}
	if h.GetMakeParents() {
		os.MkdirAll(filepath.Dir(p), 0o755)
	}
	mode := os.FileMode(h.GetMode())
	if mode == 0 {
		mode = 0o644
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return fileErr(err)
	}
	defer f.Close()
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		if _, err := f.Write(m.GetData()); err != nil {
			return fileErr(err)
		}
	}
	fi, err := f.Stat()
	if err != nil {
		return fileErr(err)
	}
	return st.SendAndClose(info(h.GetPath(), fi))
}

func (s *hostServer) ReadFile(req *kilnpb.ReadFileRequest, st kilnpb.Kiln_ReadFileServer) error {
	p, err := s.path(req.GetSandboxId(), req.GetPath())
	if err != nil {
		return err
	}
	f, err := os.Open(p)
	if err != nil {
		return fileErr(err)
	}
	defer f.Close()
	buf := make([]byte, 1000) // small, so that a file takes several chunks
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if err := st.Send(&kilnpb.FileChunk{Data: buf[:n]}); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fileErr(err)
		}
	}
}

func (s *hostServer) ListDir(_ context.Context, req *kilnpb.ListDirRequest) (*kilnpb.ListDirResponse, error) {
	p, err := s.path(req.GetSandboxId(), req.GetPath())
	if err != nil {
		return nil, err
	}
	ents, err := os.ReadDir(p)
	if err != nil {
		return nil, fileErr(err)
	}
	resp := &kilnpb.ListDirResponse{}
	for _, e := range ents {
		fi, err := e.Info()
		if err != nil {
			return nil, fileErr(err)
		}
		resp.Entries = append(resp.Entries, info(filepath.Join(req.GetPath(), e.Name()), fi))
	}
	return resp, nil
}

func (s *hostServer) Stat(_ context.Context, req *kilnpb.StatRequest) (*kilnpb.FileInfo, error) {
	p, err := s.path(req.GetSandboxId(), req.GetPath())
	if err != nil {
		return nil, err
	}
	stat := os.Stat
	if req.GetNoFollow() {
		stat = os.Lstat
	}
	fi, err := stat(p)
	if err != nil {
		return nil, fileErr(err)
	}
	return info(req.GetPath(), fi), nil
}

func (s *hostServer) Remove(_ context.Context, req *kilnpb.RemoveRequest) (*kilnpb.RemoveResponse, error) {
	p, err := s.path(req.GetSandboxId(), req.GetPath())
	if err != nil {
		return nil, err
	}
	rm := os.Remove
	if req.GetRecursive() {
		rm = os.RemoveAll
	}
	if err := rm(p); err != nil {
		return nil, fileErr(err)
	}
	return &kilnpb.RemoveResponse{}, nil
}

func (s *hostServer) MakeDir(_ context.Context, req *kilnpb.MakeDirRequest) (*kilnpb.FileInfo, error) {
	p, err := s.path(req.GetSandboxId(), req.GetPath())
	if err != nil {
		return nil, err
	}
	mk := os.Mkdir
	if req.GetParents() {
		mk = os.MkdirAll
	}
	if err := mk(p, 0o755); err != nil {
		return nil, fileErr(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		return nil, fileErr(err)
	}
	return info(req.GetPath(), fi), nil
}

func (s *hostServer) Checkpoint(_ context.Context, req *kilnpb.CheckpointRequest) (*kilnpb.CheckpointInfo, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, err := s.live(req.GetSandboxId()); err != nil {
		return nil, err
	}
	ck := &kilnpb.CheckpointInfo{Id: s.id("ck"), SandboxId: req.GetSandboxId(), ParentId: s.last[req.GetSandboxId()],
		Persisted: req.GetPersist(), Keep: req.GetKeep(), CreatedUnixMs: time.Now().UnixMilli()}
	s.ckpts[ck.Id] = ck
	s.last[req.GetSandboxId()] = ck.Id
	return clone(ck), nil
}

func (s *hostServer) Rollback(_ context.Context, req *kilnpb.RollbackRequest) (*kilnpb.Sandbox, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	sb, err := s.live(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	ck, ok := s.ckpts[req.GetCheckpointId()]
	if !ok || ck.SandboxId != sb.Id {
		return nil, status.Errorf(codes.NotFound, "sandbox %s has no checkpoint %q", sb.Id, req.GetCheckpointId())
	}
	sb.Checkpoint = ck.Id
	s.last[sb.Id] = ck.Id
	return clone(sb), nil
}

func (s *hostServer) ListCheckpoints(_ context.Context, req *kilnpb.ListCheckpointsRequest) (*kilnpb.ListCheckpointsResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &kilnpb.ListCheckpointsResponse{}
	for _, ck := range s.ckpts {
		if ck.SandboxId == req.GetSandboxId() {
			resp.Checkpoints = append(resp.Checkpoints, clone(ck))
		}
	}
	return resp, nil
}

func (s *hostServer) Fork(req *kilnpb.ForkRequest, st kilnpb.Kiln_ForkServer) error {
	if req.GetCount() == 0 {
		return status.Error(codes.InvalidArgument, "count 0: fork at least one child")
	}
	s.mu.Lock()
	var err error
	switch {
	case req.GetSandboxId() != "":
		_, err = s.live(req.GetSandboxId())
	case req.GetCheckpointId() != "":
		if _, ok := s.ckpts[req.GetCheckpointId()]; !ok {
			err = status.Errorf(codes.NotFound, "no checkpoint %q", req.GetCheckpointId())
		}
	default:
		err = status.Error(codes.InvalidArgument, "no source: set sandbox_id or checkpoint_id")
	}
	s.mu.Unlock()
	if err != nil {
		return err
	}
	for range req.GetCount() {
		s.mu.Lock()
		sb, err := s.newSandbox(req.GetLabels(), nil)
		if err == nil {
			sb = clone(sb)
		}
		s.mu.Unlock()
		if err != nil {
			return err
		}
		if err := st.Send(sb); err != nil {
			return err
		}
	}
	return nil
}

func (s *hostServer) CreateTemplate(_ context.Context, req *kilnpb.CreateTemplateRequest) (*kilnpb.Template, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if req.GetImage() == "" {
		return nil, status.Error(codes.InvalidArgument, "no image")
	}
	t := &kilnpb.Template{Id: s.id("tp"), Name: req.GetName(), Image: req.GetImage(), Setup: req.GetSetup(),
		Resources: req.GetResources(), PoolSize: req.GetPoolSize(), CreatedUnixMs: time.Now().UnixMilli()}
	s.templates[t.Id] = t
	if t.Name != "" {
		s.templates[t.Name] = t
	}
	return clone(t), nil
}

func (s *hostServer) ListTemplates(context.Context, *kilnpb.ListTemplatesRequest) (*kilnpb.ListTemplatesResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	resp := &kilnpb.ListTemplatesResponse{}
	for k, t := range s.templates {
		if k == t.Id {
			resp.Templates = append(resp.Templates, clone(t))
		}
	}
	return resp, nil
}

func (s *hostServer) DeleteTemplate(_ context.Context, req *kilnpb.DeleteTemplateRequest) (*kilnpb.DeleteTemplateResponse, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	t, ok := s.templates[req.GetId()]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "no template %q", req.GetId())
	}
	delete(s.templates, t.Id)
	delete(s.templates, t.Name)
	return &kilnpb.DeleteTemplateResponse{}, nil
}

func (s *hostServer) WatchEvents(req *kilnpb.WatchEventsRequest, st kilnpb.Kiln_WatchEventsServer) error {
	// One event per live sandbox, then wait for the client to go.
	s.mu.Lock()
	var evs []*kilnpb.Event
	for _, sb := range s.sandboxes {
		evs = append(evs, &kilnpb.Event{Kind: kilnpb.Event_KIND_READY, SandboxId: sb.Id, Sandbox: clone(sb)})
	}
	s.mu.Unlock()
	if err := st.SendHeader(nil); err != nil {
		return err
	}
	for _, ev := range evs {
		if err := st.Send(ev); err != nil {
			return err
		}
	}
	<-st.Context().Done()
	return nil
}
