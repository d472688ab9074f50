package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"iter"

	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// CreateSandbox starts a sandbox from the image, template or checkpoint
// that req names and returns it once it answers. A request without a
// RequestId gets a fresh one; set one (NewRequestID) to retry a create
// safely yourself.
func (c *Client) CreateSandbox(ctx context.Context, req *kilnpb.CreateSandboxRequest) (*kilnpb.Sandbox, error) {
	if req == nil {
		req = &kilnpb.CreateSandboxRequest{}
	}
	if req.GetRequestId() == "" {
		req = proto.CloneOf(req)
		req.RequestId = NewRequestID()
	}
	sb, err := c.api.CreateSandbox(ctx, req)
	if err != nil {
		return nil, callErr("create sandbox", err)
	}
	return sb, nil
}

// GetSandbox returns one sandbox, live or ended.
func (c *Client) GetSandbox(ctx context.Context, id string) (*kilnpb.Sandbox, error) {
	sb, err := c.api.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: id})
	if err != nil {
		return nil, callErr(fmt.Sprintf("get sandbox %s", id), err)
	}
	return sb, nil
}

// ListOptions filters ListSandboxes.
type ListOptions struct {
	// Only sandboxes with all of these labels.
	Labels map[string]string
	// Only sandboxes in one of these states; none: the live ones.
	States []kilnpb.SandboxState
}

// ListSandboxes lists the sandboxes that opts selects.
func (c *Client) ListSandboxes(ctx context.Context, opts ListOptions) ([]*kilnpb.Sandbox, error) {
	resp, err := c.api.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{Labels: opts.Labels, States: opts.States})
	if err != nil {
		return nil, callErr("list sandboxes", err)
	}
	return resp.GetSandboxes(), nil
}

// DestroySandbox stops a sandbox and frees what it holds.
func (c *Client) DestroySandbox(ctx context.Context, id string) error {
	if _, err := c.api.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: id}); err != nil {
		return callErr(fmt.Sprintf("destroy sandbox %s", id), err)
	}
	return nil
}

// PauseSandbox stops a sandbox's vCPUs; ResumeSandbox starts them again.
func (c *Client) PauseSandbox(ctx context.Context, id string) (*kilnpb.Sandbox, error) {
	sb, err := c.api.PauseSandbox(ctx, &kilnpb.PauseSandboxRequest{Id: id})
	if err != nil {
		return nil, callErr(fmt.Sprintf("pause sandbox %s", id), err)
	}
	return sb, nil
}

// ResumeSandbox starts a paused sandbox's vCPUs again.
func (c *Client) ResumeSandbox(ctx context.Context, id string) (*kilnpb.Sandbox, error) {
	sb, err := c.api.ResumeSandbox(ctx, &kilnpb.ResumeSandboxRequest{Id: id})
	if err != nil {
		return nil, callErr(fmt.Sprintf("resume sandbox %s", id), err)
	}
	return sb, nil
}

// UpdateNetworkPolicy replaces a running sandbox's egress policy; it holds
// for new connections at once, and the daemon cuts the established ones
// the new policy forbids.
func (c *Client) UpdateNetworkPolicy(ctx context.Context, id string, egress *kilnpb.EgressPolicy) (*kilnpb.Sandbox, error) {
	sb, err := c.api.UpdateNetworkPolicy(ctx, &kilnpb.UpdateNetworkPolicyRequest{Id: id, Egress: egress})
	if err != nil {
		return nil, callErr(fmt.Sprintf("update the network policy of sandbox %s", id), err)
	}
	return sb, nil
}

// CheckpointOptions are Checkpoint's choices.
type CheckpointOptions struct {
	// Persist writes the checkpoint to the daemon's state folder, so that
	// it survives the sandbox and the daemon.
	Persist bool
	// Keep keeps it when its sandbox is destroyed.
	Keep bool
}

// Checkpoint freezes a sandbox's state as a new node of its checkpoint
// tree.
func (c *Client) Checkpoint(ctx context.Context, sandboxID string, opts CheckpointOptions) (*kilnpb.CheckpointInfo, error) {
	ck, err := c.api.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: sandboxID, Persist: opts.Persist, Keep: opts.Keep})
	if err != nil {
		return nil, callErr(fmt.Sprintf("checkpoint sandbox %s", sandboxID), err)
	}
	return ck, nil
}

// Rollback returns a sandbox to one of its checkpoints, in place: the same
// ID and network identity.
func (c *Client) Rollback(ctx context.Context, sandboxID, checkpointID string) (*kilnpb.Sandbox, error) {
	sb, err := c.api.Rollback(ctx, &kilnpb.RollbackRequest{SandboxId: sandboxID, CheckpointId: checkpointID})
	if err != nil {
		return nil, callErr(fmt.Sprintf("roll sandbox %s back to %s", sandboxID, checkpointID), err)
	}
	return sb, nil
}

// ListCheckpoints returns a sandbox's checkpoint tree: each node names its
// parent.
func (c *Client) ListCheckpoints(ctx context.Context, sandboxID string) ([]*kilnpb.CheckpointInfo, error) {
	resp, err := c.api.ListCheckpoints(ctx, &kilnpb.ListCheckpointsRequest{SandboxId: sandboxID})
	if err != nil {
		return nil, callErr(fmt.Sprintf("list checkpoints of %s", sandboxID), err)
	}
	return resp.GetCheckpoints(), nil
}

