package hostnet

import (
	"encoding/binary"
	"net/netip"
	"slices"
)

// DefaultRefused are the destinations no sandbox reaches unless its allow
// list names them explicitly, whatever its egress mode: the IPv4 ranges of
// IANA's special-purpose registry that are not globally reachable. They
// hold a cloud's metadata service (169.254.169.254: instance credentials
// on GCP, Azure and AWS's IMDSv1), the host's LAN and its other private
// networks (databases, a Kubernetes API), the carrier's and the host's own
// addresses. Config.Refused replaces the list (kilnd: --net-refuse).
var DefaultRefused = []netip.Prefix{
	netip.MustParsePrefix("0.0.0.0/8"),          // "this network"
	netip.MustParsePrefix("10.0.0.0/8"),         // private (RFC 1918)
	netip.MustParsePrefix("100.64.0.0/10"),      // shared address space, CGNAT (RFC 6598)
	netip.MustParsePrefix("127.0.0.0/8"),        // loopback
	netip.MustParsePrefix("169.254.0.0/16"),     // link-local: cloud metadata services
	netip.MustParsePrefix("172.16.0.0/12"),      // private (RFC 1918)
	netip.MustParsePrefix("192.0.0.0/24"),       // IETF protocol assignments
	netip.MustParsePrefix("192.0.2.0/24"),       // documentation (TEST-NET-1)
	netip.MustParsePrefix("192.88.99.0/24"),     // 6to4 relay anycast (deprecated)
	netip.MustParsePrefix("192.168.0.0/16"),     // private (RFC 1918)
	netip.MustParsePrefix("198.18.0.0/15"),      // benchmarking
	netip.MustParsePrefix("198.51.100.0/24"),    // documentation (TEST-NET-2)
	netip.MustParsePrefix("203.0.113.0/24"),     // documentation (TEST-NET-3)
	netip.MustParsePrefix("224.0.0.0/4"),        // multicast
	netip.MustParsePrefix("240.0.0.0/4"),        // reserved, and the broadcast address
	netip.MustParsePrefix("255.255.255.255/32"), // limited broadcast (inside 240/4; named for the reader)
}

// span is an inclusive range of IPv4 addresses as numbers; hi may be one
// past the last address (1<<32) only while computing.
type span struct{ lo, hi uint64 }

func prefixSpan(p netip.Prefix) span {
	p = p.Masked()
	a := p.Addr().As4()
	lo := uint64(binary.BigEndian.Uint32(a[:]))
	return span{lo: lo, hi: lo + 1<<(32-p.Bits()) - 1}
}

// merged sorts spans and joins the ones that overlap or touch.
func merged(s []span) []span {
	s = slices.Clone(s)
	slices.SortFunc(s, func(a, b span) int {
		switch {
		case a.lo < b.lo:
			return -1
		case a.lo > b.lo:
			return 1
		}
		return 0
	})
	var out []span
	for _, x := range s {
		if n := len(out); n > 0 && x.lo <= out[n-1].hi+1 {
			out[n-1].hi = max(out[n-1].hi, x.hi)
			continue
		}
		out = append(out, x)
	}
	return out
}

// refusedSpans is what a sandbox under policy p may not reach: refused
// less what p's allow list names explicitly. An allow-list CIDR exempts
// only a part of a refused range: one at least as long as the range's
// prefix and inside it (10.1.2.0/24 or 10.0.0.0/8 itself exempts that
// part of 10.0.0.0/8; 0.0.0.0/0 exempts nothing). Other modes exempt
// nothing. The result is sorted and disjoint.
func refusedSpans(refused []netip.Prefix, p Policy) []span {
	var r []span
	for _, q := range refused {
		r = append(r, prefixSpan(q))
	}
	r = merged(r)
	if p.Mode != AllowList {
		return r
	}
	var ex []span
	for _, c := range p.CIDRs {
		for _, q := range refused {
			if c.Bits() >= q.Bits() && q.Contains(c.Addr()) {
				ex = append(ex, prefixSpan(c))
				break
			}
		}
	}
	for _, e := range merged(ex) {
		var out []span
		for _, x := range r {
			if e.hi < x.lo || e.lo > x.hi {
				out = append(out, x)
				continue
			}
			if x.lo < e.lo {
				out = append(out, span{x.lo, e.lo - 1})
			}
			if x.hi > e.hi {
				out = append(out, span{e.hi + 1, x.hi})
			}
		}
		r = out
	}
	return r
}

// inSpans reports whether a (IPv4) is in one of s.
func inSpans(s []span, a netip.Addr) bool {
	if !a.Is4() {
		return false
	}
	b := a.As4()
	v := uint64(binary.BigEndian.Uint32(b[:]))
	for _, x := range s {
		if v >= x.lo && v <= x.hi {
			return true
		}
	}
	return false
}
