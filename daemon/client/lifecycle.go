package client

import (
	"context"
	"fmt"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// HibernateSandbox writes a sandbox's whole state to the daemon's disk
// and stops its VM, freeing its memory; ResumeSandbox restores it under
// the same ID, its processes and files as they were. Its lifetime
// stands still meanwhile. Hibernating a hibernated sandbox changes
// nothing.
func (c *Client) HibernateSandbox(ctx context.Context, id string) (*kilnpb.Sandbox, error) {
	sb, err := c.api.PauseSandbox(ctx, &kilnpb.PauseSandboxRequest{Id: id, Hibernate: true})
	if err != nil {
		return nil, callErr(fmt.Sprintf("hibernate sandbox %s", id), err)
	}
	return sb, nil
}

// HibernateSandboxFiles hibernates sandbox id keeping only its image
// root's files, not its memory: a resume boots it again with them, its
// processes gone.
func (c *Client) HibernateSandboxFiles(ctx context.Context, id string) (*kilnpb.Sandbox, error) {
	sb, err := c.api.PauseSandbox(ctx, &kilnpb.PauseSandboxRequest{Id: id, Hibernate: true, FilesOnly: true})
	if err != nil {
		return nil, callErr(fmt.Sprintf("hibernate sandbox %s keeping its files", id), err)
	}
	return sb, nil
}

// UpdateOptions are what UpdateSandbox changes; nil fields stay as
// they are.
type UpdateOptions struct {
	// Lifetime, when set, ends the sandbox this long from now; a
	// negative one never (it must not be 0).
	Lifetime *time.Duration
	// TimeoutAction, when set, is what its lifetime's end does.
	TimeoutAction *kilnpb.TimeoutAction
	// Labels, when not nil, replace its labels (an empty map clears
	// them).
	Labels map[string]string
}

// UpdateSandbox changes a live sandbox's lifetime, timeout action or
// labels and returns it.
func (c *Client) UpdateSandbox(ctx context.Context, id string, opts UpdateOptions) (*kilnpb.Sandbox, error) {
	req := &kilnpb.UpdateSandboxRequest{Id: id, TimeoutAction: opts.TimeoutAction}
	if opts.Lifetime != nil {
		ms := opts.Lifetime.Milliseconds()
		if *opts.Lifetime < 0 {
			ms = -1
		} else if ms == 0 && *opts.Lifetime > 0 {
			ms = 1 // under a millisecond: the shortest there is
		}
		req.LifetimeMs = &ms
	}
	if opts.Labels != nil {
		req.SetLabels, req.Labels = true, opts.Labels
	}
	sb, err := c.api.UpdateSandbox(ctx, req)
	if err != nil {
		return nil, callErr(fmt.Sprintf("update sandbox %s", id), err)
	}
	return sb, nil
}

// SandboxMetrics returns a sandbox's resource samples taken at or after
// since (the zero time: all the daemon keeps), oldest first, the last
// one taken at the call when the sandbox runs.
func (c *Client) SandboxMetrics(ctx context.Context, id string, since time.Time) ([]*kilnpb.SandboxMetrics, error) {
	req := &kilnpb.GetSandboxMetricsRequest{Id: id}
	if !since.IsZero() {
		req.SinceUnixMs = since.UnixMilli()
	}
	resp, err := c.api.GetSandboxMetrics(ctx, req)
	if err != nil {
		return nil, callErr(fmt.Sprintf("metrics of sandbox %s", id), err)
	}
	return resp.GetSamples(), nil
}
