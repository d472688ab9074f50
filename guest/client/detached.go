package client

import (
	"context"
	"fmt"
	"io"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// DetachedProcess is a detached process the agent keeps (started with
// ExecOptions.DetachID).
type DetachedProcess struct {
	ID      string
	Pid     int
	Argv    []string
	Started time.Time
	// Exited says it has exited, with Status.
	Exited bool
	Status ExitStatus
	// StdoutTail and StderrTail are the last bytes (at most 64 KiB each)
	// of its output; only WaitDetached fills them.
	StdoutTail, StderrTail []byte
}

func detachedOf(p *agentpb.DetachedProcess) DetachedProcess {
	d := DetachedProcess{
		ID:         p.GetId(),
		Pid:        int(p.GetPid()),
		Argv:       p.GetArgv(),
		Started:    time.Unix(0, p.GetStartedUnixNanos()),
		StdoutTail: p.GetStdoutTail(),
		StderrTail: p.GetStderrTail(),
	}
	if x := p.GetExit(); x != nil {
		d.Exited = true
		d.Status = exitStatusOf(x)
	}
	return d
}

func exitStatusOf(x *agentpb.ExecExit) ExitStatus {
	return ExitStatus{
		Code:      int(x.GetExitCode()),
		Signal:    int(x.GetSignal()),
		TimedOut:  x.GetTimedOut(),
		OOMKilled: x.GetOomKilled(),
	}
}

// ListDetached lists the detached processes the agent keeps, running and
// exited, oldest first.
func (c *Client) ListDetached(ctx context.Context) ([]DetachedProcess, error) {
	resp, err := c.api.ListDetached(ctx, &agentpb.ListDetachedRequest{})
	if err != nil {
		return nil, fmt.Errorf("client: list detached processes: %w", err)
	}
	out := make([]DetachedProcess, len(resp.GetProcesses()))
	for i, p := range resp.GetProcesses() {
		out[i] = detachedOf(p)
	}
	return out, nil
}

// SignalDetached sends sig to the detached process id, or with group to
// its process group. One that has exited is codes.FailedPrecondition, an
// unknown ID codes.NotFound.
func (c *Client) SignalDetached(ctx context.Context, id string, sig syscall.Signal, group bool) error {
	_, err := c.api.SignalDetached(ctx, &agentpb.SignalDetachedRequest{Id: id, Signal: &agentpb.ExecSignal{Signal: int32(sig), ProcessGroup: group}})
	if err != nil {
		return fmt.Errorf("client: signal %v to detached process %s: %w", sig, id, err)
	}
	return nil
}

// WaitDetached waits for the detached process id to exit and returns it
// with its status and output tails.
func (c *Client) WaitDetached(ctx context.Context, id string) (DetachedProcess, error) {
	p, err := c.api.WaitDetached(ctx, &agentpb.WaitDetachedRequest{Id: id})
	if err != nil {
		return DetachedProcess{}, fmt.Errorf("client: wait for detached process %s: %w", id, err)
	}
	return detachedOf(p), nil
}

// ForgetDetached drops the exited detached process id from the agent's
// table; a running one is codes.FailedPrecondition.
func (c *Client) ForgetDetached(ctx context.Context, id string) error {
	if _, err := c.api.ForgetDetached(ctx, &agentpb.ForgetDetachedRequest{Id: id}); err != nil {
		return fmt.Errorf("client: forget detached process %s: %w", id, err)
	}
	return nil
}

// AttachDetached copies the output the detached process id writes from now
// on to stdout and stderr (nil discards) and returns its exit status once
// it has exited (at once for one that has). Several may attach at once;
// one that reads too slowly is ended with codes.ResourceExhausted.
func (c *Client) AttachDetached(ctx context.Context, id string, stdout, stderr io.Writer) (ExitStatus, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := c.api.AttachDetached(ctx, &agentpb.AttachDetachedRequest{Id: id})
	if err != nil {
		return ExitStatus{}, fmt.Errorf("client: attach to detached process %s: %w", id, err)
	}
	if stdout == nil {
		stdout = io.Discard
	}
	if stderr == nil {
		stderr = io.Discard
	}
	for {
		r, err := st.Recv()
		if err == io.EOF {
			return ExitStatus{}, fmt.Errorf("client: attach to detached process %s: the agent ended the call without an exit status", id)
		}
		if err != nil {
			return ExitStatus{}, fmt.Errorf("client: attach to detached process %s: %w", id, err)
		}
		switch k := r.GetKind().(type) {
		case *agentpb.ExecResponse_Stdout:
			if _, err := stdout.Write(k.Stdout); err != nil {
				return ExitStatus{}, fmt.Errorf("client: attach to detached process %s: writing stdout: %w", id, err)
			}
		case *agentpb.ExecResponse_Stderr:
			if _, err := stderr.Write(k.Stderr); err != nil {
				return ExitStatus{}, fmt.Errorf("client: attach to detached process %s: writing stderr: %w", id, err)
			}
		case *agentpb.ExecResponse_Exit:
			return exitStatusOf(k.Exit), nil
		}
	}
}
