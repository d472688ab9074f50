package shim

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/netnsthread"
)

// PodNetwork is a pod's network as CNI made it in the pod's network
// namespace (a veth, its addresses, its routes), and how the pod's VM
// takes it over: a tap beside the veth in the same namespace, traffic
// redirected between the two by tc (ingress qdiscs, a match-all u32
// filter each, mirred egress redirect: Kata's "tcfilter" model), the
// guest's card given the veth's MAC, addresses, default gateway and MTU.
// The namespace's own stack no longer sees the veth's traffic; the guest
// is the pod's endpoint. Plain data: it crosses into BootSpec.
type PodNetwork struct {
	// Netns is the namespace's path (/var/run/netns/cni-...).
	Netns string
	// Link is CNI's interface in it (eth0); Tap the VM's, made beside it.
	Link, Tap string
	MAC       string
	Addresses []netip.Prefix
	Gateway   netip.Addr // the default route's; zero: none
	MTU       int
	// Nameservers are the pod's resolv.conf's (CRI's), at most 3.
	Nameservers []netip.Addr
}

// podTap is the tap's name in the pod's namespace.
const podTap = "kiln0"

// maxResolvConf bounds the resolv.conf read.
const maxResolvConf = 64 << 10

// sameNetns reports whether the namespace files at a and b are one
// namespace (the same device and inode); an unreadable one is not.
func sameNetns(a, b string) bool {
	var sa, sb unix.Stat_t
	if unix.Stat(a, &sa) != nil || unix.Stat(b, &sb) != nil {
		return false
	}
	return sa.Dev == sb.Dev && sa.Ino == sb.Ino
}

