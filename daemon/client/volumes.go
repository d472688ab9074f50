package client

import (
	"context"
	"fmt"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// CreateVolume makes a volume: an ext4 file system kilnd keeps outside
// any sandbox, which CreateSandboxRequest.Volumes mounts.
func (c *Client) CreateVolume(ctx context.Context, req *kilnpb.CreateVolumeRequest) (*kilnpb.Volume, error) {
	v, err := c.api.CreateVolume(ctx, req)
	if err != nil {
		return nil, callErr("create volume", err)
	}
	return v, nil
}

// GetVolume returns a volume by ID or name, with the sandboxes that
// mount it.
func (c *Client) GetVolume(ctx context.Context, id string) (*kilnpb.Volume, error) {
	v, err := c.api.GetVolume(ctx, &kilnpb.GetVolumeRequest{Id: id})
	if err != nil {
		return nil, callErr(fmt.Sprintf("get volume %s", id), err)
	}
	return v, nil
}

// ListVolumes lists the volumes with all of labels (nil: every one).
func (c *Client) ListVolumes(ctx context.Context, labels map[string]string) ([]*kilnpb.Volume, error) {
	resp, err := c.api.ListVolumes(ctx, &kilnpb.ListVolumesRequest{Labels: labels})
	if err != nil {
		return nil, callErr("list volumes", err)
	}
	return resp.GetVolumes(), nil
}

// DeleteVolume deletes a volume and its files; refused
// (FailedPrecondition) while a sandbox that has not ended mounts it.
func (c *Client) DeleteVolume(ctx context.Context, id string) error {
	if _, err := c.api.DeleteVolume(ctx, &kilnpb.DeleteVolumeRequest{Id: id}); err != nil {
		return callErr(fmt.Sprintf("delete volume %s", id), err)
	}
	return nil
}
