package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// ExecOptions describe one process to run in a sandbox.
type ExecOptions struct {
	// Argv is the command; argv[0] is looked up in PATH unless it has a
	// slash.
	Argv []string
	// Env is K=V entries over the sandbox's and the image's.
	Env []string
	// Cwd is the working directory; empty: the image's, else /.
	Cwd string
	// UID and GID, when set, run the process as that user and group.
	UID, GID *uint32
	// Stdin, when set, is copied to the process's stdin, which is closed
	// at its EOF. Exec does not wait for a Read that blocks past the
	// process's exit.
	Stdin io.Reader
	// Stdout and Stderr receive the process's output; nil discards it.
	Stdout, Stderr io.Writer
	// Timeout kills the process after this long; 0: never.
	Timeout time.Duration
	// Background keeps the process running after the call ends; Exec then
	// returns as soon as it has started (ExecResult.Exited is false), and
	// ListExecs and KillExec reach it.
	Background bool
	// Signals, when set, are sent to the process's group as they arrive.
	Signals <-chan syscall.Signal
	// Started, when set, is called once the process runs.
	Started func(execID string, pid int32)
	// User, when set, runs the process as this user of the guest's
	// /etc/passwd (its uid, gid, groups and HOME); exclusive with UID
	// and GID.
	User string
	// Pty, when set, runs the process on a terminal of this size:
	// Stdout gets what it shows (Stderr nothing), Stdin is typed into
	// it, and its EOF types ^D.
	Pty *PtySize
	// Resize, when set with Pty, changes the terminal's size as sizes
	// arrive (the process's foreground group gets SIGWINCH).
	Resize <-chan PtySize
}

// PtySize is a terminal's size in characters (1 to 65535 each).
type PtySize struct {
	Rows, Cols uint32
}

// ExecResult is how a process ended.
type ExecResult struct {
	ExecID string
	PID    int32
	// Exited is false for a background exec, which Exec leaves running.
	Exited bool
	// ExitCode is the process's exit status, -1 when a signal killed it.
	ExitCode  int
	Signal    int
	TimedOut  bool
	OOMKilled bool
}

// Exec runs a process in a sandbox, streaming its stdin, stdout and
// stderr, and returns how it ended. Cancelling ctx ends the call, which
// kills a process that is not Background.
func (c *Client) Exec(ctx context.Context, sandboxID string, opts ExecOptions) (*ExecResult, error) {
	if len(opts.Argv) == 0 {
		return nil, fmt.Errorf("kiln: exec in %s: no command given", sandboxID)
	}
	if opts.Timeout < 0 {
		return nil, fmt.Errorf("kiln: exec in %s: negative timeout %v", sandboxID, opts.Timeout)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.api.Exec(ctx)
	if err != nil {
		return nil, callErr(fmt.Sprintf("exec in %s", sandboxID), err)
	}
	start := &kilnpb.ExecStart{
		SandboxId:  sandboxID,
		Argv:       opts.Argv,
		Env:        opts.Env,
		Cwd:        opts.Cwd,
		Uid:        opts.UID,
		Gid:        opts.GID,
		TimeoutMs:  opts.Timeout.Milliseconds(),
		HasStdin:   opts.Stdin != nil,
		Background: opts.Background,
		User:       opts.User,
	}
	if opts.Pty != nil {
		start.Pty = &kilnpb.PtySize{Rows: opts.Pty.Rows, Cols: opts.Pty.Cols}
	}
	if opts.Timeout > 0 && start.TimeoutMs == 0 {
		start.TimeoutMs = 1
	}
	if err := st.Send(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Start{Start: start}}); err != nil {
		return nil, callErr(fmt.Sprintf("exec in %s", sandboxID), recvErr(st, err))
	}

	// One goroutine owns Send from here on; stdin and signals feed it.
	out := make(chan *kilnpb.ExecRequest)
	go func() {
		for {
			select {
			case m := <-out:
				// A failed send ends the stream; Recv reports why.
				if st.Send(m) != nil {
					return
				}
			case <-ctx.Done():
				return
			}
		}
	}()
	push := func(m *kilnpb.ExecRequest) bool {
		select {
		case out <- m:
			return true
		case <-ctx.Done():
			return false
		}
	}
	if opts.Stdin != nil {
		go copyStdin(opts.Stdin, push)
	}
	if opts.Signals != nil {
		go func() {
			for {
				select {
				case sig, ok := <-opts.Signals:
					if !ok {
						return
					}
					push(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Signal{Signal: &kilnpb.ExecSignal{Signal: int32(sig), ProcessGroup: true}}})
				case <-ctx.Done():
					return
				}
			}
		}()
	}

	if opts.Resize != nil {
		go func() {
			for {
				select {
				case size, ok := <-opts.Resize:
					if !ok {
						return
					}
					push(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Resize{Resize: &kilnpb.PtySize{Rows: size.Rows, Cols: size.Cols}}})
				case <-ctx.Done():
					return
				}
			}
		}()
	}

	res := &ExecResult{}
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("kiln: exec in %s: the stream ended before the process did", sandboxID)
		}
		if err != nil {
			return nil, callErr(fmt.Sprintf("exec in %s", sandboxID), err)
		}
		switch k := m.Kind.(type) {
		case *kilnpb.ExecResponse_Started:
			res.ExecID, res.PID = k.Started.GetExecId(), k.Started.GetPid()
			if opts.Started != nil {
				opts.Started(res.ExecID, res.PID)
			}
			if opts.Background {
				return res, nil
			}
		case *kilnpb.ExecResponse_Stdout:
			if err := write(opts.Stdout, k.Stdout); err != nil {
				return nil, callErr(fmt.Sprintf("exec in %s: writing stdout", sandboxID), err)
			}
		case *kilnpb.ExecResponse_Stderr:
			if err := write(opts.Stderr, k.Stderr); err != nil {
				return nil, callErr(fmt.Sprintf("exec in %s: writing stderr", sandboxID), err)
			}
		case *kilnpb.ExecResponse_Exit:
			res.Exited = true
			res.ExitCode = int(k.Exit.GetExitCode())
			res.Signal = int(k.Exit.GetSignal())
			res.TimedOut = k.Exit.GetTimedOut()
			res.OOMKilled = k.Exit.GetOomKilled()
			return res, nil
		}
	}
}

