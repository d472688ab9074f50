package daemon

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// keepExited is how many exited execs a sandbox's ListExecs still shows.
const keepExited = 64

// execIDPrefix starts every exec ID; maxListedArgv bounds the argv of a
// detached process taken back from a sandbox (kilnd starts none longer:
// the agent's own limit).
const (
	execIDPrefix  = "ex-"
	maxListedArgv = 1 << 16
)

// execTable is a sandbox's execs: running ones, and the last exited.
// Background execs are the instance's detached processes, which outlive
// the server: the first ListExecs or KillExec on an instance the table
// has not seen (a sandbox taken over after a restart, a rollback's new
// machine) puts those the instance keeps back in the table (sync).
type execTable struct {
	mu    sync.Mutex
	execs map[string]*execEntry

	// syncMu serializes syncs; synced is the instance last synced with.
	syncMu sync.Mutex
	synced Instance
}

type execEntry struct {
	info *kilnpb.ExecInfo // Exit set once exited; guarded by execTable.mu
	proc Process
	inst Instance      // the instance it runs in
	done chan struct{} // closed once exited
	// fan passes the output of an exec this server streams to its
	// AttachExec calls (nil for one taken back from a sandbox).
	fan *fanOut
}

// attachQueue is how many output messages an AttachExec call of an exec
// this server streams may fall behind before it is ended.
const attachQueue = 64

// maxAttachers bounds the AttachExec calls of one exec at once.
const maxAttachers = 16

// fanOut copies an exec's output to its attachers, never waiting for
// them: one whose queue is full is dropped.
type fanOut struct {
	mu   sync.Mutex
	subs map[*attachSub]struct{}
}

type attachSub struct {
	ch      chan *kilnpb.ExecResponse
	dropped chan struct{}
}

func (f *fanOut) send(r *kilnpb.ExecResponse) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.subs) == 0 {
		return
	}
	r = proto.Clone(r).(*kilnpb.ExecResponse) // its bytes are the writer's
	for sub := range f.subs {
		select {
		case sub.ch <- r:
		default:
			close(sub.dropped)
			delete(f.subs, sub)
		}
	}
}

func (f *fanOut) add() (*attachSub, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.subs) >= maxAttachers {
		return nil, status.Errorf(codes.ResourceExhausted, "%d calls are attached to this exec already, the most", len(f.subs))
	}
	if f.subs == nil {
		f.subs = map[*attachSub]struct{}{}
	}
	sub := &attachSub{ch: make(chan *kilnpb.ExecResponse, attachQueue), dropped: make(chan struct{})}
	f.subs[sub] = struct{}{}
	return sub, nil
}

func (f *fanOut) remove(sub *attachSub) {
	f.mu.Lock()
	delete(f.subs, sub)
	f.mu.Unlock()
}

func newExecTable() *execTable { return &execTable{execs: map[string]*execEntry{}} }

func (t *execTable) add(e *execEntry) {
	t.mu.Lock()
	t.execs[e.info.ExecId] = e
	t.mu.Unlock()
}

// exited records e's exit and forgets the oldest exited execs beyond
// keepExited.
func (t *execTable) exited(e *execEntry, exit *kilnpb.ExecExit) {
	t.mu.Lock()
	e.info.Exit = exit
	close(e.done)
	gone := t.trimLocked()
	t.mu.Unlock()
	forgetDetached(gone)
}

// endBefore ends, as killed, every exec of a machine before inst that was
// not seen to exit: a boot (a resume that kept files only) ended them.
func (t *execTable) endBefore(inst Instance) {
	t.mu.Lock()
	for _, e := range t.execs {
		if e.info.Exit == nil && e.inst != inst {
			e.info.Exit = &kilnpb.ExecExit{ExitCode: -1, Signal: int32(syscall.SIGKILL)}
			close(e.done)
		}
	}
	gone := t.trimLocked()
	t.mu.Unlock()
	forgetDetached(gone)
}

