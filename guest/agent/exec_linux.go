package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/filetree"
	"github.com/kilnvm/kiln/guest/agentpb"
)

const (
	// outputChunk is the read size for stdout and stderr: a pipe's
	// default capacity, well under agentpb.MaxChunkSize.
	outputChunk = 64 << 10
	// trampolineTimeout bounds the wait for the trampoline's verdict. The
	// pipe closes as soon as the target is exec'd or the trampoline dies,
	// so this only catches a trampoline that hangs; it is long because 50
	// trampolines starting at once in an emulated guest took over 30 s.
	trampolineTimeout = 5 * time.Minute
	// maxSignal is the highest signal number (SIGRTMAX).
	maxSignal = 64
)

// process is a running Exec process and the agent's ends of its pipes.
type process struct {
	child  *Child
	stdin  *os.File    // nil without has_stdin; the terminal with a pty
	stdout *os.File    // the terminal with a pty
	stderr *os.File    // nil with a pty
	pty    *os.File    // the agent's end of the process's terminal, or nil
	cg     *execCgroup // nil without cgroups
}

// spawn starts spec through the trampoline and waits until the target is
// exec'd (or failed to be).
func (s *Server) spawn(spec *execSpec) (_ *process, err error) {
	s.init()
	var parentEnds, childEnds []*os.File
	defer func() {
		for _, f := range childEnds {
			f.Close()
		}
		if err != nil {
			for _, f := range parentEnds {
				f.Close()
			}
		}
	}()
	pipe := func() (r, w *os.File, err error) {
		r, w, err = os.Pipe()
		if err != nil {
			return nil, nil, status.Errorf(codes.ResourceExhausted, "exec: creating pipe: %v", err)
		}
		return r, w, nil
	}

	p := &process{}
	if spec.pty != nil {
		return s.spawnPty(spec, p)
	}
	var stdinR *os.File
	if spec.hasStdin {
		r, w, err := pipe()
		if err != nil {
			return nil, err
		}
		stdinR, p.stdin = r, w
		parentEnds = append(parentEnds, w)
	} else {
		f, err := os.Open(os.DevNull)
		if err != nil {
			return nil, status.Errorf(codes.Internal, "exec: opening %s: %v", os.DevNull, err)
		}
		stdinR = f
	}
	childEnds = append(childEnds, stdinR)
	outR, outW, err := pipe()
	if err != nil {
		return nil, err
	}
	p.stdout = outR
	parentEnds, childEnds = append(parentEnds, outR), append(childEnds, outW)
	errR, errW, err := pipe()
	if err != nil {
		return nil, err
	}
	p.stderr = errR
	parentEnds, childEnds = append(parentEnds, errR), append(childEnds, errW)
	repR, repW, err := pipe()
	if err != nil {
		return nil, err
	}
	defer repR.Close()
	childEnds = append(childEnds, repW)

	attr := &syscall.ProcAttr{
		Dir:   spec.dir,
		Env:   spec.env,
		Files: []uintptr{stdinR.Fd(), outW.Fd(), errW.Fd(), repW.Fd()},
		Sys:   &syscall.SysProcAttr{Setpgid: true},
	}
	ends := childEnds
	childEnds = nil // startChild closes them
	if err := s.startChild(spec, p, attr, repR, ends...); err != nil {
		return nil, err
	}
	return p, nil
}

// spawnPty starts spec on a new terminal: its stdin, stdout and stderr,
// and its controlling terminal in a session of its own (whose ID, and
// process group's, is its pid, as with Setpgid).
func (s *Server) spawnPty(spec *execSpec, p *process) (*process, error) {
	master, slave, err := openPty(spec.pty)
	if err != nil {
		return nil, status.Errorf(codes.ResourceExhausted, "exec %s: a terminal: %v", spec.path, err)
	}
	defer slave.Close()
	repR, repW, err := os.Pipe()
	if err != nil {
		master.Close()
		return nil, status.Errorf(codes.ResourceExhausted, "exec: creating pipe: %v", err)
	}
	defer repR.Close()
	p.pty, p.stdin, p.stdout = master, master, master
	attr := &syscall.ProcAttr{
		Dir:   spec.dir,
		Env:   spec.env,
		Files: []uintptr{slave.Fd(), slave.Fd(), slave.Fd(), repW.Fd()},
		// Ctty is the child's descriptor: its stdin.
		Sys: &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0},
	}
	err = s.startChild(spec, p, attr, repR, repW, slave)
	if err != nil {
		master.Close()
		return nil, err
	}
	return p, nil
}

