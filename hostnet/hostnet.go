package hostnet

import (
	"log/slog"
	"net/netip"
)

// Config is a Manager's configuration.
type Config struct {
	// Pool is where sandbox addresses come from (e.g. 10.200.0.0/16): an
	// IPv4 prefix of /8 to /29; each attachment takes a /29 of it.
	Pool netip.Prefix
	// Uplink is the host interface NAT leaves by; "" is the interface of
	// the host netns's IPv4 default route when New runs.
	Uplink string
	// DNS are the upstream servers the proxies ask; nil is
	// /etc/resolv.conf's nameservers. They are asked from the host netns.
	DNS []netip.AddrPort
	// Dir holds the manager's state: records/<id>.json and the pinned
	// namespaces netns/<id>. It must stay the same across restarts.
	Dir string
	// HostNetns is the path of the namespace that plays "the host" (where
	// the veths' host ends, the routes, the NAT and the upstream DNS
	// sockets live); "" is the calling process's.
	HostNetns string
	// Refused are the destinations no sandbox reaches unless its allow
	// list names them (a CIDR inside one of them, or a domain the proxy
	// resolves there), in every egress mode: IPv4 prefixes; nil is
	// DefaultRefused, empty (non-nil) refuses nothing beyond the policy.
	Refused []netip.Prefix
	// Logger gets the manager's lines; nil is slog.Default().
	Logger *slog.Logger
}

// Info is what a VMM and the guest need of an attachment.
type Info struct {
	Netns   string       // path of the pinned netns, where the tap is
	Tap     string       // tap name in it ("tap0")
	MAC     string       // the guest's MAC, aa:bb:cc:dd:ee:ff
	Address netip.Prefix // the guest's address with prefix (a /30)
	Gateway netip.Addr   // the tap's address: the guest's default route and DNS server
	MTU     int
}

// mtu is every attachment's MTU (veth and tap).
const mtu = 1500