// trimLocked forgets the oldest exited execs beyond keepExited and
// returns them. t.mu must be held.
func (t *execTable) trimLocked() []*execEntry {
	var old []*execEntry
	for _, x := range t.execs {
		if x.info.Exit != nil {
			old = append(old, x)
		}
	}
	if len(old) <= keepExited {
		return nil
	}
	sort.Slice(old, func(i, j int) bool { return old[i].info.StartedUnixMs < old[j].info.StartedUnixMs })
	gone := old[:len(old)-keepExited]
	for _, x := range gone {
		delete(t.execs, x.info.ExecId)
	}
	return gone
}

// forgetTimeout bounds the calls that drop detached processes the
// table no longer shows from their instance.
const forgetTimeout = 30 * time.Second

// forgetDetached drops the background execs of gone from their
// instances' tables, in the background and best effort (the instance
// may have ended; its table makes room by itself when full).
func forgetDetached(gone []*execEntry) {
	for _, x := range gone {
		if !x.info.Background || x.inst == nil {
			continue
		}
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), forgetTimeout)
			defer cancel()
			x.inst.ForgetDetached(ctx, x.info.ExecId)
		}()
	}
}

// sync puts the detached processes inst keeps into the table, once per
// instance (see execTable). A process the table has from another
// instance (its machine is gone) is replaced; its exit is recorded when
// it comes. A failed listing is retried by the next sync.
func (t *execTable) sync(ctx context.Context, inst Instance, log *slog.Logger) {
	t.syncMu.Lock()
	defer t.syncMu.Unlock()
	if t.synced == inst {
		return
	}
	ds, err := inst.Detached(ctx)
	if status.Code(err) == codes.Unimplemented {
		t.synced = inst // an agent older than detached processes keeps none
		return
	}
	if err != nil {
		log.Warn("the background execs of a sandbox could not be listed", "err", err)
		return
	}
	t.synced = inst
	// The list is the guest's word: only as many entries as an agent
	// keeps, only IDs kilnd gives, and one log line for what is skipped.
	skipped := 0
	if len(ds) > MaxDetached {
		skipped, ds = len(ds)-MaxDetached, ds[:MaxDetached]
	}
	t.mu.Lock()
	var wait []*execEntry
	for _, d := range ds {
		if checkID("exec_id", d.ID) != nil || !strings.HasPrefix(d.ID, execIDPrefix) || len(d.Argv) > maxListedArgv {
			skipped++
			continue
		}
		if x := t.execs[d.ID]; x != nil && x.inst == inst {
			continue // this server started it
		}
		e := &execEntry{
			info: &kilnpb.ExecInfo{ExecId: d.ID, Pid: int32(d.Pid), Argv: d.Argv, Background: true,
				StartedUnixMs: d.Started.UnixMilli()},
			proc: d.Process, inst: inst, done: make(chan struct{}),
		}
		if d.Exit != nil {
			e.info.Exit = exitOf(*d.Exit, nil)
			close(e.done)
		} else {
			wait = append(wait, e)
		}
		t.execs[d.ID] = e
	}
	gone := t.trimLocked()
	t.mu.Unlock()
	if skipped > 0 {
		log.Warn("skipped detached processes the sandbox listed that are not kilnd's execs", "skipped", skipped)
	}
	forgetDetached(gone)
	for _, e := range wait {
		go func() {
			st, err := e.proc.Wait()
			t.exited(e, exitOf(st, err))
		}()
	}
}

// syncExecs syncs b's exec table with its instance, unless it is not
// running (paused, its agent would not answer; else it has none): that
// waits for a later call.
func (s *Server) syncExecs(ctx context.Context, b *box) {
	b.mu.Lock()
	inst, st := b.inst, b.life.get()
	b.mu.Unlock()
	if st != boxRunning {
		return
	}
	b.execs.sync(ctx, inst, s.log.With("sandbox", b.id))
}

func (t *execTable) get(id string) *execEntry {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.execs[id]
}

func (t *execTable) list() []*kilnpb.ExecInfo {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]*kilnpb.ExecInfo, 0, len(t.execs))
	for _, e := range t.execs {
		out = append(out, proto.Clone(e.info).(*kilnpb.ExecInfo))
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].StartedUnixMs != out[j].StartedUnixMs {
			return out[i].StartedUnixMs < out[j].StartedUnixMs
		}
		return out[i].ExecId < out[j].ExecId
	})
	return out
}

