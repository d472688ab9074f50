package hostnet

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"
)

// Names in nftables and of links.
const (
	tableName  = "kiln"      // kiln's own table, in the host netns (ip) and each sandbox netns (inet)
	tapName    = "tap0"      // the guest's link, in the sandbox netns
	nsVethName = "veth0"     // the sandbox netns's end of the veth
	vethPrefix = "kiln"      // host end of the veth: vethPrefix + block index
	allowSet   = "allow_dns" // addresses the DNS proxy resolved for an allow list
	denySet    = "deny_dns"  // addresses resolved for a deny list
	refusedSet = "refused"   // destinations refused unless an allow list names them
	// rejectChain is the sandbox table's chain that rejects what jumps
	// to it.
	rejectChain = "reject"
)

// vethName is the host-side name of the veth of block index.
func vethName(index int) string { return fmt.Sprintf("%s%d", vethPrefix, index) }

// ifname matches an interface name: exactly, or (prefix) by its start.
func ifname(key expr.MetaKey, name string, prefix bool, op expr.CmpOp) []expr.Any {
	data := []byte(name)
	if !prefix {
		data = append(data, 0)
	}
	return []expr.Any{
		&expr.Meta{Key: key, Register: 1},
		&expr.Cmp{Op: op, Register: 1, Data: data},
	}
}

// ctEstablished matches packets of established or related connections.
func ctEstablished() []expr.Any {
	return []expr.Any{
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{
			SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED),
			Xor:  binaryutil.NativeEndian.PutUint32(0),
		},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
	}
}

// ipv4 matches IPv4 packets in an inet table.
func ipv4() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyNFPROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{unix.NFPROTO_IPV4}},
	}
}

// Offsets of the IPv4 header's addresses.
const (
	ipSaddr = 12
	ipDaddr = 16
)

// ipIn matches an IPv4 source or destination address (offset) in prefix.
func ipIn(offset uint32, p netip.Prefix) []expr.Any {
	m := prefixMask(p.Bits())
	a := p.Masked().Addr().As4()
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: offset, Len: 4},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4, Mask: m[:], Xor: []byte{0, 0, 0, 0}},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: a[:]},
	}
}

func prefixMask(bits int) [4]byte {
	var m [4]byte
	for i := range bits {
		m[i/8] |= 0x80 >> (i % 8)
	}
	return m
}

// ipNotIn matches an IPv4 source or destination address (offset) outside
// prefix.
func ipNotIn(offset uint32, p netip.Prefix) []expr.Any {
	e := ipIn(offset, p)
	e[len(e)-1].(*expr.Cmp).Op = expr.CmpOpNeq
	return e
}

// notIPv4 matches what is not IPv4 in an inet table.
func notIPv4() []expr.Any {
	e := ipv4()
	e[len(e)-1].(*expr.Cmp).Op = expr.CmpOpNeq
	return e
}

// ipInSet matches an IPv4 destination address in a named set.
func ipInSet(s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: ipDaddr, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID},
	}
}

// dport matches UDP or TCP (proto) to port.
func dport(proto byte, port uint16) []expr.Any {
	return append(l4proto(proto),
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(port)},
	)
}

var (
	accept = []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}
	drop   = []expr.Any{&expr.Verdict{Kind: expr.VerdictDrop}}
	// icmpReject answers with ICMP admin-prohibited (rate-limited by the
	// kernel); tcpReset answers TCP with a reset.
	icmpReject = []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}}
	tcpReset   = []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_TCP_RST}}
	// icmpReject4 is icmpReject in an ip (not inet) table.
	icmpReject4 = []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMP_UNREACH, Code: 13 /* ICMP_PKT_FILTERED */}}
	masq        = []expr.Any{&expr.Masq{}}
	// gotoReject hands a packet to the sandbox table's rejectChain.
	gotoReject = []expr.Any{&expr.Verdict{Kind: expr.VerdictGoto, Chain: rejectChain}}
)

