package hostnet

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TestEgressRefusedByDefault: the cloud metadata service and the host's
// LAN are out of reach in every egress mode, until an allow list names
// them (a CIDR inside the refused range, or a domain the proxy resolves
// there); a CIDR wider than the range names nothing in it.
func TestEgressRefusedByDefault(t *testing.T) {
	w := newWorld(t)
	m := w.manager(t, t.TempDir())
	t.Cleanup(func() { m.Close() })
	lan := netip.PrefixFrom(worldLAN, 32)
	cases := []struct {
		name   string
		policy Policy
		checks []check
	}{
		{"allow-all", Policy{Mode: AllowAll}, []check{
			noReach(worldMetadata), noReach(worldLAN), reach(worldAllowed),
		}},
		{"deny-list", Policy{Mode: DenyList, Domains: []string{"denied.test"}}, []check{
			noReach(worldMetadata), noReach(worldLAN), reach(worldAllowed), noReach(worldDenied),
		}},
		{"allow-list", Policy{Mode: AllowList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.99.1.0/24")}, Domains: []string{"allowed.test"}}, []check{
			noReach(worldMetadata), noReach(worldLAN), reach(worldAllowed),
		}},
		{"allow-list everything", Policy{Mode: AllowList, CIDRs: []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}}, []check{
			noReach(worldMetadata), noReach(worldLAN), reach(worldAllowed), reach(worldOther),
		}},
		{"allow-list naming the lan host", Policy{Mode: AllowList, CIDRs: []netip.Prefix{lan}}, []check{
			reach(worldLAN), noReach(worldMetadata), noReach(worldAllowed),
		}},
		{"allow-list naming the lan host's domain", Policy{Mode: AllowList, Domains: []string{"lan.test"}}, []check{
			noReach(worldLAN), resolves("lan.test", worldLAN), reach(worldLAN), noReach(worldMetadata),
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			id := "refused-" + strings.NewReplacer(" ", "-", "'", "").Replace(tc.name)
			id = id[:min(len(id), 40)]
			info, err := m.Attach(context.Background(), id, tc.policy)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Detach(context.Background(), id) })
			g := newGuest(t, info)
			for _, c := range tc.checks {
				c.run(t, g)
			}
		})
	}
	// A policy change applies the refused ranges to connections already
	// open: an allow list that named the LAN host cuts it when it stops.
	t.Run("cut on change", func(t *testing.T) {
		ctx := context.Background()
		info, err := m.Attach(ctx, "refused-cut", Policy{Mode: AllowList, CIDRs: []netip.Prefix{lan}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Detach(ctx, "refused-cut") })
		g := newGuest(t, info)
		c, err := g.ns.dial(ctx, "tcp4", netip.AddrPortFrom(worldLAN, worldPort).String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if err := m.SetPolicy(ctx, "refused-cut", Policy{Mode: AllowAll}); err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(2 * time.Second))
		fmt.Fprintln(c, "hi")
		if b := make([]byte, 64); true {
			if n, err := c.Read(b); err == nil {
				t.Errorf("an open connection to the LAN host still answers (%q) under allow-all", b[:n])
			}
		}
	})
}

// udpSink counts the datagrams that reach a world address, by what they
// say (the address they were sent from: NAT hides it).
type udpSink struct {
	mu   sync.Mutex
	from map[string]int
}

func newUDPSink(t *testing.T, w *world, at netip.AddrPort) *udpSink {
	t.Helper()
	s := &udpSink{from: map[string]int{}}
	var pc net.PacketConn
	if err := inNetns(w.world.fd, func() (err error) { pc, err = net.ListenPacket("udp4", at.String()); return err }); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	t.Cleanup(func() { pc.Close(); <-done })
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			n, _, err := pc.ReadFrom(buf)
			if err != nil {
				return
			}
			s.mu.Lock()
			s.from[string(buf[:n])]++
			s.mu.Unlock()
		}
	}()
	return s
}

func (s *udpSink) count(a netip.Addr) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.from[a.String()]
}