// execOptions checks an ExecStart and turns it into the agent's options.
func execOptions(st *kilnpb.ExecStart, sandboxEnv []string) (ExecOptions, error) {
	var o ExecOptions
	if len(st.GetArgv()) == 0 {
		return o, status.Error(codes.InvalidArgument, "exec: argv is empty")
	}
	for i, a := range st.GetArgv() {
		if strings.ContainsRune(a, 0) {
			return o, status.Errorf(codes.InvalidArgument, "exec: argv[%d] has a NUL byte", i)
		}
	}
	if st.GetArgv()[0] == "" {
		return o, status.Error(codes.InvalidArgument, "exec: argv[0] is empty")
	}
	if err := checkEnv("exec env", st.GetEnv()); err != nil {
		return o, err
	}
	if cwd := st.GetCwd(); cwd != "" {
		if err := checkPath("cwd", cwd); err != nil {
			return o, err
		}
	}
	if st.GetTimeoutMs() < 0 {
		return o, status.Errorf(codes.InvalidArgument, "exec: timeout_ms %d is negative: 0 means none", st.GetTimeoutMs())
	}
	if u := st.GetUser(); u != "" {
		if err := checkUser("exec: user", u); err != nil {
			return o, err
		}
		if st.Uid != nil || st.Gid != nil {
			return o, status.Errorf(codes.InvalidArgument, "exec: user %q and uid/gid both given: name one or the other", u)
		}
		o.User = u
	}
	if p := st.GetPty(); p != nil {
		if err := checkPtySize("exec: pty", p); err != nil {
			return o, err
		}
		o.Pty = &PtySize{Rows: p.GetRows(), Cols: p.GetCols()}
	}
	o.Argv = st.GetArgv()
	if len(sandboxEnv)+len(st.GetEnv()) > 0 {
		o.Env = append(append([]string{}, sandboxEnv...), st.GetEnv()...)
	}
	o.Dir = st.GetCwd()
	o.Timeout = time.Duration(st.GetTimeoutMs()) * time.Millisecond
	if st.Uid != nil {
		if st.GetUid() == 0 {
			o.AsRoot = true
		}
		o.UID = st.GetUid()
	}
	if st.Gid != nil {
		o.GID = st.GetGid()
	}
	return o, nil
}

// maxPtyDimension is the most rows or columns a terminal has (the kernel
// keeps them in 16 bits).
const maxPtyDimension = 65535

// checkPtySize checks a terminal size of a request.
func checkPtySize(field string, p *kilnpb.PtySize) error {
	if p.GetRows() < 1 || p.GetRows() > maxPtyDimension || p.GetCols() < 1 || p.GetCols() > maxPtyDimension {
		return status.Errorf(codes.InvalidArgument, "%s %dx%d: want 1 to %d rows and columns", field, p.GetRows(), p.GetCols(), maxPtyDimension)
	}
	return nil
}

// maxUserName bounds a guest user's name in a request.
const maxUserName = 256

// checkUser checks a guest user's name of a request (the guest looks it
// up).
func checkUser(field, u string) error {
	if len(u) > maxUserName {
		return status.Errorf(codes.InvalidArgument, "%s is %d bytes: at most %d", field, len(u), maxUserName)
	}
	if strings.ContainsAny(u, ":/\n\x00") {
		return status.Errorf(codes.InvalidArgument, "%s %q is not a user name", field, u)
	}
	return nil
}

