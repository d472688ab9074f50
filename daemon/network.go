package daemon

import (
	"context"
	"fmt"
	"net/netip"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/hostnet"
)

// Network is the host side of the sandboxes' networks, which the server
// drives when Config.Network is set (package hostnet's Manager is one,
// through HostNetwork): each sandbox, template builder, pool sandbox and
// fork child gets an attachment of its own, named by an ID (the sandbox's
// ID, or its folder's name before it has one): a network namespace with a
// tap for its VMM process, an address block, and the egress policy. Its
// methods are safe for concurrent use.
type Network interface {
	// Attach makes id's attachment with policy p; a failed Attach leaves
	// nothing behind.
	Attach(ctx context.Context, id string, p EgressPolicy) (NetInfo, error)
	// Adopt takes over the attachment id a previous server made (after a
	// restart of kilnd).
	Adopt(ctx context.Context, id string) (NetInfo, error)
	// SetPolicy replaces id's policy at once, for its new connections.
	SetPolicy(ctx context.Context, id string, p EgressPolicy) error
	// Detach removes id's attachment; detaching one that is gone succeeds.
	Detach(ctx context.Context, id string) error
	// List returns the IDs of the attachments there are.
	List() []string
}

// EgressMode is what an EgressPolicy does with traffic its lists do not
// name (the values of hostnet.Mode).
type EgressMode int

// The egress modes.
const (
	EgressAllowAll EgressMode = iota
	EgressDenyAll
	EgressAllowList
	EgressDenyList
)

func (m EgressMode) String() string {
	switch m {
	case EgressAllowAll:
		return "allow-all"
	case EgressDenyAll:
		return "deny-all"
	case EgressAllowList:
		return "allow-list"
	case EgressDenyList:
		return "deny-list"
	}
	return fmt.Sprintf("EgressMode(%d)", int(m))
}

// ParseEgressMode reads a mode's name (kilnd's --egress-default).
func ParseEgressMode(s string) (EgressMode, error) {
	for m := EgressAllowAll; m <= EgressDenyList; m++ {
		if s == m.String() {
			return m, nil
		}
	}
	return 0, fmt.Errorf("egress mode %q: want allow-all, deny-all, allow-list or deny-list", s)
}

// EgressPolicy says where a sandbox may connect: kiln.v1's EgressPolicy,
// checked (plain data: the records keep it).
type EgressPolicy struct {
	Mode    EgressMode     `json:"mode"`
	CIDRs   []netip.Prefix `json:"cidrs,omitempty"`
	Domains []string       `json:"domains,omitempty"`
}

// Bounds of an egress policy: hostnet's, which enforces them.
const (
	maxEgressCIDRs   = hostnet.MaxCIDRs
	maxEgressDomains = hostnet.MaxDomains
)

// NetInfo is a sandbox's attachment as the host made it.
type NetInfo struct {
	Netns   string       `json:"netns"`   // the network namespace (a path)
	Tap     string       `json:"tap"`     // the tap in it
	MAC     string       `json:"mac"`     // the guest's MAC
	Address netip.Prefix `json:"address"` // the guest's address and prefix
	Gateway netip.Addr   `json:"gateway"` // its gateway and DNS server
	MTU     int          `json:"mtu,omitempty"`
}

// netRecord is what a sandbox's record keeps of its network: the
// attachment's ID (the sandbox's own, or the pool sandbox's it was), what
// it is, and the policy in force.
type netRecord struct {
	ID     string       `json:"id"`
	Info   NetInfo      `json:"info"`
	Egress EgressPolicy `json:"egress"`
}

func (n *netRecord) clone() *netRecord {
	if n == nil {
		return nil
	}
	c := *n
	c.Egress = n.Egress.clone()
	return &c
}

func (p EgressPolicy) clone() EgressPolicy {
	p.CIDRs = append([]netip.Prefix(nil), p.CIDRs...)
	p.Domains = append([]string(nil), p.Domains...)
	return p
}

// checkEgress checks p, naming what is wrong in field's terms.
func checkEgress(field string, p EgressPolicy) error {
	switch p.Mode {
	case EgressAllowAll, EgressDenyAll:
		if len(p.CIDRs) > 0 || len(p.Domains) > 0 {
			return status.Errorf(codes.InvalidArgument, "%s: mode %v takes no cidrs or domains (got %d and %d)", field, p.Mode, len(p.CIDRs), len(p.Domains))
		}
	case EgressAllowList, EgressDenyList:
	default:
		return status.Errorf(codes.InvalidArgument, "%s.mode %d: not a mode", field, int(p.Mode))
	}
	if len(p.CIDRs) > maxEgressCIDRs {
		return status.Errorf(codes.InvalidArgument, "%s.cidrs has %d entries: at most %d", field, len(p.CIDRs), maxEgressCIDRs)
	}
	if len(p.Domains) > maxEgressDomains {
		return status.Errorf(codes.InvalidArgument, "%s.domains has %d entries: at most %d", field, len(p.Domains), maxEgressDomains)
	}
	for i, c := range p.CIDRs {
		if !c.IsValid() || !c.Addr().Is4() {
			return status.Errorf(codes.InvalidArgument, "%s.cidrs[%d] %v: want an IPv4 prefix (sandboxes have no IPv6 egress)", field, i, c)
		}
	}
	for i, d := range p.Domains {
		if err := hostnet.CheckDomain(d); err != nil {
			return status.Errorf(codes.InvalidArgument, "%s.domains[%d] %q: %v", field, i, d, err)
		}
	}
	return nil
}