// startChild starts the trampoline with attr, closes the child's ends
// (those given, beyond what attr names and the caller closes) once it
// runs, and waits for its verdict on repR. On failure p's files are
// released.
func (s *Server) startChild(spec *execSpec, p *process, attr *syscall.ProcAttr, repR *os.File, childEnds ...*os.File) error {
	closeChildEnds := func() {
		for _, f := range childEnds {
			f.Close()
		}
		childEnds = nil
	}
	defer closeChildEnds()
	if s.cgroups != nil && !s.cgroupsOff.Load() {
		if cg, err := s.cgroups.newExec(); err != nil {
			s.log.Warn("exec: running without a cgroup", "err", err)
		} else {
			p.cg = cg
			attr.Sys.UseCgroupFD = true
			attr.Sys.CgroupFD = cg.fd
		}
	}
	argv := trampolineArgv(spec.path, spec.argv, spec.uid, spec.gid, spec.groups)
	if spec.chroot != "" {
		// A mount namespace of its own (Go makes / private in it first),
		// rooted at the container root; the trampoline is found through
		// the root's /proc (MountRoot mounted one).
		attr.Sys.Chroot = spec.chroot
		attr.Sys.Unshareflags |= syscall.CLONE_NEWNS
	}
	child, err := s.reaper.ForkExec(s.trampoline, argv, attr)
	if err != nil && p.cg != nil && !isResourceErr(err) {
		// The kernel cannot start processes in cgroups (no clone3, not a
		// cgroup v2 directory): stop trying. Running out of tasks or memory
		// (the sandbox's limits at work) must not let processes escape
		// the sandbox instead.
		if errno := errnoOf(err); errno == syscall.ENOSYS || errno == syscall.EBADF || errno == syscall.EOPNOTSUPP {
			if s.cgroupsOff.CompareAndSwap(false, true) {
				s.log.Warn("exec: cannot start processes in cgroups; running them without", "err", err)
			}
		} else {
			s.log.Warn("exec: cannot start in cgroup, starting without", "cgroup", p.cg.dir, "err", err)
		}
		s.cgroups.release(p.cg)
		p.cg = nil
		attr.Sys.UseCgroupFD, attr.Sys.CgroupFD = false, 0
		child, err = s.reaper.ForkExec(s.trampoline, argv, attr)
	}
	if err != nil {
		// Not the target's errors (those come through the report pipe):
		// a missing trampoline is the agent's fault, not NotFound.
		code := codes.Internal
		if isResourceErr(err) {
			code = codes.ResourceExhausted // e.g. the sandbox's pids.max
		} else if errnoOf(err) == syscall.E2BIG {
			code = codes.InvalidArgument
		}
		if p.cg != nil {
			s.cgroups.release(p.cg)
			p.cg = nil
		}
		return status.Errorf(code, "exec %s: starting trampoline %s: %v", spec.path, s.trampoline, err)
	}
	p.child = child
	closeChildEnds()
	if spec.rootName != "" {
		s.noteProcess(spec.rootName, child.Pid())
	}

	// The report pipe closes without a byte once the target is exec'd.
	repR.SetReadDeadline(time.Now().Add(trampolineTimeout))
	report, rerr := io.ReadAll(io.LimitReader(repR, 4096))
	if len(report) == 0 && rerr == nil {
		return nil
	}
	child.SignalGroup(syscall.SIGKILL)
	ws, werr := child.Wait(context.Background())
	p.release(s)
	if len(report) == 0 {
		return status.Errorf(codes.Internal, "exec %s: no word from the trampoline: %v (wait: %v, %v)", spec.path, rerr, describeWaitStatus(ws), werr)
	}
	errno, msg := parseTrampolineReport(report)
	code := codes.Internal
	if errno != 0 {
		code = filetree.Code(errno)
	}
	return status.Error(code, msg)
}

