package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// ExecOptions describe a process to run in the guest.
type ExecOptions struct {
	// Argv is the command line; Argv[0] is looked up in the guest's PATH
	// unless it contains a slash.
	Argv []string
	// Env holds NAME=VALUE entries; empty means the agent's default
	// (PATH, HOME=/root, TERM=xterm).
	Env []string
	// Dir is the absolute working directory; empty means "/".
	Dir string
	// UID and GID to run as; 0 keeps the default: the image's user in an
	// image-rooted sandbox, else the agent's (root).
	UID, GID uint32
	// AsRoot runs the process as root (uid and gid 0) even where the
	// image's config names another user.
	AsRoot bool
	// Timeout kills the process group with SIGKILL after this long; 0
	// means none.
	Timeout time.Duration
	// Stdin is copied to the process's stdin, which is closed at its EOF;
	// nil gives the process /dev/null.
	Stdin io.Reader
	// Stdout and Stderr receive the process's output; nil discards it.
	Stdout, Stderr io.Writer
	// DetachID, when set, detaches the process under this ID (1 to 128
	// bytes of A-Z a-z 0-9 . _ - :): the end of Start's context or of
	// the connection ends only the call (stdin is closed, output from
	// then on is kept only as a tail), never the process or its Timeout.
	// ListDetached, SignalDetached, WaitDetached and ForgetDetached reach
	// it from any connection.
	DetachID string
	// User, when set, runs the process as this user of the guest's
	// /etc/passwd (its uid, gid, groups and HOME); exclusive with UID,
	// GID and AsRoot.
	User string
	// Pty, when set, runs the process on a terminal of this size: Stdout
	// gets what it shows (Stderr nothing), Stdin is typed into it, its
	// EOF types ^D; Process.Resize changes the size.
	Pty *PtySize
	// Root, when set, runs the process in the container root of this
	// name (Client.MountRoot), in a mount namespace of its own: Argv[0],
	// Dir and User are resolved in it, and no image defaults apply.
	Root string
}

// PtySize is a terminal's size in characters (1 to 65535 each).
type PtySize struct {
	Rows, Cols uint32
}

// ExitStatus is how a process ended.
type ExitStatus struct {
	// Code is the exit code, or -1 if a signal killed the process.
	Code int
	// Signal is the signal that killed the process, or 0.
	Signal int
	// TimedOut says the Timeout expired and the agent killed the process
	// group (Signal is then 9).
	TimedOut bool
	// OOMKilled says the guest's OOM killer killed a process of the exec
	// (only detectable when the agent uses cgroups).
	OOMKilled bool
}

// ShellCode is the code a shell would report: 128+Signal after a signal,
// else Code.
func (s ExitStatus) ShellCode() int {
	if s.Signal != 0 {
		return 128 + s.Signal
	}
	return s.Code
}

// Success reports a zero exit code.
func (s ExitStatus) Success() bool { return s.Code == 0 && s.Signal == 0 }

func (s ExitStatus) String() string {
	var b strings.Builder
	if s.Signal != 0 {
		fmt.Fprintf(&b, "killed by signal %d (%v)", s.Signal, syscall.Signal(s.Signal))
	} else {
		fmt.Fprintf(&b, "exit code %d", s.Code)
	}
	if s.TimedOut {
		b.WriteString(", timed out")
	}
	if s.OOMKilled {
		b.WriteString(", OOM-killed")
	}
	return b.String()
}

// Exec runs a process in the guest and waits for it. A non-zero exit is not
// an error; err reports a failure to run it (a missing executable is
// codes.NotFound, a bad directory codes.InvalidArgument) or to stream its
// input and output. Cancelling ctx kills the process group.
func (c *Client) Exec(ctx context.Context, opts ExecOptions) (ExitStatus, error) {
	p, err := c.Start(ctx, opts)
	if err != nil {
		return ExitStatus{}, err
	}
	return p.Wait()
}

// Process is a process running in the guest, started with Start.
type Process struct {
	pid    int
	argv0  string
	stream agentpb.Agent_ExecClient
	cancel context.CancelFunc

	sendMu sync.Mutex
	done   chan struct{}
	status ExitStatus
	err    error // set before done closes

	stdinMu  sync.Mutex
	stdinErr error
}

// stdinChunk is the size of the stdin messages.
const stdinChunk = 64 << 10

