package daemon

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/hostnet"
)

// HostNetwork is the Network of m: each sandbox's network namespace, tap,
// address block, NAT, nftables egress policy and DNS proxy on this host.
// Its errors carry codes: a bad policy InvalidArgument, an exhausted
// address pool ResourceExhausted, an attachment that is not there
// NotFound.
func HostNetwork(m *hostnet.Manager) Network { return hostNetwork{m} }

type hostNetwork struct{ m *hostnet.Manager }

func (h hostNetwork) Attach(ctx context.Context, id string, p EgressPolicy) (NetInfo, error) {
	info, err := h.m.Attach(ctx, id, hostPolicy(p))
	return NetInfo(info), hostErr(err)
}

func (h hostNetwork) Adopt(ctx context.Context, id string) (NetInfo, error) {
	info, err := h.m.Adopt(ctx, id)
	return NetInfo(info), hostErr(err)
}

func (h hostNetwork) SetPolicy(ctx context.Context, id string, p EgressPolicy) error {
	return hostErr(h.m.SetPolicy(ctx, id, hostPolicy(p)))
}

func (h hostNetwork) Detach(ctx context.Context, id string) error {
	return hostErr(h.m.Detach(ctx, id))
}

func (h hostNetwork) List() []string { return h.m.List() }

// hostPolicy is p in hostnet's terms (the modes have the same values).
func hostPolicy(p EgressPolicy) hostnet.Policy {
	return hostnet.Policy{Mode: hostnet.Mode(p.Mode), CIDRs: p.CIDRs, Domains: p.Domains}
}

// hostErr gives hostnet's errors the codes a caller tells them apart by.
func hostErr(err error) error {
	if err == nil {
		return nil
	}
	code := codes.Internal
	switch {
	case errors.Is(err, hostnet.ErrPolicy):
		code = codes.InvalidArgument
	case errors.Is(err, hostnet.ErrPoolExhausted):
		code = codes.ResourceExhausted
	case errors.Is(err, hostnet.ErrNotFound):
		code = codes.NotFound
	case errors.Is(err, hostnet.ErrExists):
		code = codes.AlreadyExists
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return err
	}
	return status.Error(code, err.Error())
}
