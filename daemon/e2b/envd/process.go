package envd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	processpb "github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/process"
	"github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/process/processpbconnect"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// processService is process.Process over kiln.v1 execs.
type processService struct{ h *Handler }

var _ processpbconnect.ProcessHandler = (*processService)(nil)

// proc is a process the Handler follows: its output fans out to its
// subscribers (the Start call and Connect calls).
type proc struct {
	sandbox string
	pid     uint32
	execID  string
	tag     string
	cfg     *processpb.ProcessConfig
	pty     bool
	stdin   bool

	// exec is the held Exec stream (stdin, signals, resizes); nil for a
	// process followed through AttachExec. sendMu serializes its Sends.
	sendMu sync.Mutex
	exec   kilnpb.Kiln_ExecClient
	cancel context.CancelFunc

	mu    sync.Mutex
	subs  map[*subscriber]struct{}
	ended bool
	gone  error // why its stream was cut: its sandbox ended
}

// subscriber is one call following a proc. Only the pump sends on ch
// and closes it; err is set before, when the stream broke without an
// exit.
type subscriber struct {
	ch   chan *processpb.ProcessEvent
	gone chan struct{}
	once sync.Once
	err  error
}

var errEnded = errors.New("the process has ended")

func (p *proc) subscribe(max, buf int) (*subscriber, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.ended {
		return nil, errEnded
	}
	if len(p.subs) >= max {
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("process %d already has %d followers", p.pid, max))
	}
	s := &subscriber{ch: make(chan *processpb.ProcessEvent, buf), gone: make(chan struct{})}
	p.subs[s] = struct{}{}
	return s, nil
}

func (p *proc) unsubscribe(s *subscriber) {
	s.once.Do(func() { close(s.gone) })
	p.mu.Lock()
	delete(p.subs, s)
	p.mu.Unlock()
}

// publish hands ev to every subscriber, waiting for a slow one (its
// output waits, as a pipe's would) unless it goes.
func (p *proc) publish(ev *processpb.ProcessEvent) {
	p.mu.Lock()
	subs := make([]*subscriber, 0, len(p.subs))
	for s := range p.subs {
		subs = append(subs, s)
	}
	p.mu.Unlock()
	for _, s := range subs {
		select {
		case s.ch <- ev:
		case <-s.gone:
		}
	}
}

// pump follows the process's kiln.v1 stream to its exit, then drops it
// from the table.
func (h *Handler) pump(p *proc, recv func() (*kilnpb.ExecResponse, error)) {
	defer p.cancel()
	var broke error
	for {
		r, err := recv()
		if err != nil {
			broke = err
			if err == io.EOF {
				broke = errors.New("the process's stream ended before its exit")
			}
			break
		}
		ev := p.event(r)
		if ev == nil {
			continue
		}
		p.publish(ev)
		if ev.GetEnd() != nil {
			break
		}
	}
	h.mu.Lock()
	if s := h.sandboxes[p.sandbox]; s != nil && s.procs[p.pid] == p {
		delete(s.procs, p.pid)
		h.tidyLocked(p.sandbox)
	}
	h.mu.Unlock()
	p.mu.Lock()
	p.ended = true
	if p.gone != nil {
		broke = connect.NewError(connect.CodeUnavailable, p.gone)
	}
	for s := range p.subs {
		s.err = broke
		close(s.ch)
	}
	p.subs = nil
	p.mu.Unlock()
	if broke != nil && codeOf(broke) != codes.Canceled {
		h.log.Debug("lost a process's stream", "sandbox", p.sandbox, "pid", p.pid, "err", broke)
	}
}