// Start starts a process in the guest and returns once it runs; its output
// streams to opts.Stdout and opts.Stderr until Wait returns. ctx governs the
// whole run: cancelling it kills the process group (a detached process's
// call ends, the process runs on; see ExecOptions.DetachID).
func (c *Client) Start(ctx context.Context, opts ExecOptions) (*Process, error) {
	if len(opts.Argv) == 0 {
		return nil, errors.New("client: exec: empty argv")
	}
	argv0 := opts.Argv[0]
	start := &agentpb.ExecStart{
		Argv:     opts.Argv,
		Env:      opts.Env,
		Cwd:      opts.Dir,
		HasStdin: opts.Stdin != nil,
		DetachId: opts.DetachID,
		User:     opts.User,
		Root:     opts.Root,
	}
	if opts.Pty != nil {
		start.Pty = &agentpb.PtySize{Rows: opts.Pty.Rows, Cols: opts.Pty.Cols}
	}
	if opts.Timeout > 0 {
		start.TimeoutMs = uint64((opts.Timeout + time.Millisecond - 1) / time.Millisecond)
	}
	if opts.AsRoot {
		var zero uint32
		start.Uid, start.Gid = &zero, &zero
	}
	if opts.UID != 0 {
		start.Uid = &opts.UID
	}
	if opts.GID != 0 {
		start.Gid = &opts.GID
	}

	sctx, cancel := context.WithCancel(ctx)
	stream, err := c.api.Exec(sctx)
	if err != nil {
		cancel()
		return nil, fmt.Errorf("client: exec %s: %w", argv0, err)
	}
	// A failed Send means the call is over; Recv returns why.
	_ = stream.Send(&agentpb.ExecRequest{Kind: &agentpb.ExecRequest_Start{Start: start}})
	resp, err := stream.Recv()
	if err != nil {
		cancel()
		return nil, fmt.Errorf("client: exec %s: %w", argv0, err)
	}
	started := resp.GetStarted()
	if started == nil {
		cancel()
		return nil, fmt.Errorf("client: exec %s: agent answered %T before the process started", argv0, resp.GetKind())
	}
	p := &Process{
		pid:    int(started.GetPid()),
		argv0:  argv0,
		stream: stream,
		cancel: cancel,
		done:   make(chan struct{}),
	}
	go p.receive(opts.Stdout, opts.Stderr)
	if opts.Stdin != nil {
		go p.sendStdin(opts.Stdin)
	}
	return p, nil
}

// Pid is the process's pid in the guest.
func (p *Process) Pid() int { return p.pid }

// Signal sends sig to the process.
func (p *Process) Signal(sig syscall.Signal) error {
	return p.sendSignal(sig, false)
}

// SignalGroup sends sig to the process's process group.
func (p *Process) SignalGroup(sig syscall.Signal) error {
	return p.sendSignal(sig, true)
}

func (p *Process) sendSignal(sig syscall.Signal, group bool) error {
	err := p.send(&agentpb.ExecRequest{Kind: &agentpb.ExecRequest_Signal{Signal: &agentpb.ExecSignal{Signal: int32(sig), ProcessGroup: group}}})
	if err != nil {
		return fmt.Errorf("client: signal %v to %s (pid %d): %w", sig, p.argv0, p.pid, err)
	}
	return nil
}

// Resize sets the size of the process's terminal (ExecOptions.Pty).
func (p *Process) Resize(size PtySize) error {
	err := p.send(&agentpb.ExecRequest{Kind: &agentpb.ExecRequest_Resize{Resize: &agentpb.PtySize{Rows: size.Rows, Cols: size.Cols}}})
	if err != nil {
		return fmt.Errorf("client: resize the terminal of %s (pid %d): %w", p.argv0, p.pid, err)
	}
	return nil
}

func (p *Process) send(req *agentpb.ExecRequest) error {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	return p.stream.Send(req)
}

// Wait waits for the process to exit and its output to be delivered.
func (p *Process) Wait() (ExitStatus, error) {
	<-p.done
	p.cancel()
	if p.err != nil {
		return p.status, p.err
	}
	p.stdinMu.Lock()
	defer p.stdinMu.Unlock()
	return p.status, p.stdinErr
}

func (p *Process) receive(stdout, stderr io.Writer) {
	defer close(p.done)
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	exited := false
	for {
		resp, err := p.stream.Recv()
		if err == io.EOF && exited {
			return
		}
		if err == io.EOF {
			p.err = fmt.Errorf("client: exec %s (pid %d): the agent ended the call without an exit status", p.argv0, p.pid)
			return
		}
		if err != nil {
			p.err = fmt.Errorf("client: exec %s (pid %d): %w", p.argv0, p.pid, err)
			return
		}
		switch k := resp.GetKind().(type) {
		case *agentpb.ExecResponse_Stdout:
			if _, err := stdout.Write(k.Stdout); err != nil {
				p.fail(fmt.Errorf("client: exec %s (pid %d): writing stdout: %w", p.argv0, p.pid, err))
				return
			}
		case *agentpb.ExecResponse_Stderr:
			if _, err := stderr.Write(k.Stderr); err != nil {
				p.fail(fmt.Errorf("client: exec %s (pid %d): writing stderr: %w", p.argv0, p.pid, err))
				return
			}
		case *agentpb.ExecResponse_Exit:
			exited = true
			p.status = exitStatusOf(k.Exit)
		}
	}
}

// fail records err and cancels the call, which kills the process (unless
// detached).
func (p *Process) fail(err error) {
	p.err = err
	p.cancel()
}

func (p *Process) sendStdin(r io.Reader) {
	buf := make([]byte, stdinChunk)
	for {
		n, err := r.Read(buf)
		if n > 0 {
			if serr := p.send(&agentpb.ExecRequest{Kind: &agentpb.ExecRequest_Stdin{Stdin: buf[:n]}}); serr != nil {
				return // the call is over
			}
		}
		if err != nil {
			if err != io.EOF {
				p.stdinMu.Lock()
				p.stdinErr = fmt.Errorf("client: exec %s (pid %d): reading stdin: %w", p.argv0, p.pid, err)
				p.stdinMu.Unlock()
			}
			_ = p.send(&agentpb.ExecRequest{Kind: &agentpb.ExecRequest_CloseStdin{CloseStdin: true}})
			return
		}
	}
}
