package agent

import (
	"cmp"
	"context"
	"errors"
	"log/slog"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// detachedTable holds the detached processes (ExecStart.detach_id) by ID:
// at most max of them, running, starting or exited.
type detachedTable struct {
	max   int
	mu    sync.Mutex
	seq   uint64
	procs map[string]*detachedProc
}

func newDetachedTable(max int) *detachedTable {
	return &detachedTable{max: max, procs: map[string]*detachedProc{}}
}

// detachedProc is one detached process. Until ready it is only a claim on
// its ID (its spawn is under way) and nothing but its Exec call sees it.
type detachedProc struct {
	id   string
	seq  uint64
	argv []string

	// Set before ready (under the table's lock), then fixed.
	ready   bool
	p       *process
	started time.Time

	// attachMu guards stream, the Exec call output goes to; nil once
	// that call is over. Sends happen under it, so none comes after the
	// call ended. It guards attachers too (AttachDetached calls).
	attachMu  sync.Mutex
	stream    agentpb.Agent_ExecServer
	attachers map[*attacher]struct{}

	stdout, stderr tailBuffer
	// drainUntil is set (unix nanos) once the process exited, as
	// execution.drainUntil.
	drainUntil atomic.Int64

	done chan struct{} // closed once exited and its output read
	exit *agentpb.ExecExit
}

// checkDetachedID checks an ID of a detached process.
func checkDetachedID(id string) error {
	if id == "" || len(id) > agentpb.MaxDetachedIDLen {
		return invalidf("detached process ID %s: want 1 to %d bytes, got %d", quoteShort(id), agentpb.MaxDetachedIDLen, len(id))
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-' || c == ':') {
			return invalidf("detached process ID %s: byte %d (%q) is not one of A-Z a-z 0-9 . _ - :", quoteShort(id), i, c)
		}
	}
	return nil
}

// claim reserves id for a process about to start, making room by
// forgetting the oldest exited process when the table is full.
func (t *detachedTable) claim(id string, argv []string) (*detachedProc, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.procs[id]; ok {
		return nil, status.Errorf(codes.AlreadyExists, "exec: a detached process with ID %q exists (forget it first)", id)
	}
	if len(t.procs) >= t.max {
		var oldest *detachedProc
		for _, d := range t.procs {
			if d.exited() && (oldest == nil || d.seq < oldest.seq) {
				oldest = d
			}
		}
		if oldest == nil {
			return nil, status.Errorf(codes.ResourceExhausted, "exec: %d detached processes run, the most the agent keeps", len(t.procs))
		}
		delete(t.procs, oldest.id)
	}
	t.seq++
	d := &detachedProc{id: id, seq: t.seq, argv: slices.Clone(argv), done: make(chan struct{})}
	t.procs[id] = d
	return d, nil
}

// unclaim drops the claim d of a process that failed to start.
func (t *detachedTable) unclaim(d *detachedProc) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.procs[d.id] == d {
		delete(t.procs, d.id)
	}
}

// publish makes d, now started as p, visible to the table's readers.
func (t *detachedTable) publish(d *detachedProc, p *process) {
	t.mu.Lock()
	defer t.mu.Unlock()
	d.p, d.started, d.ready = p, time.Now(), true
}

// get returns the started process id.
func (t *detachedTable) get(id string) (*detachedProc, error) {
	if err := checkDetachedID(id); err != nil {
		return nil, err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	d := t.procs[id]
	if d == nil || !d.ready {
		return nil, status.Errorf(codes.NotFound, "no detached process %q", id)
	}
	return d, nil
}

// list returns the started processes, oldest first.
func (t *detachedTable) list() []*detachedProc {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*detachedProc, 0, len(t.procs))
	for _, d := range t.procs {
		if d.ready {
			out = append(out, d)
		}
	}
	slices.SortFunc(out, func(a, b *detachedProc) int { return cmp.Compare(a.seq, b.seq) })
	return out
}