// Exec runs a process in a sandbox: the first request is its ExecStart,
// the next ones stdin and signals; the responses are ExecStarted, its
// output and ExecExit. A foreground exec's process group is killed when
// the call ends before it exits; a background one runs on, listed by
// ListExecs, until it exits, KillExec kills it or the sandbox ends. A
// background exec is the sandbox's detached process under its exec ID:
// it outlives a restart of the server too, and the next server lists it.
func (s *Server) Exec(stream kilnpb.Kiln_ExecServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	began := time.Now()
	st := first.GetStart()
	if st == nil {
		err := status.Errorf(codes.InvalidArgument, "exec: the first request must be an ExecStart, not %T", first.GetKind())
		s.metrics.execStarted(began, err)
		return err
	}
	b, inst, done, err := s.use(st.GetSandboxId())
	if err != nil {
		s.metrics.execStarted(began, err)
		return err
	}
	defer done()
	if st.GetBackground() {
		defer b.following()()
	}
	b.mu.Lock()
	env, bctx, secs := b.rec.Env, b.ctx, b.secrets // a rollback replaces ctx
	b.mu.Unlock()
	opts, err := execOptions(st, plainEnv(env, secs))
	if err != nil {
		s.metrics.execStarted(began, err)
		return err
	}
	if len(secs) > 0 {
		opts.Env = secretEnv(opts.Env, secs) // the secrets win
	}

	// Output goes to the call while it lasts, then nowhere, and to the
	// AttachExec calls of a foreground exec.
	var sendMu sync.Mutex
	attached := true
	fan := &fanOut{}
	// Output waits for ExecStarted to have gone first.
	startedSent := make(chan struct{})
	var startedOnce sync.Once
	markStarted := func() { startedOnce.Do(func() { close(startedSent) }) }
	defer markStarted()
	send := func(r *kilnpb.ExecResponse) error {
		if r.GetStarted() == nil {
			<-startedSent
		}
		sendMu.Lock()
		defer sendMu.Unlock()
		if r.GetStarted() == nil && r.GetExit() == nil && !st.GetBackground() {
			fan.send(r)
		}
		if !attached {
			return nil
		}
		return stream.Send(r)
	}
	detach := func() {
		sendMu.Lock()
		attached = false
		sendMu.Unlock()
	}
	defer detach()
	// Both streams pass through maskers of the sandbox's secrets,
	// flushed once the process has exited.
	values := secretValues(secs)
	stdout := newMasker(writerFunc(func(p []byte) (int, error) {
		send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Stdout{Stdout: p}})
		return len(p), nil
	}), values)
	stderr := newMasker(writerFunc(func(p []byte) (int, error) {
		send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Stderr{Stderr: p}})
		return len(p), nil
	}), values)
	opts.Stdout, opts.Stderr = stdout, stderr
	var stdinR *io.PipeReader
	var stdinW *io.PipeWriter
	if st.GetHasStdin() || st.GetPty() != nil { // a terminal takes input
		stdinR, stdinW = io.Pipe()
		opts.Stdin = stdinR
	}
	// A foreground process lives as long as the call; a background one
	// as long as the sandbox (its call to the agent lasts until it
	// exits or the sandbox ends).
	pctx := stream.Context()
	execID := newID(execIDPrefix)
	if st.GetBackground() {
		pctx = bctx
		opts.DetachID = execID
	}
	log := s.log.With("sandbox", b.id, "exec", execID)
	proc, err := inst.Start(pctx, opts)
	if err != nil {
		if stdinW != nil {
			stdinW.Close()
		}
		err = callErr("exec "+opts.Argv[0]+" in sandbox "+b.id, err)
		s.metrics.execStarted(began, err)
		// Never the env nor the argv past argv[0]: a client's secrets may
		// be there.
		log.Debug("exec did not start", "argv0", opts.Argv[0], "err", err)
		return err
	}
	s.metrics.execStarted(began, nil)
	log.Debug("exec started", "argv0", opts.Argv[0], "pid", proc.Pid(), "background", st.GetBackground())
	e := &execEntry{
		info: &kilnpb.ExecInfo{ExecId: execID, Pid: int32(proc.Pid()), Argv: opts.Argv,
			Background: st.GetBackground(), StartedUnixMs: s.clock.Now().UnixMilli()},
		proc: proc, inst: inst, done: make(chan struct{}), fan: fan,
	}
	b.execs.add(e)
	var exit *kilnpb.ExecExit
	lost := false
	waited := make(chan struct{})
	go func() {
		defer close(waited)
		status, err := proc.Wait()
		flushMasked(stdout)
		flushMasked(stderr)
		if stdinR != nil {
			stdinR.CloseWithError(errors.New("the process exited"))
		}
		if st.GetBackground() && err != nil && bctx.Err() != nil {
			// The sandbox's machine went (hibernated, rolled back,
			// ended) before the process was seen to exit: the next
			// machine's agent tells its fate (ListExecs syncs it).
			lost = true
			return
		}
		exit = exitOf(status, err)
		if exit.OomKilled {
			s.metrics.failures.WithLabelValues(opExec, reasonOutOfMemory).Inc()
		}
		log.Debug("exec exited", "exit_code", exit.ExitCode, "signal", exit.Signal, "timed_out", exit.TimedOut, "oom_killed", exit.OomKilled)
		b.execs.exited(e, exit)
	}()
	err = send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Started{Started: &kilnpb.ExecStarted{ExecId: e.info.ExecId, Pid: e.info.Pid}}})
	markStarted()
	if err != nil {
		// The call is gone: a foreground process dies with its context.
		if !st.GetBackground() {
			<-waited
		}
		return err
	}
	go s.execInput(stream, proc, stdinW, opts.Pty != nil)
	select {
	case <-waited:
	case <-stream.Context().Done():
		if st.GetBackground() {
			return stream.Context().Err()
		}
		<-waited // killed with the call's context
		return stream.Context().Err()
	}
	if lost {
		return status.Errorf(codes.Unavailable, "exec %s: sandbox %s's machine stopped (hibernated, rolled back or ended) before the process was seen to exit; after a resume ListExecs and AttachExec follow it", execID, b.id)
	}
	return send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Exit{Exit: exit}})
}