// event is r as envd's event; nil for what envd does not send.
func (p *proc) event(r *kilnpb.ExecResponse) *processpb.ProcessEvent {
	switch k := r.GetKind().(type) {
	case *kilnpb.ExecResponse_Stdout:
		d := &processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Stdout{Stdout: k.Stdout}}
		if p.pty {
			d.Output = &processpb.ProcessEvent_DataEvent_Pty{Pty: k.Stdout}
		}
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: d}}
	case *kilnpb.ExecResponse_Stderr:
		d := &processpb.ProcessEvent_DataEvent{Output: &processpb.ProcessEvent_DataEvent_Stderr{Stderr: k.Stderr}}
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: d}}
	case *kilnpb.ExecResponse_Exit:
		return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: endEvent(k.Exit)}}
	}
	return nil
}

// endEvent says how a process ended as envd does (Go's ProcessState).
func endEvent(x *kilnpb.ExecExit) *processpb.ProcessEvent_EndEvent {
	e := &processpb.ProcessEvent_EndEvent{ExitCode: x.GetExitCode(), Exited: x.GetSignal() == 0,
		Status: "exit status " + strconv.Itoa(int(x.GetExitCode()))}
	if sig := x.GetSignal(); sig != 0 {
		e.ExitCode = -1
		e.Status = "signal: " + syscall.Signal(sig).String()
	}
	var msg string
	switch {
	case x.GetTimedOut():
		msg = "the process ran past its timeout and was killed"
	case x.GetOomKilled():
		msg = "the process ran out of memory and was killed"
	}
	if msg != "" {
		e.Error = &msg
	}
	return e
}

// streamSender is a Start or Connect call's stream.
type streamSender func(*processpb.ProcessEvent) error

// follow streams p's events to a call from its start event on, with
// keepalives, until p ends or the call does.
func (h *Handler) follow(ctx context.Context, send streamSender, p *proc, s *subscriber, every time.Duration) error {
	defer p.unsubscribe(s)
	if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Start{Start: &processpb.ProcessEvent_StartEvent{Pid: p.pid}}}); err != nil {
		return err
	}
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case ev, ok := <-s.ch:
			if !ok {
				if s.err != nil {
					return connectErr(fmt.Sprintf("process %d", p.pid), s.err)
				}
				return nil
			}
			if err := send(ev); err != nil {
				return err
			}
		case <-t.C:
			if err := send(&processpb.ProcessEvent{Event: &processpb.ProcessEvent_Keepalive{Keepalive: &processpb.ProcessEvent_KeepAlive{}}}); err != nil {
				return err
			}
		case <-ctx.Done():
			return connectErr(fmt.Sprintf("process %d", p.pid), ctx.Err())
		}
	}
}

// defaultPTY is a terminal's size when a request gives none.
var defaultPTY = &kilnpb.PtySize{Rows: 24, Cols: 80}