// forget drops the exited process id.
func (t *detachedTable) forget(id string) error {
	if err := checkDetachedID(id); err != nil {
		return err
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	d := t.procs[id]
	if d == nil || !d.ready {
		return status.Errorf(codes.NotFound, "no detached process %q", id)
	}
	if !d.exited() {
		return status.Errorf(codes.FailedPrecondition, "detached process %q (pid %d) still runs: signal it first", id, d.p.child.Pid())
	}
	delete(t.procs, id)
	return nil
}

func (d *detachedProc) exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// info describes d; tails adds the tails of its output.
func (d *detachedProc) info(tails bool) *agentpb.DetachedProcess {
	out := &agentpb.DetachedProcess{
		Id:               d.id,
		Pid:              int32(d.p.child.Pid()),
		Argv:             d.argv,
		StartedUnixNanos: d.started.UnixNano(),
	}
	if d.exited() {
		out.Exit = d.exit
	}
	if tails {
		out.StdoutTail, out.StderrTail = d.stdout.bytes(), d.stderr.bytes()
	}
	return out
}

// send sends r to the Exec call while it lasts; false once it is over.
func (d *detachedProc) send(r *agentpb.ExecResponse) bool {
	d.attachMu.Lock()
	defer d.attachMu.Unlock()
	if d.stream == nil {
		return false
	}
	if err := d.stream.Send(r); err != nil {
		d.stream = nil
		return false
	}
	return true
}

// detach lets go of the Exec call: output goes only to the tails now.
func (d *detachedProc) detach() {
	d.attachMu.Lock()
	d.stream = nil
	d.attachMu.Unlock()
}

// execDetached runs spec as the detached process id for an Exec call: the
// call streams its output and takes its stdin and signals while it lasts;
// the process and its timeout run on without it.
func (s *Server) execDetached(stream agentpb.Agent_ExecServer, id string, spec *execSpec) error {
	ctx := stream.Context()
	if err := checkDetachedID(id); err != nil {
		return err
	}
	d, err := s.detached.claim(id, spec.argv)
	if err != nil {
		return err
	}
	p, err := s.spawn(spec)
	if err != nil {
		s.detached.unclaim(d)
		s.log.Info("exec failed", "argv0", spec.argv[0], "detached", id, "err", err)
		return err
	}
	s.detached.publish(d, p)
	log := s.log.With("pid", p.child.Pid(), "detached", id)
	log.Debug("detached exec started", "path", spec.path, "argc", len(spec.argv), "dir", spec.dir)

	// Started goes first: no output is read before it is sent.
	d.stream = stream
	d.send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Started{Started: &agentpb.ExecStarted{Pid: int32(p.child.Pid())}}})
	go s.superviseDetached(d, spec, log)
	e := &execution{s: s, stream: stream, p: p}
	go e.pumpRequests()
	select {
	case <-d.done:
		d.attachMu.Lock()
		defer d.attachMu.Unlock()
		if d.stream == nil {
			return status.Error(codes.Canceled, "exec: the call ended")
		}
		d.stream = nil
		return stream.Send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Exit{Exit: d.exit}})
	case <-ctx.Done():
		d.detach()
		log.Debug("detached exec runs on without its call")
		return status.FromContextError(ctx.Err()).Err()
	}
}