// TestAntiSpoofing: a guest sending from an address other than its own
// (an outside one, another sandbox's) gets nothing out, TCP or UDP, while
// its own address still works; the tap filters reverse paths strictly.
func TestAntiSpoofing(t *testing.T) {
	w := newWorld(t)
	m := w.manager(t, t.TempDir())
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()
	sink := newUDPSink(t, w, netip.AddrPortFrom(worldAllowed, 9999))
	info, err := m.Attach(ctx, "spoof", Policy{Mode: AllowAll})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Detach(ctx, "spoof") })
	g := newGuest(t, info)
	forged := []netip.Addr{netip.MustParseAddr("11.99.9.9"), blockAt(testPool, 7).guest().Addr()}
	g.ns.do(t, func(h *netlink.Handle) error {
		l, err := h.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, a := range forged {
			if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(a, 32))}); err != nil {
				return err
			}
		}
		return nil
	})
	send := func(src netip.Addr) {
		t.Helper()
		err := inNetns(g.ns.fd, func() error {
			c, err := net.DialUDP("udp4", net.UDPAddrFromAddrPort(netip.AddrPortFrom(src, 0)), net.UDPAddrFromAddrPort(netip.AddrPortFrom(worldAllowed, 9999)))
			if err != nil {
				return err
			}
			defer c.Close()
			_, err = c.Write([]byte(src.String()))
			return err
		})
		if err != nil {
			t.Fatalf("sending from %v: %v", src, err)
		}
	}
	for _, src := range forged {
		for range 3 {
			send(src)
		}
		// TCP too: its SYN never arrives, so no connection.
		tctx, cancel := context.WithTimeout(ctx, time.Second)
		err := inNetns(g.ns.fd, func() error {
			d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))}
			c, err := d.DialContext(tctx, "tcp4", netip.AddrPortFrom(worldAllowed, worldPort).String())
			if err == nil {
				c.Close()
				return fmt.Errorf("connected from forged %v", src)
			}
			return nil
		})
		cancel()
		if err != nil {
			t.Error(err)
		}
	}
	// The guest's own address gets through: once it has, the forged
	// datagrams sent before it had every chance to arrive too.
	deadline := time.Now().Add(5 * time.Second)
	for sink.count(info.Address.Addr()) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the guest's own datagrams never arrived")
		}
		send(info.Address.Addr())
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond)
	for _, src := range forged {
		if n := sink.count(src); n > 0 {
			t.Errorf("%d datagrams forged from %v arrived in the world", n, src)
		}
	}
	fd, err := openNetns(info.Netns)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var rp string
	if err := inNetns(fd, func() error {
		b, err := os.ReadFile("/proc/sys/net/ipv4/conf/tap0/rp_filter")
		rp = strings.TrimSpace(string(b))
		return err
	}); err != nil || rp != "1" {
		t.Errorf("tap0 rp_filter = %q (%v), want 1", rp, err)
	}
}