// DeleteCheckpoint drops a checkpoint.
func (c *Client) DeleteCheckpoint(ctx context.Context, id string) error {
	if _, err := c.api.DeleteCheckpoint(ctx, &kilnpb.DeleteCheckpointRequest{Id: id}); err != nil {
		return callErr(fmt.Sprintf("delete checkpoint %s", id), err)
	}
	return nil
}

// Fork starts req.Count children of a running sandbox or a checkpoint and
// yields each as it becomes ready; an error, if any, comes last. Breaking
// out of the loop cancels the call. A request without a RequestId gets a
// fresh one.
func (c *Client) Fork(ctx context.Context, req *kilnpb.ForkRequest) iter.Seq2[*kilnpb.Sandbox, error] {
	if req == nil {
		req = &kilnpb.ForkRequest{}
	}
	if req.GetRequestId() == "" {
		req = proto.CloneOf(req)
		req.RequestId = NewRequestID()
	}
	return func(yield func(*kilnpb.Sandbox, error) bool) {
		ctx, cancel := context.WithCancel(ctx)
		defer cancel()
		st, err := c.api.Fork(ctx, req)
		if err != nil {
			yield(nil, callErr("fork", err))
			return
		}
		for sb, err := range stream(st.Recv) {
			if err != nil {
				yield(nil, callErr("fork", err))
				return
			}
			if !yield(sb, nil) {
				return
			}
		}
	}
}

// Events is a subscription to sandbox state changes (WatchEvents).
type Events struct {
	ctx    context.Context
	cancel context.CancelFunc
	st     kilnpb.Kiln_WatchEventsClient
}

// WatchEvents subscribes to the state changes of the sandboxes named
// (none: all) and returns once the daemon has the subscription: every
// change after it returns is delivered. Close the subscription, or end
// ctx, when done.
func (c *Client) WatchEvents(ctx context.Context, sandboxIDs ...string) (*Events, error) {
	ctx, cancel := context.WithCancel(ctx)
	st, err := c.api.WatchEvents(ctx, &kilnpb.WatchEventsRequest{SandboxIds: sandboxIDs})
	if err != nil {
		cancel()
		return nil, callErr("watch events", err)
	}
	// kilnd sends the headers once it has subscribed. No headers: the
	// call ended at once, and Recv says how.
	if md, err := st.Header(); err != nil || md == nil {
		if err == nil {
			_, err = st.Recv()
		}
		cancel()
		if errors.Is(err, io.EOF) {
			err = errors.New("the daemon ended the watch at once")
		}
		return nil, callErr("watch events", err)
	}
	return &Events{ctx: ctx, cancel: cancel, st: st}, nil
}

// Recv returns the next event. After Close, or once the watch's context
// has ended, it returns io.EOF.
func (e *Events) Recv() (*kilnpb.Event, error) {
	ev, err := e.st.Recv()
	if err != nil {
		if e.ctx.Err() != nil || errors.Is(err, io.EOF) {
			return nil, io.EOF
		}
		return nil, callErr("watch events", err)
	}
	return ev, nil
}

// All yields the events until the subscription ends; an error, if any,
// comes last. Breaking out of the loop leaves the subscription open.
func (e *Events) All() iter.Seq2[*kilnpb.Event, error] {
	return func(yield func(*kilnpb.Event, error) bool) {
		for {
			ev, err := e.Recv()
			if errors.Is(err, io.EOF) {
				return
			}
			if !yield(ev, err) || err != nil {
				return
			}
		}
	}
}

// Close ends the subscription.
func (e *Events) Close() { e.cancel() }

// CreateTemplate boots req.Image once, runs req.Setup and keeps a
// snapshot that CreateSandbox can restore from. A request without a
// RequestId gets a fresh one.
func (c *Client) CreateTemplate(ctx context.Context, req *kilnpb.CreateTemplateRequest) (*kilnpb.Template, error) {
	if req == nil {
		req = &kilnpb.CreateTemplateRequest{}
	}
	if req.GetRequestId() == "" {
		req = proto.CloneOf(req)
		req.RequestId = NewRequestID()
	}
	t, err := c.api.CreateTemplate(ctx, req)
	if err != nil {
		return nil, callErr("create template", err)
	}
	return t, nil
}

// GetTemplate returns a template by ID or name.
func (c *Client) GetTemplate(ctx context.Context, id string) (*kilnpb.Template, error) {
	t, err := c.api.GetTemplate(ctx, &kilnpb.GetTemplateRequest{Id: id})
	if err != nil {
		return nil, callErr(fmt.Sprintf("get template %s", id), err)
	}
	return t, nil
}

// ListTemplates lists every template.
func (c *Client) ListTemplates(ctx context.Context) ([]*kilnpb.Template, error) {
	resp, err := c.api.ListTemplates(ctx, &kilnpb.ListTemplatesRequest{})
	if err != nil {
		return nil, callErr("list templates", err)
	}
	return resp.GetTemplates(), nil
}

// DeleteTemplate deletes a template. With wait it returns once the
// sandboxes created from it are gone; without, it is refused
// (FailedPrecondition) while any remain.
func (c *Client) DeleteTemplate(ctx context.Context, id string, wait bool) error {
	if _, err := c.api.DeleteTemplate(ctx, &kilnpb.DeleteTemplateRequest{Id: id, Wait: wait}); err != nil {
		return callErr(fmt.Sprintf("delete template %s", id), err)
	}
	return nil
}