// superviseDetached reads d's output, enforces its timeout and records
// its exit; it returns once the process exited and its output was read.
func (s *Server) superviseDetached(d *detachedProc, spec *execSpec, log *slog.Logger) {
	p := d.p
	var output sync.WaitGroup
	output.Go(func() {
		d.copyOutput(s, p.stdout, &d.stdout, func(b []byte) *agentpb.ExecResponse {
			return &agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Stdout{Stdout: b}}
		})
	})
	if p.stderr != nil {
		output.Go(func() {
			d.copyOutput(s, p.stderr, &d.stderr, func(b []byte) *agentpb.ExecResponse {
				return &agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Stderr{Stderr: b}}
			})
		})
	}

	timedOut := false
	if spec.timeout > 0 {
		t := time.NewTimer(spec.timeout)
		select {
		case <-p.child.Done():
		case <-t.C:
			timedOut = true
			if p.cg != nil {
				p.cg.kill()
			}
			p.child.SignalGroup(syscall.SIGKILL)
			p.child.Signal(syscall.SIGKILL)
		}
		t.Stop()
	}
	ws, werr := p.child.Status()
	if timedOut {
		p.killStragglers(log)
	}

	now := time.Now()
	until := now.Add(s.cfg.MaxOutputDrain)
	d.drainUntil.Store(until.UnixNano())
	deadline := time.Unix(0, min(now.Add(s.cfg.OutputGrace).UnixNano(), until.UnixNano()))
	p.setReadDeadline(deadline)
	output.Wait()

	var exit *agentpb.ExecExit
	if werr != nil {
		// The reaper stopped: the agent is going down with its guest.
		log.Warn("detached exec: its status is lost", "err", werr)
		exit = &agentpb.ExecExit{ExitCode: -1, Signal: int32(syscall.SIGKILL)}
	} else {
		exit = exitOf(ws)
	}
	exit.TimedOut = timedOut
	if p.cg != nil {
		exit.OomKilled = p.cg.oomKilled()
	}
	p.release(s)
	d.exit = exit
	close(d.done)
	log.Debug("detached exec done", "exit_code", exit.ExitCode, "signal", exit.Signal, "timed_out", exit.TimedOut, "oom_killed", exit.OomKilled)
}

// copyOutput keeps the tail of what f delivers and sends it to the Exec
// call while that lasts. It reads on after the call, so that the process
// never blocks on a full pipe.
func (d *detachedProc) copyOutput(s *Server, f *os.File, tail *tailBuffer, wrap func([]byte) *agentpb.ExecResponse) {
	buf := make([]byte, outputChunk)
	sink := func(b []byte) bool {
		tail.write(b)
		d.send(wrap(b))
		d.fanOut(wrap, b)
		return true
	}
	for {
		n, err := f.Read(buf)
		if n > 0 {
			sink(buf[:n])
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			drainPipe(f, buf, d.drainUntil.Load(), sink)
			return
		}
		if err != nil {
			return // EOF
		}
		if until := d.drainUntil.Load(); until != 0 {
			f.SetReadDeadline(time.Unix(0, min(time.Now().Add(s.cfg.OutputGrace).UnixNano(), until)))
		}
	}
}

// attachQueue is how many output chunks (of at most outputChunk bytes)
// an attacher may fall behind before it is dropped.
const attachQueue = 32

// attacher is one AttachDetached call's queue of output.
type attacher struct {
	ch      chan *agentpb.ExecResponse
	dropped chan struct{} // closed when it fell behind
}

// attach adds an attacher; at most agentpb.MaxAttachers at once.
func (d *detachedProc) attach() (*attacher, error) {
	d.attachMu.Lock()
	defer d.attachMu.Unlock()
	if len(d.attachers) >= agentpb.MaxAttachers {
		return nil, status.Errorf(codes.ResourceExhausted, "attach to detached process %q: %d attached already, the most", d.id, len(d.attachers))
	}
	if d.attachers == nil {
		d.attachers = map[*attacher]struct{}{}
	}
	a := &attacher{ch: make(chan *agentpb.ExecResponse, attachQueue), dropped: make(chan struct{})}
	d.attachers[a] = struct{}{}
	return a, nil
}

func (d *detachedProc) unattach(a *attacher) {
	d.attachMu.Lock()
	delete(d.attachers, a)
	d.attachMu.Unlock()
}

// fanOut queues a copy of b for every attacher, dropping those whose
// queue is full: they never hold the process back.
func (d *detachedProc) fanOut(wrap func([]byte) *agentpb.ExecResponse, b []byte) {
	d.attachMu.Lock()
	defer d.attachMu.Unlock()
	for a := range d.attachers {
		select {
		case a.ch <- wrap(slices.Clone(b)):
		default:
			close(a.dropped)
			delete(d.attachers, a)
		}
	}
}