// TestDenyListResolvedByKiln: a deny list's names are resolved by the
// manager itself at attach, so a guest that never asks the proxy (it
// asks the world's own DNS server, or knows the address) is refused them
// from the start; and in the list modes, DNS and DNS over TLS to any
// server but the gateway are refused.
func TestDenyListResolvedByKiln(t *testing.T) {
	w := newWorld(t)
	m := w.manager(t, t.TempDir())
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()
	serveLines(t, w.world.listen(t, "tcp4", netip.AddrPortFrom(worldAllowed, 853).String()))
	for _, p := range []Policy{
		{Mode: DenyList, Domains: []string{"denied.test"}},
		{Mode: AllowList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.99.0.0/16")}},
	} {
		t.Run(p.Mode.String(), func(t *testing.T) {
			id := "dns-" + p.Mode.String()
			info, err := m.Attach(ctx, id, p)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Detach(ctx, id) })
			g := newGuest(t, info)
			if p.Mode == DenyList {
				// No query through the proxy yet: the address is
				// already denied.
				noReach(worldDenied).run(t, g)
			}
			reach(worldAllowed).run(t, g)
			for _, network := range []string{"udp", "tcp"} {
				qctx, cancel := context.WithTimeout(ctx, 2*time.Second)
				c, err := g.ns.dial(qctx, network, worldOwnDNS.String())
				if err == nil {
					q := new(dns.Msg)
					q.SetQuestion("denied.test.", dns.TypeA)
					cl := &dns.Client{Net: network, Timeout: 2 * time.Second}
					var r *dns.Msg
					r, _, err = cl.ExchangeWithConnContext(qctx, q, &dns.Conn{Conn: c})
					c.Close()
					if err == nil {
						t.Errorf("the world's own DNS server answered over %s: %v", network, r.Answer)
					}
				}
				cancel()
			}
			if c, err := g.ns.dial(ctx, "tcp4", netip.AddrPortFrom(worldAllowed, 853).String()); err == nil {
				c.Close()
				t.Errorf("DNS over TLS to %v connected", worldAllowed)
			}
			// The proxy still answers.
			resolvesOrRefused := answers("denied.test", dns.RcodeNameError)
			if p.Mode == AllowList {
				resolvesOrRefused = answers("denied.test", dns.RcodeRefused)
			}
			resolvesOrRefused.run(t, g)
		})
	}
	// Allow-all keeps other resolvers.
	t.Run("allow-all", func(t *testing.T) {
		info, err := m.Attach(ctx, "dns-allow-all", Policy{Mode: AllowAll})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Detach(ctx, "dns-allow-all") })
		g := newGuest(t, info)
		c, err := g.ns.dial(ctx, "udp", worldOwnDNS.String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		q := new(dns.Msg)
		q.SetQuestion("allowed.test.", dns.TypeA)
		cl := &dns.Client{Net: "udp", Timeout: 3 * time.Second}
		if _, _, err := cl.ExchangeWithConnContext(ctx, q, &dns.Conn{Conn: c}); err != nil {
			t.Errorf("allow-all: the world's own DNS server: %v", err)
		}
	})
}

// TestNetnsOutputDropped: a process inside a sandbox's netns (where a
// jailed VMM process lives) opens nothing, whatever the policy: not the
// world, not the metadata service, not the host; it sends no datagram.
func TestNetnsOutputDropped(t *testing.T) {
	w := newWorld(t)
	m := w.manager(t, t.TempDir())
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()
	sink := newUDPSink(t, w, netip.AddrPortFrom(worldAllowed, 9999))
	for _, p := range []Policy{{Mode: DenyAll}, {Mode: AllowAll}} {
		t.Run(p.Mode.String(), func(t *testing.T) {
			id := "out-" + p.Mode.String()
			info, err := m.Attach(ctx, id, p)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { m.Detach(ctx, id) })
			fd, err := openNetns(info.Netns)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(fd)
			for _, a := range []netip.Addr{worldAllowed, worldMetadata, worldLAN, hostUplink, worldDNS.Addr()} {
				err := inNetns(fd, func() error {
					dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
					defer cancel()
					var d net.Dialer
					c, err := d.DialContext(dctx, "tcp4", netip.AddrPortFrom(a, worldPort).String())
					if err == nil {
						c.Close()
						return fmt.Errorf("connected to %v", a)
					}
					u, err := net.Dial("udp4", netip.AddrPortFrom(worldAllowed, 9999).String())
					if err == nil {
						u.Write([]byte("netns"))
						u.Close()
					}
					return nil
				})
				if err != nil {
					t.Errorf("a process in the %v sandbox netns: %v", p.Mode, err)
				}
			}
			// The guest itself is still served by the proxy.
			if p.Mode == AllowAll {
				g := newGuest(t, info)
				resolves("allowed.test", worldAllowed).run(t, g)
				reach(worldAllowed).run(t, g)
			}
		})
	}
	time.Sleep(200 * time.Millisecond)
	sink.mu.Lock()
	defer sink.mu.Unlock()
	for from, n := range sink.from {
		t.Errorf("%d datagrams from %v, sent inside a sandbox netns, arrived", n, from)
	}
}