// Start runs a process as a background exec, so that it outlives the
// call (a client that goes leaves it running), and follows it; it is
// killed when the call's Connect-Timeout-Ms passes, as envd's are.
func (s *processService) Start(ctx context.Context, req *connect.Request[processpb.StartRequest], stream *connect.ServerStream[processpb.StartResponse]) error {
	h, id := s.h, sandboxOf(ctx)
	user, err := requestUser(req.Header())
	if err != nil {
		return err
	}
	cfg := req.Msg.GetProcess()
	if cfg.GetCmd() == "" {
		return invalid("start: process.cmd is empty")
	}
	// The call's deadline is the process's lifetime, as envd's: the SDK's
	// timeout ends the command, not only the stream that follows it.
	timeoutMs, err := processTimeoutMs(req.Header())
	if err != nil {
		return invalid("start: %v", err)
	}
	st := &kilnpb.ExecStart{SandboxId: id, Argv: append([]string{cfg.GetCmd()}, cfg.GetArgs()...), Env: envList(cfg.GetEnvs()),
		Background: true, User: user, HasStdin: req.Msg.GetStdin(), TimeoutMs: timeoutMs}
	home := h.home(ctx, id, user)
	if cfg.Cwd != nil {
		if st.Cwd, err = resolvePath(cfg.GetCwd(), home); err != nil {
			return invalid("start: cwd: %v", err)
		}
	} else {
		st.Cwd = h.homeIfDir(ctx, id, user, home)
	}
	if req.Msg.Pty != nil {
		st.Pty, st.HasStdin = defaultPTY, true
		if sz := req.Msg.GetPty().GetSize(); sz.GetRows() > 0 && sz.GetCols() > 0 {
			st.Pty = &kilnpb.PtySize{Rows: sz.GetRows(), Cols: sz.GetCols()}
		}
	}
	h.mu.Lock()
	n := len(h.stateLocked(id).procs)
	h.tidyLocked(id)
	h.mu.Unlock()
	if n >= h.limits.ProcessesPerSandbox {
		return connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("sandbox %s already has %d processes followed: wait for some to end", id, n))
	}

	pctx, cancel := context.WithCancel(h.base)
	ex, err := h.kiln.Exec(pctx)
	if err == nil {
		err = ex.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: st}})
	}
	// Output may come before the started response (kilnd sends both as
	// they come): it is kept, bounded, for the Start call.
	var started *kilnpb.ExecStarted
	var early []*kilnpb.ExecResponse
	for err == nil && started == nil {
		var r *kilnpb.ExecResponse
		if r, err = ex.Recv(); err != nil {
			break
		}
		if started = r.GetStarted(); started == nil {
			if len(early) >= h.limits.EventBuffer {
				err = status.Errorf(codes.Internal, "kilnd sent %d responses before the process started", len(early))
				break
			}
			early = append(early, r)
		}
	}
	if err != nil {
		cancel()
		return connectErr("start "+cfg.GetCmd(), err)
	}
	p := &proc{sandbox: id, pid: uint32(started.GetPid()), execID: started.GetExecId(), tag: req.Msg.GetTag(),
		cfg: cfg, pty: st.Pty != nil, stdin: st.HasStdin, exec: ex, cancel: cancel, subs: map[*subscriber]struct{}{}}
	sub, _ := p.subscribe(h.limits.SubscribersPerProcess, h.limits.EventBuffer)
	h.mu.Lock()
	h.stateLocked(id).procs[p.pid] = p
	h.mu.Unlock()
	recv := func() (*kilnpb.ExecResponse, error) {
		if len(early) > 0 {
			r := early[0]
			early = early[1:]
			return r, nil
		}
		return ex.Recv()
	}
	go h.pump(p, recv)
	return h.follow(ctx, func(ev *processpb.ProcessEvent) error {
		return stream.Send(&processpb.StartResponse{Event: ev})
	}, p, sub, keepaliveInterval(req.Header()))
}

// envList is envs as sorted K=V entries.
func envList(envs map[string]string) []string {
	out := make([]string, 0, len(envs))
	for k, v := range envs {
		out = append(out, k+"="+v)
	}
	sort.Strings(out)
	return out
}

// homeIfDir is home when it is a directory of the sandbox, else "" (the
// image's working directory): a process's default cwd, as envd's.
func (h *Handler) homeIfDir(ctx context.Context, id, user, home string) string {
	k := homeKey{id, "\x00cwd:" + user}
	h.mu.Lock()
	dir, ok := h.homes.m[k]
	h.mu.Unlock()
	if ok {
		return dir
	}
	fi, err := h.kiln.Stat(ctx, &kilnpb.StatRequest{SandboxId: id, Path: home})
	if err != nil && codeOf(err) != codes.NotFound {
		return "" // ask again next time
	}
	if err == nil && fi.GetIsDir() {
		dir = home
	}
	h.mu.Lock()
	if len(h.homes.m) >= maxHomes {
		clear(h.homes.m)
	}
	h.homes.m[k] = dir
	h.mu.Unlock()
	return dir
}

// held is the process sel names in id's table, nil when not there.
func (h *Handler) held(id string, sel *processpb.ProcessSelector) *proc {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := h.sandboxes[id]
	if s == nil {
		return nil
	}
	switch k := sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid:
		return s.procs[k.Pid]
	case *processpb.ProcessSelector_Tag:
		for _, p := range s.procs {
			if p.tag == k.Tag {
				return p
			}
		}
	}
	return nil
}