// egressFromProto reads and checks a request's policy; field names it in
// errors ("egress").
func egressFromProto(field string, pb *kilnpb.EgressPolicy) (EgressPolicy, error) {
	mode := pb.GetMode()
	if _, ok := kilnpb.EgressPolicy_Mode_name[int32(mode)]; !ok {
		return EgressPolicy{}, status.Errorf(codes.InvalidArgument, "%s.mode %d: not a mode", field, mode)
	}
	p := EgressPolicy{Mode: EgressMode(mode)}
	if n := len(pb.GetCidrs()); n > maxEgressCIDRs {
		return EgressPolicy{}, status.Errorf(codes.InvalidArgument, "%s.cidrs has %d entries: at most %d", field, n, maxEgressCIDRs)
	}
	for i, c := range pb.GetCidrs() {
		pr, err := netip.ParsePrefix(c)
		if err != nil {
			a, aerr := netip.ParseAddr(c)
			if aerr != nil || a.Zone() != "" {
				return EgressPolicy{}, status.Errorf(codes.InvalidArgument, "%s.cidrs[%d] %q: want a prefix (10.0.0.0/8) or an address", field, i, c)
			}
			pr = netip.PrefixFrom(a, a.BitLen())
		}
		p.CIDRs = append(p.CIDRs, pr.Masked())
	}
	p.Domains = append(p.Domains, pb.GetDomains()...)
	if err := checkEgress(field, p); err != nil {
		return EgressPolicy{}, err
	}
	return p, nil
}

func egressProto(p EgressPolicy) *kilnpb.EgressPolicy {
	pb := &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_Mode(p.Mode), Domains: append([]string(nil), p.Domains...)}
	for _, c := range p.CIDRs {
		pb.Cidrs = append(pb.Cidrs, c.String())
	}
	return pb
}

func netProto(n *netRecord) *kilnpb.NetworkInfo {
	if n == nil {
		return nil
	}
	pb := &kilnpb.NetworkInfo{Mac: n.Info.MAC, Netns: n.Info.Netns, Tap: n.Info.Tap, Egress: egressProto(n.Egress)}
	if n.Info.Address.IsValid() {
		pb.Address = n.Info.Address.String()
	}
	if n.Info.Gateway.IsValid() {
		pb.Gateway = n.Info.Gateway.String()
	}
	return pb
}

// netFlag is the kilnd flag that gives the server a Network.
const netFlag = "--net-pool"

// requestEgress is the policy a request's egress field (named field)
// asks for: its own, or the server's default when unset. A policy when
// the server has no network is FailedPrecondition.
func (s *Server) requestEgress(field string, pb *kilnpb.EgressPolicy) (EgressPolicy, error) {
	if pb == nil {
		return s.cfg.DefaultEgress.clone(), nil
	}
	if s.cfg.Network == nil {
		return EgressPolicy{}, status.Errorf(codes.FailedPrecondition, "%s: kilnd runs without sandbox networks (start it with %s)", field, netFlag)
	}
	return egressFromProto(field, pb)
}

// sourceNet checks that a sandbox from a source (what: "template X"),
// which has a network card or not (hasNIC), can be made as the request
// asks (egress set or not), and says whether it gets a network.
func (s *Server) sourceNet(what string, hasNIC, egressSet bool) (bool, error) {
	switch {
	case hasNIC && s.cfg.Network == nil:
		return false, status.Errorf(codes.FailedPrecondition, "%s has a network card, and kilnd runs without sandbox networks now (start it with %s)", what, netFlag)
	case !hasNIC && egressSet:
		return false, status.Errorf(codes.FailedPrecondition, "egress: %s was made without a network card: a sandbox from it has no network", what)
	}
	return hasNIC, nil
}

// netTimeout bounds an attachment's setup or removal.
const netTimeout = time.Minute

// attachNet makes the attachment id with policy p.
func (s *Server) attachNet(ctx context.Context, id string, p EgressPolicy) (*netRecord, error) {
	ctx, cancel := context.WithTimeout(ctx, netTimeout)
	defer cancel()
	info, err := s.cfg.Network.Attach(ctx, id, p)
	if err != nil {
		return nil, callErr("network of "+id, err)
	}
	return &netRecord{ID: id, Info: info, Egress: p.clone()}, nil
}