// l4proto matches a transport protocol.
func l4proto(proto byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

// rule queues a rule of the concatenated parts in chain ch.
func rule(c *nftables.Conn, ch *nftables.Chain, parts ...[]expr.Any) {
	var exprs []expr.Any
	for _, p := range parts {
		exprs = append(exprs, p...)
	}
	c.AddRule(&nftables.Rule{Table: ch.Table, Chain: ch, Exprs: exprs})
}

// hostRules queues (in c's batch) the replacement of kiln's table in the
// host netns: masquerade of the pool out of uplink; forwarding of the
// sandboxes' veths to and from elsewhere, never between two of them and
// never from a source outside the pool; no
// new connections into a sandbox and none from a sandbox to the host
// itself. Other tables are left alone.
func hostRules(c *nftables.Conn, pool netip.Prefix, uplink string) {
	t := &nftables.Table{Family: nftables.TableFamilyIPv4, Name: tableName}
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	accepting := nftables.ChainPolicyAccept

	nat := c.AddChain(&nftables.Chain{Name: "postrouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPostrouting, Priority: nftables.ChainPriorityNATSource})
	rule(c, nat, ipIn(ipSaddr, pool), ifname(expr.MetaKeyOIFNAME, uplink, false, expr.CmpOpEq), masq)

	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &accepting})
	// Only the pool's addresses come from a veth (each sandbox netns
	// also checks that its guest sends from its own).
	rule(c, fwd, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), ipNotIn(ipSaddr, pool), drop)
	rule(c, fwd, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), ifname(expr.MetaKeyOIFNAME, vethPrefix, true, expr.CmpOpEq), drop)
	rule(c, fwd, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), accept)
	rule(c, fwd, ifname(expr.MetaKeyOIFNAME, vethPrefix, true, expr.CmpOpEq), ctEstablished(), accept)
	rule(c, fwd, ifname(expr.MetaKeyOIFNAME, vethPrefix, true, expr.CmpOpEq), drop)

	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accepting})
	rule(c, in, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), ctEstablished(), accept)
	// The host's own addresses: refused at once.
	fromVeth := ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq)
	rule(c, in, fromVeth, l4proto(unix.IPPROTO_TCP), tcpReset)
	rule(c, in, fromVeth, icmpReject4)
	rule(c, in, fromVeth, drop)
}