func selectorString(sel *processpb.ProcessSelector) string {
	if t, ok := sel.GetSelector().(*processpb.ProcessSelector_Tag); ok {
		return "process tagged " + strconv.Quote(t.Tag)
	}
	return fmt.Sprintf("process %d", sel.GetPid())
}

func checkSelector(sel *processpb.ProcessSelector) error {
	switch sel.GetSelector().(type) {
	case *processpb.ProcessSelector_Pid, *processpb.ProcessSelector_Tag:
		return nil
	}
	return invalid("process: want a pid or a tag")
}

// findExec is the kiln.v1 exec of pid in sandbox id: a running one, else
// the last exited; nil when none.
func (h *Handler) findExec(ctx context.Context, id string, pid uint32) (*kilnpb.ExecInfo, error) {
	resp, err := h.kiln.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: id})
	if err != nil {
		return nil, connectErr("list the processes", err)
	}
	var found *kilnpb.ExecInfo
	for _, x := range resp.GetExecs() {
		if uint32(x.GetPid()) != pid {
			continue
		}
		if x.GetExit() == nil {
			return x, nil
		}
		if found == nil || x.GetStartedUnixMs() >= found.GetStartedUnixMs() {
			found = x
		}
	}
	return found, nil
}

func notFound(what string) error {
	return connect.NewError(connect.CodeNotFound, errors.New(what+" not found"))
}

// Connect follows a running process's output from now on: a held one's,
// else (started before a restart of kilnd, or a hibernate) its exec's
// through AttachExec.
func (s *processService) Connect(ctx context.Context, req *connect.Request[processpb.ConnectRequest], stream *connect.ServerStream[processpb.ConnectResponse]) error {
	h, id, sel := s.h, sandboxOf(ctx), req.Msg.GetProcess()
	if err := checkSelector(sel); err != nil {
		return err
	}
	send := func(ev *processpb.ProcessEvent) error { return stream.Send(&processpb.ConnectResponse{Event: ev}) }
	every := keepaliveInterval(req.Header())
	if p := h.held(id, sel); p != nil {
		if sub, err := p.subscribe(h.limits.SubscribersPerProcess, h.limits.EventBuffer); err == nil {
			return h.follow(ctx, send, p, sub, every)
		} else if !errors.Is(err, errEnded) {
			return err
		}
	}
	pid, ok := sel.GetSelector().(*processpb.ProcessSelector_Pid)
	if !ok {
		return notFound(selectorString(sel))
	}
	x, err := h.findExec(ctx, id, pid.Pid)
	if err != nil {
		return err
	}
	if x == nil {
		return notFound(selectorString(sel))
	}
	p, sub, err := h.attach(id, x)
	if err != nil {
		return err
	}
	return h.follow(ctx, send, p, sub, every)
}

// attach follows exec x through AttachExec, in the table while it runs.
func (h *Handler) attach(id string, x *kilnpb.ExecInfo) (*proc, *subscriber, error) {
	pid := uint32(x.GetPid())
	argv := x.GetArgv()
	cfg := &processpb.ProcessConfig{}
	if len(argv) > 0 {
		cfg.Cmd, cfg.Args = argv[0], argv[1:]
	}
	pctx, cancel := context.WithCancel(h.base)
	p := &proc{sandbox: id, pid: pid, execID: x.GetExecId(), cfg: cfg, cancel: cancel, subs: map[*subscriber]struct{}{}}
	sub, _ := p.subscribe(h.limits.SubscribersPerProcess, h.limits.EventBuffer)
	if x.GetExit() == nil {
		h.mu.Lock()
		st := h.stateLocked(id)
		if other := st.procs[pid]; other != nil {
			h.mu.Unlock()
			cancel()
			osub, err := other.subscribe(h.limits.SubscribersPerProcess, h.limits.EventBuffer)
			return other, osub, err
		}
		st.procs[pid] = p
		h.mu.Unlock()
	}
	as, err := h.kiln.AttachExec(pctx, &kilnpb.AttachExecRequest{SandboxId: id, ExecId: x.GetExecId()})
	recv := func() (*kilnpb.ExecResponse, error) { return nil, err }
	if err == nil {
		recv = as.Recv
	}
	go h.pump(p, recv)
	return p, sub, nil
}