// inspectPodNetwork reads what CNI made in the namespace at nsPath: its
// one interface that is up, not loopback, with a global address (an
// error names what is missing), its default route, and nameservers from
// resolvConf (a host file; empty: none).
func inspectPodNetwork(nsPath, resolvConf string) (*PodNetwork, error) {
	n := &PodNetwork{Netns: nsPath, Tap: podTap}
	if sameNetns(nsPath, "/proc/self/ns/net") {
		return nil, fmt.Errorf("pod network %s: it is the shim's own namespace, not a pod's: refusing to take its interfaces over", nsPath)
	}
	err := netnsthread.RunAt(nsPath, func() error {
		links, err := netlink.LinkList()
		if err != nil {
			return fmt.Errorf("listing links: %w", err)
		}
		var cands []string
		for _, l := range links {
			a := l.Attrs()
			if a.Flags&net.FlagLoopback != 0 || a.Flags&net.FlagUp == 0 || a.Name == podTap {
				continue
			}
			addrs, err := netlink.AddrList(l, netlink.FAMILY_ALL)
			if err != nil {
				return fmt.Errorf("addresses of %s: %w", a.Name, err)
			}
			var global []netip.Prefix
			for _, ad := range addrs {
				if ad.Scope != unix.RT_SCOPE_UNIVERSE || ad.IPNet == nil {
					continue
				}
				ip, ok := netip.AddrFromSlice(ad.IP)
				if !ok {
					continue
				}
				ones, _ := ad.Mask.Size()
				global = append(global, netip.PrefixFrom(ip.Unmap(), ones))
			}
			if len(global) == 0 {
				continue
			}
			cands = append(cands, a.Name)
			if n.Link != "" {
				continue
			}
			n.Link, n.MAC, n.MTU, n.Addresses = a.Name, a.HardwareAddr.String(), a.MTU, global
			routes, err := netlink.RouteList(l, netlink.FAMILY_ALL)
			if err != nil {
				return fmt.Errorf("routes of %s: %w", a.Name, err)
			}
			for _, r := range routes {
				if (r.Dst == nil || isDefault(r.Dst)) && r.Gw != nil {
					if gw, ok := netip.AddrFromSlice(r.Gw); ok && !n.Gateway.IsValid() {
						n.Gateway = gw.Unmap()
					}
				}
			}
		}
		switch {
		case len(cands) == 0:
			return errors.New("no interface that is up with an address: CNI gave the pod no network")
		case len(cands) > 1:
			return fmt.Errorf("%d interfaces with addresses (%s): the kiln runtime takes one network per pod", len(cands), strings.Join(cands, ", "))
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("pod network %s: %w", nsPath, err)
	}
	if n.Gateway.IsValid() && !inAny(n.Gateway, n.Addresses) {
		n.Gateway = netip.Addr{} // a gateway off-link (CNI's routes beyond the guest's reach): none
	}
	if resolvConf != "" {
		if n.Nameservers, err = readNameservers(resolvConf); err != nil {
			return nil, err
		}
	}
	return n, nil
}

func isDefault(dst *net.IPNet) bool {
	ones, _ := dst.Mask.Size()
	return ones == 0
}

func inAny(a netip.Addr, ps []netip.Prefix) bool {
	for _, p := range ps {
		if p.Masked().Contains(a) {
			return true
		}
	}
	return false
}

// readNameservers parses a resolv.conf's nameserver lines (at most 3),
// bounded: a file from the pod's spec.
func readNameservers(path string) ([]netip.Addr, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("resolv.conf: %w", err)
	}
	defer f.Close()
	b := make([]byte, maxResolvConf+1)
	n, _ := f.Read(b)
	if n > maxResolvConf {
		return nil, fmt.Errorf("resolv.conf %s: more than %d bytes", path, maxResolvConf)
	}
	return parseNameservers(b[:n]), nil
}

func parseNameservers(b []byte) []netip.Addr {
	var out []netip.Addr
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() && len(out) < 3 {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 && f[0] == "nameserver" {
			if a, err := netip.ParseAddr(f[1]); err == nil {
				out = append(out, a.Unmap())
			}
		}
	}
	return out
}

// connect joins the tap (which the VMM has opened) to the pod's link:
// both up at the link's MTU, and every frame arriving on one sent out of
// the other.
func (n *PodNetwork) connect() error {
	err := netnsthread.RunAt(n.Netns, func() error {
		link, err := netlink.LinkByName(n.Link)
		if err != nil {
			return fmt.Errorf("%s: %w", n.Link, err)
		}
		tap, err := netlink.LinkByName(n.Tap)
		if err != nil {
			return fmt.Errorf("%s: %w", n.Tap, err)
		}
		if n.MTU > 0 {
			if err := netlink.LinkSetMTU(tap, n.MTU); err != nil {
				return fmt.Errorf("%s: MTU %d: %w", n.Tap, n.MTU, err)
			}
		}
		if err := netlink.LinkSetUp(tap); err != nil {
			return fmt.Errorf("%s: up: %w", n.Tap, err)
		}
		for _, p := range [][2]netlink.Link{{link, tap}, {tap, link}} {
			if err := redirect(p[0], p[1]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("pod network %s: joining %s to %s: %w", n.Netns, n.Tap, n.Link, err)
	}
	return nil
}

// redirectPrio is the kiln redirect's filter priority.
const redirectPrio = 0xc11

// redirect sends every frame arriving on from out of to.
func redirect(from, to netlink.Link) error {
	idx := from.Attrs().Index
	qd := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: idx, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}
	if err := netlink.QdiscAdd(qd); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("%s: ingress qdisc: %w (the kernel needs sch_ingress)", from.Attrs().Name, err)
	}
	// A filter of an earlier VM in this namespace (a restore) is
	// replaced: the kiln filter is the one at redirectPrio.
	old, err := netlink.FilterList(from, netlink.MakeHandle(0xffff, 0))
	if err != nil {
		return fmt.Errorf("%s: listing filters: %w", from.Attrs().Name, err)
	}
	for _, f := range old {
		if f.Attrs().Priority == redirectPrio {
			if err := netlink.FilterDel(f); err != nil {
				return fmt.Errorf("%s: removing an old redirect: %w", from.Attrs().Name, err)
			}
		}
	}
	f := &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: idx, Parent: netlink.MakeHandle(0xffff, 0), Priority: redirectPrio, Protocol: unix.ETH_P_ALL},
		Actions: []netlink.Action{&netlink.MirredAction{
			ActionAttrs:  netlink.ActionAttrs{Action: netlink.TC_ACT_STOLEN},
			MirredAction: netlink.TCA_EGRESS_REDIR,
			Ifindex:      to.Attrs().Index,
		}},
	}
	if err := netlink.FilterAdd(f); err != nil {
		return fmt.Errorf("%s: redirect to %s: %w (the kernel needs cls_u32 and act_mirred)", from.Attrs().Name, to.Attrs().Name, err)
	}
	return nil
}