// sandboxTable is kiln's table in a sandbox netns, and its learned sets.
func sandboxTable() (*nftables.Table, *nftables.Set, *nftables.Set) {
	t := &nftables.Table{Family: nftables.TableFamilyINet, Name: tableName}
	// Fixed batch-local IDs: with ID 0, nftables.AddSet numbers sets from a
	// package global, unguarded across connections.
	allow := &nftables.Set{Table: t, ID: 1, Name: allowSet, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	deny := &nftables.Set{Table: t, ID: 2, Name: denySet, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	return t, allow, deny
}

// refusedSetOf is the sandbox table's interval set of refused
// destinations (refusedSpans).
func refusedSetOf(t *nftables.Table) *nftables.Set {
	return &nftables.Set{Table: t, ID: 3, Name: refusedSet, KeyType: nftables.TypeIPAddr, Interval: true}
}

// spanElems are the elements of an interval set holding s (sorted,
// disjoint): a start, and the address after the end flagged as an
// interval's end (none for an interval that runs to 255.255.255.255).
func spanElems(s []span) []nftables.SetElement {
	var out []nftables.SetElement
	for _, x := range s {
		out = append(out, nftables.SetElement{Key: binary.BigEndian.AppendUint32(nil, uint32(x.lo))})
		if x.hi < 1<<32-1 {
			out = append(out, nftables.SetElement{Key: binary.BigEndian.AppendUint32(nil, uint32(x.hi+1)), IntervalEnd: true})
		}
	}
	return out
}

// learnedElem is one learned address with the time left on it.
type learnedElem struct {
	addr netip.Addr
	left time.Duration
}

func elems(l []learnedElem) []nftables.SetElement {
	out := make([]nftables.SetElement, 0, len(l))
	for _, e := range l {
		a := e.addr.As4()
		out = append(out, nftables.SetElement{Key: a[:], Timeout: e.left})
	}
	return out
}

// sandboxRuleset is what kiln's table in a sandbox netns is made of.
type sandboxRuleset struct {
	policy  Policy       // normalized
	pool    netip.Prefix // every sandbox's addresses
	gw      netip.Addr   // the tap's address: the guest's gateway and DNS proxy
	guest   netip.Addr   // the guest's own address: the only source from the tap
	refused []span       // refusedSpans(Config.Refused, policy)
	learned []learnedElem
	// fresh: the netns has no table yet (Attach): nothing to empty, so
	// the batch is shorter.
	fresh bool
}

// sandboxRules queues (in c's batch) kiln's table in a sandbox netns for
// r, carrying over the learned addresses that r's policy keeps. The table,
// its chains and sets are made where missing, otherwise emptied and
// refilled: the batch is one nftables transaction, so the old ruleset
// holds until the new one does, and nothing is deleted (which costs the
// kernel an RCU grace period).
func sandboxRules(c *nftables.Conn, r sandboxRuleset) error {
	p := r.policy
	t, allow, deny := sandboxTable()
	refused := refusedSetOf(t)
	c.AddTable(t)
	for _, s := range []*nftables.Set{allow, deny, refused} {
		if err := c.AddSet(s, nil); err != nil {
			return fmt.Errorf("nftables set %s: %w", s.Name, err)
		}
		if !r.fresh {
			c.FlushSet(s)
		}
	}
	if e := spanElems(r.refused); len(e) > 0 {
		if err := c.SetAddElements(refused, e); err != nil {
			return fmt.Errorf("nftables set %s: %w", refusedSet, err)
		}
	}
	switch l := elems(r.learned); {
	case len(l) == 0:
	case p.Mode == AllowList:
		if err := c.SetAddElements(allow, l); err != nil {
			return fmt.Errorf("nftables set %s: %w", allowSet, err)
		}
	case p.Mode == DenyList:
		if err := c.SetAddElements(deny, l); err != nil {
			return fmt.Errorf("nftables set %s: %w", denySet, err)
		}
	}
	dropping := nftables.ChainPolicyDrop
	fromTap := ifname(expr.MetaKeyIIFNAME, tapName, false, expr.CmpOpEq)
	guest := netip.PrefixFrom(r.guest, 32)

	// One regular chain does the rejecting: a rule that refuses jumps
	// to it, one rule instead of two (fewer rules, a cheaper Attach).
	rej := c.AddChain(&nftables.Chain{Name: rejectChain, Table: t})
	if !r.fresh {
		c.FlushChain(rej)
	}
	rule(c, rej, l4proto(unix.IPPROTO_TCP), tcpReset)
	rule(c, rej, icmpReject)
	refuse := func(ch *nftables.Chain, parts ...[]expr.Any) {
		rule(c, ch, append(parts, gotoReject)...)
	}

	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &dropping})
	if !r.fresh {
		c.FlushChain(fwd)
	}
	// Anti-spoofing first: from the tap only IPv4 from the guest's own
	// address, established or not.
	rule(c, fwd, fromTap, notIPv4(), drop)
	rule(c, fwd, fromTap, ipNotIn(ipSaddr, guest), drop)
	rule(c, fwd, ctEstablished(), accept)
	// Never other sandboxes (nor the veths' addresses), whatever the policy.
	refuse(fwd, fromTap, ipIn(ipDaddr, r.pool))
	if p.Mode == AllowList || p.Mode == DenyList {
		// A list by domain holds only if the guest asks the proxy: no
		// other DNS server, plain or over TLS/QUIC.
		for _, port := range []uint16{53, 853} {
			refuse(fwd, fromTap, dport(unix.IPPROTO_UDP, port))
			refuse(fwd, fromTap, dport(unix.IPPROTO_TCP, port))
		}
	}
	switch p.Mode {
	case AllowAll:
		refuse(fwd, fromTap, ipInSet(refused))
		rule(c, fwd, fromTap, accept)
	case AllowList:
		// A domain's addresses are allowed wherever they are: the
		// policy names the domain.
		rule(c, fwd, fromTap, ipInSet(allow), accept)
		refuse(fwd, fromTap, ipInSet(refused))
		for _, cidr := range p.CIDRs {
			rule(c, fwd, fromTap, ipIn(ipDaddr, cidr), accept)
		}
	case DenyList:
		for _, cidr := range p.CIDRs {
			refuse(fwd, fromTap, ipIn(ipDaddr, cidr))
		}
		refuse(fwd, fromTap, ipInSet(deny))
		refuse(fwd, fromTap, ipInSet(refused))
		rule(c, fwd, fromTap, accept)
	}
	refuse(fwd, fromTap)

	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &dropping})
	if !r.fresh {
		c.FlushChain(in)
	}
	rule(c, in, fromTap, notIPv4(), drop)
	rule(c, in, fromTap, ipNotIn(ipSaddr, guest), drop)
	rule(c, in, ctEstablished(), accept)
	rule(c, in, ifname(expr.MetaKeyIIFNAME, "lo", false, expr.CmpOpEq), accept)
	gwp := netip.PrefixFrom(r.gw, 32)
	rule(c, in, fromTap, ipIn(ipDaddr, gwp), dport(unix.IPPROTO_UDP, 53), accept)
	rule(c, in, fromTap, ipIn(ipDaddr, gwp), dport(unix.IPPROTO_TCP, 53), accept)
	refuse(in, fromTap)

	// Nothing in the netns opens a connection: not the DNS proxy (it asks
	// upstream from the host netns), not a jailed VMM process, whose
	// guest might escape into it. Replies (the proxy's answers, the
	// rejects above) and loopback pass.
	out := c.AddChain(&nftables.Chain{Name: "output", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookOutput, Priority: nftables.ChainPriorityFilter, Policy: &dropping})
	if !r.fresh {
		c.FlushChain(out)
	}
	rule(c, out, ctEstablished(), accept)
	rule(c, out, ifname(expr.MetaKeyOIFNAME, "lo", false, expr.CmpOpEq), accept)
	return nil
}

// learnElems queues adding (or refreshing the timeout of) addresses in a
// learned set: add, delete, add again, so an element that exists gets the
// new timeout and one that does not is not an error.
func learnElems(c *nftables.Conn, deny bool, l []learnedElem) error {
	_, allow, denyS := sandboxTable()
	s := allow
	if deny {
		s = denyS
	}
	e := elems(l)
	if err := c.SetAddElements(s, e); err != nil {
		return err
	}
	if err := c.SetDeleteElements(s, e); err != nil {
		return err
	}
	return c.SetAddElements(s, e)
}