// setReadDeadline sets the read deadline of the process's output.
func (p *process) setReadDeadline(t time.Time) {
	p.stdout.SetReadDeadline(t)
	if p.stderr != nil {
		p.stderr.SetReadDeadline(t)
	}
}

// isResourceErr reports a fork that failed for want of tasks or memory.
func isResourceErr(err error) bool {
	errno := errnoOf(err)
	return errno == syscall.EAGAIN || errno == syscall.ENOMEM
}

// release closes the agent's pipe ends (or terminal) and removes the
// cgroup.
func (p *process) release(s *Server) {
	for _, f := range []*os.File{p.stdin, p.stdout, p.stderr} {
		if f != nil && f != p.pty {
			f.Close()
		}
	}
	if p.pty != nil {
		p.pty.Close()
	}
	if p.cg != nil {
		s.cgroups.release(p.cg)
		p.cg = nil
	}
}

// Exec runs a process; see agentpb.AgentServer.
func (s *Server) Exec(stream agentpb.Agent_ExecServer) error {
	ctx := stream.Context()
	req, err := stream.Recv()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return status.Error(codes.InvalidArgument, "exec: no start request")
		}
		return err
	}
	start := req.GetStart()
	if start == nil {
		return status.Error(codes.InvalidArgument, "exec: the first request must carry start")
	}
	var spec *execSpec
	if name := start.GetRoot(); name != "" {
		// A container root: the image defaults are the guest's own
		// root's, not its; the host names what it wants.
		r, err := s.rootFor(name)
		if err != nil {
			return err
		}
		spec, err = newExecSpecIn(start, nil, r.path+"/", r.path)
		if err != nil {
			return err
		}
		spec.rootName = name
	} else if spec, err = newExecSpec(start, s.cfg.Defaults, "/"); err != nil {
		return err
	}
	if id := start.GetDetachId(); id != "" {
		return s.execDetached(stream, id, spec)
	}
	p, err := s.spawn(spec)
	if err != nil {
		s.log.Info("exec failed", "argv0", spec.argv[0], "err", err)
		return err
	}
	defer p.release(s)
	log := s.log.With("pid", p.child.Pid())
	log.Debug("exec started", "path", spec.path, "argc", len(spec.argv), "dir", spec.dir)

	e := &execution{s: s, stream: stream, p: p}
	exit, err := e.run(ctx, spec)
	if err != nil {
		log.Info("exec ended early", "err", err)
		return err
	}
	log.Debug("exec done", "exit_code", exit.ExitCode, "signal", exit.Signal, "timed_out", exit.TimedOut, "oom_killed", exit.OomKilled)
	return e.send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Exit{Exit: exit}})
}

// execution is one Exec call in progress.
type execution struct {
	s      *Server
	stream agentpb.Agent_ExecServer
	p      *process

	sendMu sync.Mutex

	stdinOnce sync.Once
	// drainUntil is set (unix nanos) once the process exited: output is
	// then read only while it keeps coming, and never past it.
	drainUntil atomic.Int64
}

func (e *execution) send(resp *agentpb.ExecResponse) error {
	e.sendMu.Lock()
	defer e.sendMu.Unlock()
	return e.stream.Send(resp)
}

// closeStdin closes the process's stdin; on a terminal it types ^D, as
// a user would (EOF at the start of a line).
func (e *execution) closeStdin() {
	if e.p.stdin != nil {
		e.stdinOnce.Do(func() { closeStdin(e.p) })
	}
}

func closeStdin(p *process) {
	if p.pty != nil {
		p.pty.Write([]byte{4}) // VEOF's default
		return
	}
	p.stdin.Close()
}