// execInput copies an exec call's stdin and signals to its process until
// the call's input ends.
func (s *Server) execInput(stream kilnpb.Kiln_ExecServer, proc Process, stdin *io.PipeWriter, pty bool) {
	defer func() {
		if stdin != nil {
			stdin.Close()
		}
	}()
	for {
		req, err := stream.Recv()
		if err != nil {
			return
		}
		switch k := req.GetKind().(type) {
		case *kilnpb.ExecRequest_Stdin:
			if stdin != nil {
				if _, err := stdin.Write(k.Stdin); err != nil {
					stdin = nil // the process exited or closed its stdin
				}
			}
		case *kilnpb.ExecRequest_CloseStdin:
			if stdin != nil {
				stdin.Close()
				stdin = nil
			}
		case *kilnpb.ExecRequest_Signal:
			sig := syscall.Signal(k.Signal.GetSignal())
			if sig <= 0 || sig > 64 {
				continue
			}
			if k.Signal.GetProcessGroup() {
				proc.SignalGroup(sig)
			} else {
				proc.Signal(sig)
			}
		case *kilnpb.ExecRequest_Resize:
			if !pty || checkPtySize("resize", k.Resize) != nil {
				continue // nothing to resize, or a size no terminal has
			}
			if err := proc.Resize(PtySize{Rows: k.Resize.GetRows(), Cols: k.Resize.GetCols()}); err != nil {
				s.log.Debug("exec: resize", "pid", proc.Pid(), "err", err)
			}
		}
	}
}