// AttachDetached streams a detached process's output from now on, then
// its exit.
func (s *Server) AttachDetached(req *agentpb.AttachDetachedRequest, stream agentpb.Agent_AttachDetachedServer) error {
	d, err := s.detached.get(req.GetId())
	if err != nil {
		return err
	}
	exit := func() error {
		return stream.Send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Exit{Exit: d.exit}})
	}
	if d.exited() {
		return exit()
	}
	a, err := d.attach()
	if err != nil {
		return err
	}
	defer d.unattach(a)
	for {
		select {
		case r := <-a.ch:
			if err := stream.Send(r); err != nil {
				return err
			}
		case <-a.dropped:
			return status.Errorf(codes.ResourceExhausted, "attach to detached process %q: the call fell %d chunks behind its output", d.id, attachQueue)
		case <-d.done:
			// Its output was all queued before it was done.
			for {
				select {
				case r := <-a.ch:
					if err := stream.Send(r); err != nil {
						return err
					}
				default:
					return exit()
				}
			}
		case <-stream.Context().Done():
			return status.FromContextError(stream.Context().Err()).Err()
		}
	}
}

// tailBuffer keeps the last agentpb.DetachedTailSize bytes written to it.
type tailBuffer struct {
	mu sync.Mutex
	b  []byte
}

func (t *tailBuffer) write(p []byte) {
	const max = agentpb.DetachedTailSize
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(p) >= max {
		t.b = append(t.b[:0], p[len(p)-max:]...)
		return
	}
	if over := len(t.b) + len(p) - max; over > 0 {
		t.b = append(t.b[:0], t.b[over:]...)
	}
	t.b = append(t.b, p...)
}

func (t *tailBuffer) bytes() []byte {
	t.mu.Lock()
	defer t.mu.Unlock()
	return slices.Clone(t.b)
}

// ListDetached lists the detached processes; see agentpb.AgentServer.
func (s *Server) ListDetached(context.Context, *agentpb.ListDetachedRequest) (*agentpb.ListDetachedResponse, error) {
	ds := s.detached.list()
	resp := &agentpb.ListDetachedResponse{Processes: make([]*agentpb.DetachedProcess, len(ds))}
	for i, d := range ds {
		resp.Processes[i] = d.info(false)
	}
	return resp, nil
}

// SignalDetached signals a detached process or its group.
func (s *Server) SignalDetached(_ context.Context, req *agentpb.SignalDetachedRequest) (*agentpb.SignalDetachedResponse, error) {
	d, err := s.detached.get(req.GetId())
	if err != nil {
		return nil, err
	}
	n := req.GetSignal().GetSignal()
	if n < 1 || n > maxSignal {
		return nil, invalidf("signal detached process %q: signal %d, want 1 to %d", d.id, n, maxSignal)
	}
	select {
	case <-d.p.child.Done():
		return nil, status.Errorf(codes.FailedPrecondition, "signal detached process %q: it has exited", d.id)
	default:
	}
	if req.GetSignal().GetProcessGroup() {
		err = d.p.child.SignalGroup(syscall.Signal(n))
	} else {
		err = d.p.child.Signal(syscall.Signal(n))
	}
	switch {
	case err == nil:
		return &agentpb.SignalDetachedResponse{}, nil
	case errors.Is(err, os.ErrProcessDone), errors.Is(err, syscall.ESRCH):
		return nil, status.Errorf(codes.FailedPrecondition, "signal detached process %q: it has exited", d.id)
	}
	return nil, status.Errorf(statusCodeOf(err), "signal detached process %q (pid %d): %v", d.id, d.p.child.Pid(), err)
}

// WaitDetached waits for a detached process's exit.
func (s *Server) WaitDetached(ctx context.Context, req *agentpb.WaitDetachedRequest) (*agentpb.DetachedProcess, error) {
	d, err := s.detached.get(req.GetId())
	if err != nil {
		return nil, err
	}
	select {
	case <-d.done:
		return d.info(true), nil
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
}

// ForgetDetached drops an exited detached process.
func (s *Server) ForgetDetached(_ context.Context, req *agentpb.ForgetDetachedRequest) (*agentpb.ForgetDetachedResponse, error) {
	if err := s.detached.forget(req.GetId()); err != nil {
		return nil, err
	}
	return &agentpb.ForgetDetachedResponse{}, nil
}