// run streams the process's output and stdin until it exits and returns
// its exit; err is set if the call ended first (the process is then
// killed).
func (e *execution) run(ctx context.Context, spec *execSpec) (*agentpb.ExecExit, error) {
	p := e.p
	killGroup := func() {
		if p.cg != nil {
			p.cg.kill() // every task of the exec, forks in flight included
		}
		p.child.SignalGroup(syscall.SIGKILL)
		p.child.Signal(syscall.SIGKILL) // in case it left its group
	}
	if err := e.send(&agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Started{Started: &agentpb.ExecStarted{Pid: int32(p.child.Pid())}}}); err != nil {
		killGroup()
		p.child.Status()
		return nil, err
	}

	var output sync.WaitGroup
	output.Go(func() {
		e.copyOutput(p.stdout, func(b []byte) *agentpb.ExecResponse {
			return &agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Stdout{Stdout: b}}
		})
	})
	if p.stderr != nil {
		output.Go(func() {
			e.copyOutput(p.stderr, func(b []byte) *agentpb.ExecResponse {
				return &agentpb.ExecResponse{Kind: &agentpb.ExecResponse_Stderr{Stderr: b}}
			})
		})
	}
	outputDone := make(chan struct{})
	go func() {
		output.Wait()
		close(outputDone)
	}()
	go e.pumpRequests()

	var timeout <-chan time.Time
	if spec.timeout > 0 {
		t := time.NewTimer(spec.timeout)
		defer t.Stop()
		timeout = t.C
	}
	timedOut, cancelled := false, false
wait:
	for {
		select {
		case <-p.child.Done():
			break wait
		case <-timeout:
			timedOut, timeout = true, nil
			killGroup()
		case <-ctx.Done():
			if !cancelled {
				cancelled = true
				killGroup()
			}
		}
	}
	ws, werr := p.child.Status()
	if timedOut || cancelled {
		e.killStragglers()
	}
	if p.pty == nil {
		e.closeStdin()
	}

	// Read what is left in the pipes; background processes that hold
	// them open get OutputGrace of silence, MaxOutputDrain in all.
	now := time.Now()
	until := now.Add(e.s.cfg.MaxOutputDrain)
	if cancelled {
		until = now
	}
	e.drainUntil.Store(until.UnixNano())
	deadline := min(now.Add(e.s.cfg.OutputGrace).UnixNano(), until.UnixNano())
	p.setReadDeadline(time.Unix(0, deadline))
	<-outputDone

	if cancelled {
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	if werr != nil {
		return nil, status.Errorf(codes.Internal, "exec %s: waiting for pid %d: %v", spec.path, p.child.Pid(), werr)
	}
	exit := exitOf(ws)
	exit.TimedOut = timedOut
	if p.cg != nil {
		exit.OomKilled = p.cg.oomKilled()
	}
	return exit, nil
}

// killStragglers kills what is left of a killed process's group: a group
// kill can miss processes forked while it runs (a fork bomb). It gives up
// after a while; zombies count as alive until reaped.
func (e *execution) killStragglers() { e.p.killStragglers(e.s.log) }

// killStragglers kills what is left of p's process group (see
// execution.killStragglers).
func (p *process) killStragglers(log *slog.Logger) {
	for range 50 {
		if p.cg != nil {
			p.cg.kill()
		}
		if err := p.child.SignalGroup(syscall.SIGKILL); err != nil {
			return // ESRCH: nobody left
		}
		time.Sleep(10 * time.Millisecond)
	}
	log.Warn("exec: processes of a killed group survive", "pgid", p.child.Pid())
}

// exitOf converts a wait status.
func exitOf(ws syscall.WaitStatus) *agentpb.ExecExit {
	switch {
	case ws.Exited():
		return &agentpb.ExecExit{ExitCode: int32(ws.ExitStatus())}
	case ws.Signaled():
		return &agentpb.ExecExit{ExitCode: -1, Signal: int32(ws.Signal())}
	default:
		return &agentpb.ExecExit{ExitCode: -1}
	}
}

// copyOutput sends what f delivers, chunk by chunk; stream flow control
// holds the process back when the client reads slowly.
func (e *execution) copyOutput(f *os.File, wrap func([]byte) *agentpb.ExecResponse) {
	buf := make([]byte, outputChunk)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if serr := e.send(wrap(buf[:n])); serr != nil {
				return // the call is over; run kills the process
			}
		}
		if errors.Is(err, os.ErrDeadlineExceeded) {
			// A deadline can pass before this goroutine got to read what
			// the pipe held (under load): deliver that, cut only later
			// output.
			e.drainNow(f, buf, wrap)
			return
		}
		if err != nil {
			return // EOF
		}
		if until := e.drainUntil.Load(); until != 0 {
			f.SetReadDeadline(time.Unix(0, min(time.Now().Add(e.s.cfg.OutputGrace).UnixNano(), until)))
		}
	}
}