// detachNet removes n's attachment (nil: none), once the VMM process on
// its tap is gone. A failure is logged: the next server's start prunes
// what is left.
func (s *Server) detachNet(n *netRecord) {
	if n == nil || s.cfg.Network == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), netTimeout)
	defer cancel()
	if err := s.cfg.Network.Detach(ctx, n.ID); err != nil {
		s.log.Warn("network not removed", "attachment", n.ID, "err", err)
	}
}

// hostSpec is what a sandbox on n gets of the host.
func hostSpec(n *netRecord) HostSpec {
	if n == nil {
		return HostSpec{}
	}
	return HostSpec{Net: &NetSpec{Tap: n.Info.Tap, Netns: n.Info.Netns, MAC: n.Info.MAC}}
}

// configureNet gives inst's guest n's settings (nil: none to give).
func configureNet(ctx context.Context, inst Instance, n *netRecord) error {
	if n == nil {
		return nil
	}
	cfg := NetworkConfig{MAC: n.Info.MAC, Addresses: []netip.Prefix{n.Info.Address},
		Gateway: n.Info.Gateway, MTU: n.Info.MTU}
	if n.Info.Gateway.IsValid() {
		cfg.Nameservers = []netip.Addr{n.Info.Gateway}
	}
	if err := inst.ConfigureNetwork(ctx, cfg); err != nil {
		return fmt.Errorf("configure the guest's network: %w", err)
	}
	return nil
}

// createNet starts a sandbox of spec on n (nil: none) and configures its
// guest's network; a failure closes it.
func (s *Server) createNet(ctx context.Context, spec CreateSpec, n *netRecord) (Instance, error) {
	spec.Host.Net = hostSpec(n).Net
	inst, err := s.create(ctx, spec)
	if err != nil {
		return nil, err
	}
	if err := configureNet(ctx, inst, n); err != nil {
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		inst.Close(cctx)
		cancel()
		return nil, err
	}
	return inst, nil
}

// UpdateNetworkPolicy replaces a live sandbox's egress policy at once.
func (s *Server) UpdateNetworkPolicy(ctx context.Context, req *kilnpb.UpdateNetworkPolicyRequest) (*kilnpb.Sandbox, error) {
	b, err := s.lookup(req.GetId())
	if err != nil {
		return nil, err
	}
	if req.GetEgress() == nil {
		return nil, status.Error(codes.InvalidArgument, "egress is unset: give the new policy")
	}
	p, err := s.requestEgress("egress", req.GetEgress())
	if err != nil {
		return nil, err
	}
	select {
	case <-b.ready:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.life.check(updateOp); err != nil {
		return nil, err
	}
	if b.rec.Net == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "sandbox %s has no network (its source was made without a network card)", b.id)
	}
	// b.mu is held: updates of one sandbox apply in the order recorded.
	sctx, cancel := context.WithTimeout(ctx, netTimeout)
	err = s.cfg.Network.SetPolicy(sctx, b.rec.Net.ID, p)
	cancel()
	if err != nil {
		return nil, callErr("update the network policy of sandbox "+b.id, err)
	}
	b.rec.Net.Egress = p
	s.persistLocked(b)
	s.log.Info("egress policy updated", "sandbox", b.id, "mode", p.Mode.String(), "cidrs", len(p.CIDRs), "domains", len(p.Domains))
	return s.protoLocked(b), nil
}

// adoptNet takes over the attachment of b, a live sandbox of a previous
// server that came back. Without it the sandbox runs on, its network
// broken: that is logged.
func (s *Server) adoptNet(b *box) {
	b.mu.Lock()
	n := b.rec.Net.clone()
	b.mu.Unlock()
	if n == nil {
		return
	}
	if s.cfg.Network == nil {
		s.log.Warn("sandbox has a network, and kilnd runs without sandbox networks now: its network is not managed", "sandbox", b.id, "flag", netFlag)
		return
	}
	ctx, cancel := context.WithTimeout(s.ctx, netTimeout)
	defer cancel()
	info, err := s.cfg.Network.Adopt(ctx, n.ID)
	if err != nil {
		s.log.Warn("sandbox's network not taken over after a kilnd restart", "sandbox", b.id, "attachment", n.ID, "err", err)
		return
	}
	if info != n.Info {
		s.log.Warn("sandbox's network differs from its record; the record follows it", "sandbox", b.id, "attachment", n.ID)
		b.mu.Lock()
		b.rec.Net.Info = info
		s.persistLocked(b)
		b.mu.Unlock()
	}
}

// pruneNets removes the attachments no live sandbox has: those of
// sandboxes that ended while kilnd was down, of a previous server's pools
// and template builders, of a create cut short.
func (s *Server) pruneNets() {
	if s.cfg.Network == nil {
		return
	}
	s.mu.Lock()
	keep := map[string]bool{}
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.life.get().live() && b.rec.Net != nil {
			keep[b.rec.Net.ID] = true
		}
		b.mu.Unlock()
	}
	s.mu.Unlock()
	for _, id := range s.cfg.Network.List() {
		if keep[id] {
			continue
		}
		s.log.Info("removing a network no sandbox has", "attachment", id)
		s.detachNet(&netRecord{ID: id})
	}
}
