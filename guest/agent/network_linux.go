package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/filetree"
	"github.com/kilnvm/kiln/guest/agentpb"
)

// Limits of a ConfigureNetwork request.
const (
	maxNetAddresses   = 16
	maxNameservers    = 3 // what the resolver reads (MAXNS)
	minMTU, maxMTU    = 68, 65535
	defaultResolvConf = "/etc/resolv.conf"
)

// netRequest is a validated ConfigureNetwork request.
type netRequest struct {
	iface       string
	mac         net.HardwareAddr // nil: keep
	addrs       []netip.Prefix
	gateway     netip.Addr // invalid: no default route
	mtu         int        // 0: keep
	nameservers []netip.Addr
}

// parseNetworkRequest checks every field of req, naming the one that is
// wrong. The host is trusted more than the guest, but a bad request is
// still an error, never a panic or a half-applied change.
func parseNetworkRequest(req *agentpb.ConfigureNetworkRequest) (*netRequest, error) {
	r := &netRequest{iface: req.GetInterface(), mtu: int(req.GetMtu())}
	if n := r.iface; n != "" {
		if len(n) >= unix.IFNAMSIZ || n == "." || n == ".." || strings.ContainsAny(n, "/: \t\n\x00") {
			return nil, invalidf("configure network: interface %s: want a name of 1 to %d bytes without '/', ':' or whitespace", quoteShort(n), unix.IFNAMSIZ-1)
		}
	}
	if m := req.GetMac(); m != "" {
		mac, err := net.ParseMAC(m)
		if err != nil || len(mac) != 6 {
			return nil, invalidf("configure network: mac %s: want six bytes, aa:bb:cc:dd:ee:ff", quoteShort(m))
		}
		if mac[0]&1 != 0 || string(mac) == "\x00\x00\x00\x00\x00\x00" {
			return nil, invalidf("configure network: mac %s: want a unicast address other than zero", m)
		}
		r.mac = mac
	}
	if r.mtu != 0 && (r.mtu < minMTU || r.mtu > maxMTU) {
		return nil, invalidf("configure network: mtu %d: want %d to %d (0 keeps the link's)", r.mtu, minMTU, maxMTU)
	}
	addrs := req.GetAddresses()
	if len(addrs) == 0 {
		return nil, invalidf("configure network: addresses is empty: want at least one address with its prefix (10.200.0.2/30)")
	}
	if len(addrs) > maxNetAddresses {
		return nil, invalidf("configure network: addresses has %d entries: at most %d", len(addrs), maxNetAddresses)
	}
	for i, a := range addrs {
		p, err := netip.ParsePrefix(a)
		if err != nil {
			return nil, invalidf("configure network: addresses[%d] %s: want an address with its prefix (10.200.0.2/30)", i, quoteShort(a))
		}
		ip := p.Addr()
		if ip.Zone() != "" || ip.IsUnspecified() || ip.IsLoopback() || ip.IsMulticast() || ip.Is4In6() {
			return nil, invalidf("configure network: addresses[%d] %s: not an address for a network card", i, a)
		}
		if ip.Is4() && p.Bits() < 32 && (ip == p.Masked().Addr() || ip == lastAddr(p)) {
			return nil, invalidf("configure network: addresses[%d] %s: the network's or broadcast address of its prefix", i, a)
		}
		for _, o := range r.addrs {
			if o.Addr() == ip {
				return nil, invalidf("configure network: addresses[%d] %s: given twice", i, a)
			}
		}
		r.addrs = append(r.addrs, p)
	}
	if g := req.GetGateway(); g != "" {
		gw, err := netip.ParseAddr(g)
		if err != nil || gw.Zone() != "" || gw.IsUnspecified() || gw.IsMulticast() || gw.Is4In6() {
			return nil, invalidf("configure network: gateway %s: want a unicast address", quoteShort(g))
		}
		in := false
		for _, p := range r.addrs {
			if p.Addr() == gw {
				return nil, invalidf("configure network: gateway %s is one of the addresses", g)
			}
			in = in || p.Contains(gw)
		}
		if !in {
			return nil, invalidf("configure network: gateway %s is in none of the addresses' prefixes: the guest could not reach it", g)
		}
		r.gateway = gw
	}
	ns := req.GetNameservers()
	if len(ns) > maxNameservers {
		return nil, invalidf("configure network: nameservers has %d entries: the resolver reads at most %d", len(ns), maxNameservers)
	}
	for i, n := range ns {
		a, err := netip.ParseAddr(n)
		if err != nil || a.Zone() != "" || a.IsUnspecified() || a.IsMulticast() {
			return nil, invalidf("configure network: nameservers[%d] %s: want a unicast address", i, quoteShort(n))
		}
		r.nameservers = append(r.nameservers, a)
	}
	return r, nil
}