// copyStdin sends r's bytes as stdin messages, then close_stdin at EOF.
// A read error closes stdin too: the process sees EOF rather than hanging.
func copyStdin(r io.Reader, push func(*kilnpb.ExecRequest) bool) {
	for {
		buf := make([]byte, chunkSize)
		n, err := r.Read(buf)
		if n > 0 && !push(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_Stdin{Stdin: buf[:n]}}) {
			return
		}
		if err != nil {
			push(&kilnpb.ExecRequest{Kind: &kilnpb.ExecRequest_CloseStdin{CloseStdin: true}})
			return
		}
	}
}

func write(w io.Writer, p []byte) error {
	if w == nil || len(p) == 0 {
		return nil
	}
	_, err := w.Write(p)
	return err
}

// recvErr is the status behind a failed Send: gRPC reports io.EOF from
// Send and the real error from Recv.
func recvErr[T any](st interface{ Recv() (T, error) }, err error) error {
	if !errors.Is(err, io.EOF) {
		return err
	}
	if _, rerr := st.Recv(); rerr != nil && !errors.Is(rerr, io.EOF) {
		return rerr
	}
	return err
}

// ListExecs lists a sandbox's processes started by Exec, background ones
// included, with the exit of those that have ended.
func (c *Client) ListExecs(ctx context.Context, sandboxID string) ([]*kilnpb.ExecInfo, error) {
	resp, err := c.api.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: sandboxID})
	if err != nil {
		return nil, callErr(fmt.Sprintf("list execs of %s", sandboxID), err)
	}
	return resp.GetExecs(), nil
}

// KillExec sends sig (0: SIGKILL) to an exec's process.
func (c *Client) KillExec(ctx context.Context, sandboxID, execID string, sig syscall.Signal) error {
	if _, err := c.api.KillExec(ctx, &kilnpb.KillExecRequest{SandboxId: sandboxID, ExecId: execID, Signal: int32(sig)}); err != nil {
		return callErr(fmt.Sprintf("kill exec %s in %s", execID, sandboxID), err)
	}
	return nil
}

// AttachExec copies what a running exec writes from now on to stdout and
// stderr (nil discards) and returns how it ended; an exec that has ended
// returns at once. A background exec is reached through its sandbox (even
// after a restart of kilnd), a foreground one through the call that
// streams it; several calls may attach at once.
func (c *Client) AttachExec(ctx context.Context, sandboxID, execID string, stdout, stderr io.Writer) (*ExecResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	what := fmt.Sprintf("attach to exec %s in %s", execID, sandboxID)
	st, err := c.api.AttachExec(ctx, &kilnpb.AttachExecRequest{SandboxId: sandboxID, ExecId: execID})
	if err != nil {
		return nil, callErr(what, err)
	}
	res := &ExecResult{ExecID: execID}
	for m, err := range stream(st.Recv) {
		if err != nil {
			return nil, callErr(what, err)
		}
		switch k := m.Kind.(type) {
		case *kilnpb.ExecResponse_Started:
			res.PID = k.Started.GetPid()
		case *kilnpb.ExecResponse_Stdout:
			if err := write(stdout, k.Stdout); err != nil {
				return nil, callErr(what+": writing stdout", err)
			}
		case *kilnpb.ExecResponse_Stderr:
			if err := write(stderr, k.Stderr); err != nil {
				return nil, callErr(what+": writing stderr", err)
			}
		case *kilnpb.ExecResponse_Exit:
			res.Exited = true
			res.ExitCode = int(k.Exit.GetExitCode())
			res.Signal = int(k.Exit.GetSignal())
			res.TimedOut = k.Exit.GetTimedOut()
			res.OOMKilled = k.Exit.GetOomKilled()
			return res, nil
		}
	}
	return nil, fmt.Errorf("kiln: %s: the stream ended before the exec did", what)
}