// List lists the sandbox's running processes: those held with their
// config and tag, the others from their argv.
func (s *processService) List(ctx context.Context, req *connect.Request[processpb.ListRequest]) (*connect.Response[processpb.ListResponse], error) {
	h, id := s.h, sandboxOf(ctx)
	resp, err := h.kiln.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: id})
	if err != nil {
		return nil, connectErr("list the processes", err)
	}
	byExec := map[string]*proc{}
	h.mu.Lock()
	if st := h.sandboxes[id]; st != nil {
		for _, p := range st.procs {
			byExec[p.execID] = p
		}
	}
	h.mu.Unlock()
	out := &processpb.ListResponse{}
	for _, x := range resp.GetExecs() {
		if x.GetExit() != nil {
			continue
		}
		info := &processpb.ProcessInfo{Pid: uint32(x.GetPid()), Config: &processpb.ProcessConfig{}}
		if p := byExec[x.GetExecId()]; p != nil {
			info.Config = p.cfg
			if p.tag != "" {
				info.Tag = &p.tag
			}
		} else if argv := x.GetArgv(); len(argv) > 0 {
			info.Config.Cmd, info.Config.Args = argv[0], argv[1:]
		}
		out.Processes = append(out.Processes, info)
	}
	return connect.NewResponse(out), nil
}

// heldExec is the held process sel names, with its Exec stream: the
// process's input goes there. A process running but not held (started
// before a restart of kilnd) is FailedPrecondition.
func (h *Handler) heldExec(ctx context.Context, id string, sel *processpb.ProcessSelector) (*proc, error) {
	if err := checkSelector(sel); err != nil {
		return nil, err
	}
	if p := h.held(id, sel); p != nil && p.exec != nil {
		return p, nil
	}
	if pid, ok := sel.GetSelector().(*processpb.ProcessSelector_Pid); ok {
		x, err := h.findExec(ctx, id, pid.Pid)
		if err != nil {
			return nil, err
		}
		if x != nil && x.GetExit() == nil {
			return nil, connect.NewError(connect.CodeFailedPrecondition,
				fmt.Errorf("%s: its input is not held here (it was started before kilnd restarted or the sandbox was paused)", selectorString(sel)))
		}
	}
	return nil, notFound(selectorString(sel))
}

// input sends r on p's held Exec stream.
func (p *proc) input(r *kilnpb.ExecRequest) error {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	if err := p.exec.Send(r); err != nil {
		return notFound(fmt.Sprintf("process %d (it has ended)", p.pid))
	}
	return nil
}

// SendInput writes to a process's stdin or terminal.
func (s *processService) SendInput(ctx context.Context, req *connect.Request[processpb.SendInputRequest]) (*connect.Response[processpb.SendInputResponse], error) {
	p, err := s.h.heldExec(ctx, sandboxOf(ctx), req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if err := p.sendInput(req.Msg.GetInput()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.SendInputResponse{}), nil
}

func (p *proc) sendInput(in *processpb.ProcessInput) error {
	if !p.stdin {
		return connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d was started without stdin", p.pid))
	}
	var data []byte
	switch k := in.GetInput().(type) {
	case *processpb.ProcessInput_Stdin:
		data = k.Stdin
	case *processpb.ProcessInput_Pty:
		data = k.Pty
	default:
		return invalid("input: want stdin or pty bytes")
	}
	if len(data) == 0 {
		return nil
	}
	return p.input(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Stdin{Stdin: data}})
}