// exitOf describes how a process ended; a failure to learn it reads as
// being killed.
func exitOf(st ExitStatus, err error) *kilnpb.ExecExit {
	if err != nil && st == (ExitStatus{}) {
		return &kilnpb.ExecExit{ExitCode: -1, Signal: int32(syscall.SIGKILL)}
	}
	return &kilnpb.ExecExit{ExitCode: int32(st.Code), Signal: int32(st.Signal), TimedOut: st.TimedOut, OomKilled: st.OOMKilled}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

// ListExecs lists a sandbox's running execs and its last exited ones,
// with the background execs a previous server started.
func (s *Server) ListExecs(ctx context.Context, req *kilnpb.ListExecsRequest) (*kilnpb.ListExecsResponse, error) {
	b, err := s.lookup(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	s.syncExecs(ctx, b)
	return &kilnpb.ListExecsResponse{Execs: b.execs.list()}, nil
}

// KillExec signals an exec's process group (SIGKILL by default).
func (s *Server) KillExec(ctx context.Context, req *kilnpb.KillExecRequest) (*kilnpb.KillExecResponse, error) {
	b, _, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	defer done()
	if err := checkID("exec_id", req.GetExecId()); err != nil {
		return nil, err
	}
	s.syncExecs(ctx, b)
	e := b.execs.get(req.GetExecId())
	if e == nil {
		return nil, status.Errorf(codes.NotFound, "sandbox %s has no exec %q", b.id, req.GetExecId())
	}
	select {
	case <-e.done:
		return nil, status.Errorf(codes.FailedPrecondition, "exec %s has exited", req.GetExecId())
	default:
	}
	sig := syscall.Signal(req.GetSignal())
	if sig == 0 {
		sig = syscall.SIGKILL
	}
	if sig < 0 || sig > 64 {
		return nil, status.Errorf(codes.InvalidArgument, "signal %d: want 1 to 64 (0: SIGKILL)", req.GetSignal())
	}
	if err := e.proc.SignalGroup(sig); err != nil {
		return nil, callErr("kill exec "+req.GetExecId(), err)
	}
	return &kilnpb.KillExecResponse{}, nil
}

// AttachExec streams an exec's output from now on, then its exit: first
// an ExecStarted naming it (the attach is in place), then its stdout and
// stderr (masked as the exec's own), then ExecExit. A background exec is
// attached through its sandbox (the agent keeps it, so this works after a
// restart of the server too); a foreground one through the call that
// streams it. An exited exec answers with its exit at once.
func (s *Server) AttachExec(req *kilnpb.AttachExecRequest, stream kilnpb.Kiln_AttachExecServer) error {
	if err := checkID("exec_id", req.GetExecId()); err != nil {
		return err
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return err
	}
	defer done()
	defer b.following()()
	ctx := stream.Context()
	s.syncExecs(ctx, b)
	e := b.execs.get(req.GetExecId())
	if e == nil {
		return status.Errorf(codes.NotFound, "sandbox %s has no exec %q", b.id, req.GetExecId())
	}
	b.mu.Lock()
	secs := b.secrets
	b.mu.Unlock()
	exit := func() error {
		b.execs.mu.Lock()
		x := proto.Clone(e.info.Exit).(*kilnpb.ExecExit)
		b.execs.mu.Unlock()
		return stream.Send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Exit{Exit: x}})
	}
	started := &kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Started{Started: &kilnpb.ExecStarted{ExecId: e.info.ExecId, Pid: e.info.Pid}}}
	select {
	case <-e.done:
		if err := stream.Send(started); err != nil {
			return err
		}
		return exit()
	default:
	}

	if !e.info.Background {
		if e.fan == nil {
			return status.Errorf(codes.FailedPrecondition, "exec %s: not streamed by this server", e.info.ExecId)
		}
		sub, err := e.fan.add()
		if err != nil {
			return status.Errorf(codes.ResourceExhausted, "attach to exec %s: %v", e.info.ExecId, status.Convert(err).Message())
		}
		defer e.fan.remove(sub)
		if err := stream.Send(started); err != nil {
			return err
		}
		for {
			select {
			case r := <-sub.ch:
				if err := stream.Send(r); err != nil {
					return err
				}
			case <-sub.dropped:
				return status.Errorf(codes.ResourceExhausted, "attach to exec %s: the call fell %d messages behind its output", e.info.ExecId, attachQueue)
			case <-e.done:
				for { // its output was all queued before it was done
					select {
					case r := <-sub.ch:
						if err := stream.Send(r); err != nil {
							return err
						}
					default:
						return exit()
					}
				}
			case <-ctx.Done():
				return status.FromContextError(ctx.Err()).Err()
			}
		}
	}

	// A background exec: the sandbox's detached process.
	if e.inst != inst {
		return status.Errorf(codes.FailedPrecondition, "exec %s ran in an earlier machine of sandbox %s", e.info.ExecId, b.id)
	}
	if err := stream.Send(started); err != nil {
		return err
	}
	values := secretValues(secs)
	out := newMasker(writerFunc(func(p []byte) (int, error) {
		return len(p), stream.Send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Stdout{Stdout: p}})
	}), values)
	errOut := newMasker(writerFunc(func(p []byte) (int, error) {
		return len(p), stream.Send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Stderr{Stderr: p}})
	}), values)
	st, err := inst.AttachDetached(ctx, e.info.ExecId, out, errOut)
	if err != nil {
		return callErr("attach to exec "+e.info.ExecId+" in sandbox "+b.id, err)
	}
	if err := flushMasked(out); err != nil {
		return err
	}
	if err := flushMasked(errOut); err != nil {
		return err
	}
	return stream.Send(&kilnpb.ExecResponse{Kind: &kilnpb.ExecResponse_Exit{Exit: exitOf(st, nil)}})
}