// drainNow sends what f holds now, without waiting for more.
func (e *execution) drainNow(f *os.File, buf []byte, wrap func([]byte) *agentpb.ExecResponse) {
	drainPipe(f, buf, e.drainUntil.Load(), func(b []byte) bool { return e.send(wrap(b)) == nil })
}

// drainPipe hands sink what f holds now, without waiting for more, until
// the pipe is empty, sink returns false or the time is past until (unix
// nanos).
func drainPipe(f *os.File, buf []byte, until int64, sink func([]byte) bool) {
	if f.SetReadDeadline(time.Time{}) != nil {
		return
	}
	rc, err := f.SyscallConn()
	if err != nil {
		return
	}
	for time.Now().UnixNano() <= until {
		var n int
		var rerr error
		err := rc.Read(func(fd uintptr) bool {
			for {
				n, rerr = syscall.Read(int(fd), buf)
				if rerr != syscall.EINTR {
					return true // never wait for more
				}
			}
		})
		if err != nil || rerr != nil || n <= 0 { // EAGAIN: empty; 0: EOF
			return
		}
		if !sink(buf[:n]) {
			return
		}
	}
}

// pumpRequests handles the requests after start: stdin data, the close of
// stdin, signals and resizes. It returns when the request stream ends (the
// client closed it, or the call is over), which closes a pipe's stdin; a
// terminal gets ^D only from close_stdin (a shell would exit on it, and a
// detached one must outlive its call).
func (e *execution) pumpRequests() {
	if e.p.pty == nil {
		defer e.closeStdin()
	}
	stdinOpen := e.p.stdin != nil
	for {
		req, err := e.stream.Recv()
		if err != nil {
			return
		}
		switch k := req.GetKind().(type) {
		case *agentpb.ExecRequest_Stdin:
			if !stdinOpen || len(k.Stdin) == 0 {
				continue
			}
			if _, err := e.p.stdin.Write(k.Stdin); err != nil {
				// The process closed stdin or exited: drop the rest.
				stdinOpen = false
				e.closeStdin()
			}
		case *agentpb.ExecRequest_CloseStdin:
			if k.CloseStdin {
				stdinOpen = false
				e.closeStdin()
			}
		case *agentpb.ExecRequest_Signal:
			e.signal(k.Signal)
		case *agentpb.ExecRequest_Resize:
			e.p.resize(e.s, k.Resize)
		default:
			e.s.log.Warn("exec: ignoring unexpected request", "pid", e.p.child.Pid(), "kind", fmt.Sprintf("%T", k))
		}
	}
}

// resize sets the size of p's terminal (a request for a process without
// one, or of a bad size, is logged and dropped).
func (p *process) resize(s *Server, size *agentpb.PtySize) {
	if p.pty == nil {
		s.log.Warn("exec: ignoring a resize of a process without a terminal", "pid", p.child.Pid())
		return
	}
	if err := checkPtySize("resize", size); err != nil {
		s.log.Warn("exec: ignoring a bad resize", "pid", p.child.Pid(), "err", err)
		return
	}
	if err := resizePty(p.pty, size); err != nil && !errors.Is(err, os.ErrClosed) {
		s.log.Warn("exec: resize", "pid", p.child.Pid(), "err", err)
	}
}

func (e *execution) signal(sig *agentpb.ExecSignal) {
	n := sig.GetSignal()
	if n < 1 || n > maxSignal {
		e.s.log.Warn("exec: ignoring invalid signal", "pid", e.p.child.Pid(), "signal", n)
		return
	}
	var err error
	if sig.GetProcessGroup() {
		err = e.p.child.SignalGroup(syscall.Signal(n))
	} else {
		err = e.p.child.Signal(syscall.Signal(n))
	}
	if err != nil && !errors.Is(err, os.ErrProcessDone) && err != syscall.ESRCH {
		e.s.log.Warn("exec: signal", "pid", e.p.child.Pid(), "signal", n, "err", err)
	}
}