// StreamInput takes a process's input as a stream: a start event naming
// the process, then data events.
func (s *processService) StreamInput(ctx context.Context, stream *connect.ClientStream[processpb.StreamInputRequest]) (*connect.Response[processpb.StreamInputResponse], error) {
	var p *proc
	for stream.Receive() {
		switch k := stream.Msg().GetEvent().(type) {
		case *processpb.StreamInputRequest_Start:
			if p != nil {
				return nil, invalid("stream input: a second start event")
			}
			var err error
			if p, err = s.h.heldExec(ctx, sandboxOf(ctx), k.Start.GetProcess()); err != nil {
				return nil, err
			}
		case *processpb.StreamInputRequest_Data:
			if p == nil {
				return nil, invalid("stream input: data before the start event")
			}
			if err := p.sendInput(k.Data.GetInput()); err != nil {
				return nil, err
			}
		}
	}
	if err := stream.Err(); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.StreamInputResponse{}), nil
}

// CloseStdin closes a process's stdin (it reads EOF).
func (s *processService) CloseStdin(ctx context.Context, req *connect.Request[processpb.CloseStdinRequest]) (*connect.Response[processpb.CloseStdinResponse], error) {
	p, err := s.h.heldExec(ctx, sandboxOf(ctx), req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if !p.stdin {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d was started without stdin", p.pid))
	}
	if err := p.input(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_CloseStdin{CloseStdin: true}}); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.CloseStdinResponse{}), nil
}

// Update resizes a process's terminal.
func (s *processService) Update(ctx context.Context, req *connect.Request[processpb.UpdateRequest]) (*connect.Response[processpb.UpdateResponse], error) {
	p, err := s.h.heldExec(ctx, sandboxOf(ctx), req.Msg.GetProcess())
	if err != nil {
		return nil, err
	}
	if req.Msg.Pty == nil {
		return connect.NewResponse(&processpb.UpdateResponse{}), nil
	}
	if !p.pty {
		return nil, connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("process %d has no terminal to resize", p.pid))
	}
	sz := req.Msg.GetPty().GetSize()
	if sz.GetRows() == 0 || sz.GetCols() == 0 || sz.GetRows() > 0xffff || sz.GetCols() > 0xffff {
		return nil, invalid("update: pty size %dx%d: want 1 to 65535 columns and rows", sz.GetCols(), sz.GetRows())
	}
	if err := p.input(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Resize{Resize: &kilnpb.PtySize{Rows: sz.GetRows(), Cols: sz.GetCols()}}}); err != nil {
		return nil, err
	}
	return connect.NewResponse(&processpb.UpdateResponse{}), nil
}

// SendSignal signals a process's group (KillExec).
func (s *processService) SendSignal(ctx context.Context, req *connect.Request[processpb.SendSignalRequest]) (*connect.Response[processpb.SendSignalResponse], error) {
	h, id, sel := s.h, sandboxOf(ctx), req.Msg.GetProcess()
	if err := checkSelector(sel); err != nil {
		return nil, err
	}
	sig := int32(req.Msg.GetSignal())
	if sig <= 0 || sig > 64 {
		return nil, invalid("signal %d: want a signal number 1 to 64 (SIGNAL_SIGKILL, SIGNAL_SIGTERM…)", sig)
	}
	var execID string
	if p := h.held(id, sel); p != nil {
		execID = p.execID
	} else if pid, ok := sel.GetSelector().(*processpb.ProcessSelector_Pid); ok {
		x, err := h.findExec(ctx, id, pid.Pid)
		if err != nil {
			return nil, err
		}
		if x != nil && x.GetExit() == nil {
			execID = x.GetExecId()
		}
	}
	if execID == "" {
		return nil, notFound(selectorString(sel))
	}
	_, err := h.kiln.KillExec(ctx, &kilnpb.KillExecRequest{SandboxId: id, ExecId: execID, Signal: sig})
	switch codeOf(err) {
	case codes.OK:
		return connect.NewResponse(&processpb.SendSignalResponse{}), nil
	case codes.FailedPrecondition, codes.NotFound:
		return nil, notFound(selectorString(sel) + " (it has ended)")
	}
	return nil, connectErr("signal "+selectorString(sel), err)
}