// lastAddr is the last address of p (an IPv4 prefix's broadcast).
func lastAddr(p netip.Prefix) netip.Addr {
	b := p.Masked().Addr().As4()
	host := uint32(1)<<(32-p.Bits()) - 1
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3]) | host
	return netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
}

// ConfigureNetwork gives the guest's network card what the host set up for
// it: its MAC, MTU, addresses, default route and nameservers.
func (s *Server) ConfigureNetwork(ctx context.Context, req *agentpb.ConfigureNetworkRequest) (*agentpb.ConfigureNetworkResponse, error) {
	r, err := parseNetworkRequest(req)
	if err != nil {
		return nil, err
	}
	s.netMu.Lock()
	defer s.netMu.Unlock()
	h, err := s.netlinkHandle()
	if err != nil {
		return nil, status.Errorf(codes.Internal, "configure network: %v", err)
	}
	defer h.Close()
	name, err := configureLink(h, r)
	if err != nil {
		return nil, err
	}
	if len(r.nameservers) > 0 {
		path := s.cfg.ResolvConf
		if path == "" {
			path = defaultResolvConf
		}
		if err := writeResolvConf(path, r.nameservers); err != nil {
			return nil, err
		}
	}
	s.log.Info("network configured", "interface", name, "addresses", req.GetAddresses(), "gateway", req.GetGateway(), "mac", req.GetMac())
	return &agentpb.ConfigureNetworkResponse{Interface: name}, nil
}

// netlinkHandle is a route netlink handle in the namespace the agent
// configures (Config.NetworkNamespace, else its own). Route only: a guest
// kernel without xfrm_user has no NETLINK_XFRM, which a handle of every
// family would open.
func (s *Server) netlinkHandle() (*netlink.Handle, error) {
	if s.cfg.NetworkNamespace == "" {
		return netlink.NewHandle(unix.NETLINK_ROUTE)
	}
	ns, err := netns.GetFromPath(s.cfg.NetworkNamespace)
	if err != nil {
		return nil, fmt.Errorf("network namespace %s: %w", s.cfg.NetworkNamespace, err)
	}
	defer ns.Close()
	return netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
}

// netErr turns a netlink error of step on iface into a status.
func netErr(step, iface string, err error) error {
	code := codes.Internal
	if errno := errnoOf(err); errno != 0 {
		code = filetree.Code(errno)
	}
	return status.Errorf(code, "configure network: %s %s: %v", step, iface, err)
}

