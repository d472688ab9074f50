package hostnet

import (
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
	tableName  = "kiln"     // kiln's own table, in the host netns (ip) and each sandbox netns (inet)
	tapName    = "tap0"     // the guest's link, in the sandbox netns
	nsVethName = "veth0"    // the sandbox netns's end of the veth
	vethPrefix = "kiln"     // host end of the veth: vethPrefix + block index
	allowSet   = "allow_dns" // addresses the DNS proxy resolved for an allow list
	denySet    = "deny_dns"  // addresses resolved for a deny list
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

// ipInSet matches an IPv4 destination address in a named set.
func ipInSet(s *nftables.Set) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: ipDaddr, Len: 4},
		&expr.Lookup{SourceRegister: 1, SetName: s.Name, SetID: s.ID},
	}
}

// dport53 matches UDP or TCP (proto) to port 53.
func dport53(proto byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(53)},
	}
}

var (
	accept = []expr.Any{&expr.Verdict{Kind: expr.VerdictAccept}}
	drop   = []expr.Any{&expr.Verdict{Kind: expr.VerdictDrop}}
	// reject answers the guest at once (ICMP admin-prohibited), so that a
	// forbidden connect fails fast instead of timing out.
	reject = []expr.Any{&expr.Reject{Type: unix.NFT_REJECT_ICMPX_UNREACH, Code: unix.NFT_REJECT_ICMPX_ADMIN_PROHIBITED}}
	masq   = []expr.Any{&expr.Masq{}}
)

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
// sandboxes' veths to and from elsewhere, never between two of them; no
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
	rule(c, fwd, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), ifname(expr.MetaKeyOIFNAME, vethPrefix, true, expr.CmpOpEq), drop)
	rule(c, fwd, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), accept)
	rule(c, fwd, ifname(expr.MetaKeyOIFNAME, vethPrefix, true, expr.CmpOpEq), ctEstablished(), accept)
	rule(c, fwd, ifname(expr.MetaKeyOIFNAME, vethPrefix, true, expr.CmpOpEq), drop)

	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &accepting})
	rule(c, in, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), ctEstablished(), accept)
	rule(c, in, ifname(expr.MetaKeyIIFNAME, vethPrefix, true, expr.CmpOpEq), drop)
}

// sandboxTable is kiln's table in a sandbox netns, and its learned sets.
func sandboxTable() (*nftables.Table, *nftables.Set, *nftables.Set) {
	t := &nftables.Table{Family: nftables.TableFamilyINet, Name: tableName}
	allow := &nftables.Set{Table: t, Name: allowSet, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	deny := &nftables.Set{Table: t, Name: denySet, KeyType: nftables.TypeIPAddr, HasTimeout: true}
	return t, allow, deny
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

// sandboxRules queues (in c's batch) the replacement of kiln's table in a
// sandbox netns with the egress policy p (normalized) for the guest on tap0
// with gateway gw, carrying over the learned addresses that p keeps. The
// batch is one nftables transaction: the old ruleset holds until the new
// one does.
func sandboxRules(c *nftables.Conn, p Policy, pool netip.Prefix, gw netip.Addr, learned []learnedElem) error {
	t, allow, deny := sandboxTable()
	c.AddTable(t)
	c.DelTable(t)
	c.AddTable(t)
	var allowElems, denyElems []nftables.SetElement
	switch p.Mode {
	case AllowList:
		allowElems = elems(learned)
	case DenyList:
		denyElems = elems(learned)
	}
	if err := c.AddSet(allow, allowElems); err != nil {
		return fmt.Errorf("nftables set %s: %w", allowSet, err)
	}
	if err := c.AddSet(deny, denyElems); err != nil {
		return fmt.Errorf("nftables set %s: %w", denySet, err)
	}
	dropping := nftables.ChainPolicyDrop
	fromTap := ifname(expr.MetaKeyIIFNAME, tapName, false, expr.CmpOpEq)

	fwd := c.AddChain(&nftables.Chain{Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &dropping})
	rule(c, fwd, ctEstablished(), accept)
	// Never other sandboxes (nor the veths' addresses), whatever the policy.
	rule(c, fwd, fromTap, ipv4(), ipIn(ipDaddr, pool), reject)
	switch p.Mode {
	case AllowAll:
		rule(c, fwd, fromTap, ipv4(), accept)
	case AllowList:
		for _, cidr := range p.CIDRs {
			rule(c, fwd, fromTap, ipv4(), ipIn(ipDaddr, cidr), accept)
		}
		rule(c, fwd, fromTap, ipv4(), ipInSet(allow), accept)
	case DenyList:
		for _, cidr := range p.CIDRs {
			rule(c, fwd, fromTap, ipv4(), ipIn(ipDaddr, cidr), reject)
		}
		rule(c, fwd, fromTap, ipv4(), ipInSet(deny), reject)
		rule(c, fwd, fromTap, ipv4(), accept)
	}
	rule(c, fwd, fromTap, reject)

	in := c.AddChain(&nftables.Chain{Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &dropping})
	rule(c, in, ctEstablished(), accept)
	rule(c, in, ifname(expr.MetaKeyIIFNAME, "lo", false, expr.CmpOpEq), accept)
	gwp := netip.PrefixFrom(gw, 32)
	rule(c, in, fromTap, ipv4(), ipIn(ipDaddr, gwp), dport53(unix.IPPROTO_UDP), accept)
	rule(c, in, fromTap, ipv4(), ipIn(ipDaddr, gwp), dport53(unix.IPPROTO_TCP), accept)
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