// configureLink applies r to its link: down, MAC and MTU, addresses and
// neighbours flushed, up, the new addresses and the default route.
func configureLink(h *netlink.Handle, r *netRequest) (string, error) {
	link, err := findLink(h, r.iface)
	if err != nil {
		return "", err
	}
	name := link.Attrs().Name
	if err := h.LinkSetDown(link); err != nil {
		return name, netErr("set down", name, err)
	}
	if r.mac != nil {
		if err := h.LinkSetHardwareAddr(link, r.mac); err != nil {
			return name, netErr("set the MAC "+r.mac.String()+" of", name, err)
		}
	}
	if r.mtu != 0 {
		if err := h.LinkSetMTU(link, r.mtu); err != nil {
			return name, netErr(fmt.Sprintf("set the MTU %d of", r.mtu), name, err)
		}
	}
	old, err := h.AddrList(link, netlink.FAMILY_ALL)
	if err != nil {
		return name, netErr("list the addresses of", name, err)
	}
	for _, a := range old {
		if a.IP.IsLinkLocalUnicast() && a.IP.To4() == nil {
			continue // the kernel's own IPv6 link-local address
		}
		if err := h.AddrDel(link, &a); err != nil && !errors.Is(err, syscall.EADDRNOTAVAIL) {
			return name, netErr("remove the address "+a.IPNet.String()+" of", name, err)
		}
	}
	// After a restore or fork the gateway is another tap with another
	// MAC: what the guest learnt of the old one goes.
	neighs, err := h.NeighList(link.Attrs().Index, netlink.FAMILY_ALL)
	if err != nil {
		return name, netErr("list the neighbours of", name, err)
	}
	for _, n := range neighs {
		if n.State&netlink.NUD_NOARP != 0 || n.State&netlink.NUD_PERMANENT != 0 {
			continue
		}
		if err := h.NeighDel(&n); err != nil && !errors.Is(err, syscall.ENOENT) {
			return name, netErr("remove the neighbour "+n.IP.String()+" of", name, err)
		}
	}
	if err := h.LinkSetUp(link); err != nil {
		return name, netErr("set up", name, err)
	}
	for _, p := range r.addrs {
		a := &netlink.Addr{IPNet: &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}}
		if err := h.AddrAdd(link, a); err != nil {
			return name, netErr("add the address "+p.String()+" to", name, err)
		}
	}
	if r.gateway.IsValid() {
		family := netlink.FAMILY_V4
		if r.gateway.Is6() {
			family = netlink.FAMILY_V6
		}
		rt := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: r.gateway.AsSlice(), Family: family}
		if err := h.RouteReplace(rt); err != nil {
			return name, netErr("set the default route via "+r.gateway.String()+" on", name, err)
		}
	}
	return name, nil
}

// findLink returns the link named name, or without a name the first
// non-loopback ethernet card (the guest's virtio network card).
func findLink(h *netlink.Handle, name string) (netlink.Link, error) {
	if name != "" {
		l, err := h.LinkByName(name)
		if err != nil {
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) || errors.Is(err, syscall.ENODEV) {
				return nil, status.Errorf(codes.NotFound, "configure network: no interface %q", name)
			}
			return nil, netErr("find", name, err)
		}
		return l, nil
	}
	links, err := h.LinkList()
	if err != nil {
		return nil, netErr("list the", "interfaces", err)
	}
	for _, l := range links {
		a := l.Attrs()
		if a.Flags&net.FlagLoopback == 0 && a.EncapType == "ether" && l.Type() == "device" {
			return l, nil
		}
	}
	return nil, status.Error(codes.NotFound, "configure network: the guest has no ethernet card")
}

// writeResolvConf replaces path with a resolv.conf naming servers: a
// temporary file beside it, synced, renamed over it. A symlink there (a
// resolver daemon's) is not replaced: that is an error saying so.
func writeResolvConf(path string, servers []netip.Addr) error {
	if fi, err := os.Lstat(path); err == nil && fi.Mode()&os.ModeSymlink != 0 {
		target, _ := os.Readlink(path)
		return status.Errorf(codes.FailedPrecondition, "configure network: %s is a symlink to %s: not replaced (point it at a file, or remove it)", path, target)
	}
	var b strings.Builder
	b.WriteString("# Written by kiln-agent: the host's DNS proxy.\n")
	for _, s := range servers {
		fmt.Fprintf(&b, "nameserver %s\n", s)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return resolvErr(path, err)
	}
	f, err := os.CreateTemp(dir, ".resolv.conf.*")
	if err != nil {
		return resolvErr(path, err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // fails harmlessly after the rename
	if _, err := f.WriteString(b.String()); err != nil {
		f.Close()
		return resolvErr(path, err)
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return resolvErr(path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return resolvErr(path, err)
	}
	if err := f.Close(); err != nil {
		return resolvErr(path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return resolvErr(path, err)
	}
	return nil
}

func resolvErr(path string, err error) error {
	if errors.Is(err, syscall.EROFS) {
		return status.Errorf(codes.FailedPrecondition, "configure network: write %s: the guest's root is read-only", path)
	}
	return filetree.Status("configure network: writing", path, err)
}
