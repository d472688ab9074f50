package hostnet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// check is one thing a guest tries and whether it should work.
type check struct {
	get    netip.Addr // connect to get:8080 and get an answer
	lookup string     // or resolve lookup through the proxy
	rcode  int        // the lookup's rcode
	want   netip.Addr // and its address (when rcode is success)
	ok     bool       // for get: it is reachable
}

func reach(a netip.Addr) check   { return check{get: a, ok: true} }
func noReach(a netip.Addr) check { return check{get: a} }
func resolves(n string, a netip.Addr) check {
	return check{lookup: n, rcode: dns.RcodeSuccess, want: a}
}
func answers(n string, rcode int) check { return check{lookup: n, rcode: rcode} }

func (c check) run(t *testing.T, g *guest) {
	t.Helper()
	if c.lookup != "" {
		rcode, addrs, err := g.lookup(c.lookup)
		if err != nil {
			t.Errorf("lookup %s: %v", c.lookup, err)
			return
		}
		if rcode != c.rcode {
			t.Errorf("lookup %s: rcode %s, want %s", c.lookup, dns.RcodeToString[rcode], dns.RcodeToString[c.rcode])
		}
		if c.want.IsValid() && !slices.Equal(addrs, []netip.Addr{c.want}) {
			t.Errorf("lookup %s: %v, want [%v]", c.lookup, addrs, c.want)
		}
		return
	}
	got, err := g.get(c.get)
	switch {
	case c.ok && err != nil:
		t.Errorf("guest to %v: %v, want an answer", c.get, err)
	case c.ok && !strings.HasPrefix(got, "hello "+c.get.String()):
		t.Errorf("guest to %v: answer %q", c.get, got)
	case !c.ok && err == nil:
		t.Errorf("guest to %v: answered %q, want it unreachable", c.get, got)
	}
}

func TestEgressPolicies(t *testing.T) {
	w := newWorld(t)
	m := w.manager(t, t.TempDir())
	t.Cleanup(func() { m.Close() })
	cases := []struct {
		name   string
		policy Policy
		checks []check
	}{
		{"allow-all", Policy{Mode: AllowAll}, []check{
			reach(worldAllowed), reach(worldDenied),
			resolves("allowed.test", worldAllowed), answers("nowhere.test", dns.RcodeNameError),
		}},
		{"deny-all", Policy{Mode: DenyAll}, []check{
			noReach(worldAllowed), noReach(worldDenied), noReach(worldDNS.Addr()),
			answers("allowed.test", dns.RcodeRefused),
		}},
		{"allow-list cidr", Policy{Mode: AllowList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.99.1.0/24")}}, []check{
			reach(worldAllowed), noReach(worldDenied),
			answers("allowed.test", dns.RcodeRefused), // no domains: every name is refused
		}},
		{"allow-list domain", Policy{Mode: AllowList, Domains: []string{"Allowed.Test."}}, []check{
			noReach(worldAllowed), // not resolved yet
			resolves("allowed.test", worldAllowed), reach(worldAllowed),
			answers("denied.test", dns.RcodeRefused), noReach(worldDenied),
		}},
		{"allow-list wildcard", Policy{Mode: AllowList, Domains: []string{"*.wild.test"}}, []check{
			resolves("a.wild.test", worldOther), reach(worldOther),
			answers("allowed.test", dns.RcodeRefused), noReach(worldAllowed),
		}},
		{"deny-list", Policy{Mode: DenyList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.99.3.1/32")}, Domains: []string{"denied.test"}}, []check{
			answers("denied.test", dns.RcodeNameError),
			resolves("allowed.test", worldAllowed),
			reach(worldAllowed), noReach(worldOther),
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			id := "egress-" + strings.ReplaceAll(tc.name, " ", "-")
			info, err := m.Attach(context.Background(), id, tc.policy)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() {
				if err := m.Detach(context.Background(), id); err != nil {
					t.Error(err)
				}
			})
			g := newGuest(t, info)
			for _, c := range tc.checks {
				c.run(t, g)
			}
		})
	}
	// A deny list's names are resolved by the manager itself: their
	// addresses are denied from the attach on, to a guest that learned
	// them elsewhere, and stay denied after the guest asks the proxy.
	t.Run("deny-list by address", func(t *testing.T) {
		info, err := m.Attach(context.Background(), "deny-addr", Policy{Mode: DenyList, Domains: []string{"denied.test"}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Detach(context.Background(), "deny-addr") })
		g := newGuest(t, info)
		noReach(worldDenied).run(t, g)
		answers("denied.test", dns.RcodeNameError).run(t, g)
		noReach(worldDenied).run(t, g)
		reach(worldAllowed).run(t, g)
	})
	t.Run("dns over tcp and aaaa", func(t *testing.T) {
		info, err := m.Attach(context.Background(), "dns-tcp", Policy{Mode: AllowList, Domains: []string{"allowed.test"}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Detach(context.Background(), "dns-tcp") })
		g := newGuest(t, info)
		rcode, addrs, err := g.query("allowed.test", dns.TypeA, "tcp")
		if err != nil || rcode != dns.RcodeSuccess || !slices.Equal(addrs, []netip.Addr{worldAllowed}) {
			t.Errorf("A allowed.test over TCP: %s %v %v", dns.RcodeToString[rcode], addrs, err)
		}
		rcode, addrs, err = g.query("allowed.test", dns.TypeAAAA, "udp")
		if err != nil || rcode != dns.RcodeSuccess || len(addrs) != 0 {
			t.Errorf("AAAA allowed.test: %s %v %v, want no records", dns.RcodeToString[rcode], addrs, err)
		}
		reach(worldAllowed).run(t, g)
	})
}

func TestSetPolicy(t *testing.T) {
	w := newWorld(t)
	m := w.manager(t, t.TempDir())
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()
	info, err := m.Attach(ctx, "live", Policy{Mode: AllowAll})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Detach(ctx, "live") })
	g := newGuest(t, info)
	reach(worldAllowed).run(t, g)

	// A connection open across the change.
	c, err := g.ns.dial(ctx, "tcp4", netip.AddrPortFrom(worldAllowed, worldPort).String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	r := bufio.NewReader(c)
	roundTrip := func() error {
		c.SetDeadline(time.Now().Add(2 * time.Second))
		if _, err := io.WriteString(c, "hi\n"); err != nil {
			return err
		}
		_, err := r.ReadString('\n')
		return err
	}
	if err := roundTrip(); err != nil {
		t.Fatal(err)
	}

	steps := []struct {
		policy Policy
		checks []check
		open   bool // the held connection still works
	}{
		{Policy{Mode: AllowList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.99.1.0/24")}},
			[]check{reach(worldAllowed), noReach(worldDenied)}, true},
		{Policy{Mode: DenyAll}, []check{noReach(worldAllowed), answers("allowed.test", dns.RcodeRefused)}, false},
		{Policy{Mode: AllowList, Domains: []string{"allowed.test"}},
			[]check{resolves("allowed.test", worldAllowed), reach(worldAllowed), noReach(worldDenied)}, false},
		// The learned address of a domain the new policy keeps carries over.
		{Policy{Mode: AllowList, Domains: []string{"allowed.test", "denied.test"}},
			[]check{reach(worldAllowed), noReach(worldDenied), resolves("denied.test", worldDenied), reach(worldDenied)}, false},
		{Policy{Mode: AllowAll}, []check{reach(worldAllowed), reach(worldDenied), reach(worldOther)}, false},
	}
	for i, s := range steps {
		if err := m.SetPolicy(ctx, "live", s.policy); err != nil {
			t.Fatalf("step %d: %v", i, err)
		}
		got, err := m.Policy("live")
		if err != nil || got.Mode != s.policy.Mode {
			t.Errorf("step %d: Policy = %+v, %v", i, got, err)
		}
		for _, c := range s.checks {
			c.run(t, g)
		}
		if s.open {
			if err := roundTrip(); err != nil {
				t.Errorf("step %d: the connection the policy still allows broke: %v", i, err)
			}
		}
		if i == 1 {
			if err := roundTrip(); err == nil {
				t.Errorf("step %d: a connection deny-all forbids still works", i)
			}
		}
	}
	if err := m.SetPolicy(ctx, "live", Policy{Mode: Mode(9)}); !errors.Is(err, ErrPolicy) {
		t.Errorf("SetPolicy(mode 9) = %v, want ErrPolicy", err)
	}
	if err := m.SetPolicy(ctx, "nope", Policy{}); !errors.Is(err, ErrNotFound) {
		t.Errorf("SetPolicy(nope) = %v, want ErrNotFound", err)
	}
}

func TestIsolationAndLifecycle(t *testing.T) {
	w := newWorld(t)
	dir := t.TempDir()
	m := w.manager(t, dir)
	ctx := context.Background()
	allowAll := Policy{Mode: AllowAll}
	a, err := m.Attach(ctx, "a", allowAll)
	if err != nil {
		t.Fatal(err)
	}
	b, err := m.Attach(ctx, "b", Policy{Mode: AllowList, Domains: []string{"allowed.test"}})
	if err != nil {
		t.Fatal(err)
	}
	if a.Address == b.Address || a.MAC == b.MAC || a.Netns == b.Netns || a.Gateway == b.Gateway {
		t.Errorf("two attachments share something: %+v and %+v", a, b)
	}
	for _, i := range []Info{a, b} {
		if !testPool.Contains(i.Address.Addr()) || i.Address.Bits() != 30 || !i.Address.Contains(i.Gateway) || i.Tap != "tap0" || i.MTU != 1500 {
			t.Errorf("info %+v", i)
		}
		if mac, _ := netlinkMAC(i.MAC); mac[0]&3 != 2 {
			t.Errorf("MAC %s is not locally administered unicast", i.MAC)
		}
	}
	if _, err := m.Attach(ctx, "a", allowAll); !errors.Is(err, ErrExists) {
		t.Errorf("second Attach(a) = %v, want ErrExists", err)
	}
	for _, id := range []string{"", "../x", ".hidden", strings.Repeat("x", 65), "a b"} {
		if _, err := m.Attach(ctx, id, allowAll); err == nil {
			t.Errorf("Attach(%q) succeeded", id)
		}
	}
	if _, err := m.Attach(ctx, "bad-policy", Policy{Mode: DenyAll, Domains: []string{"x.test"}}); !errors.Is(err, ErrPolicy) {
		t.Errorf("Attach with a bad policy = %v, want ErrPolicy", err)
	}
	ga, gb := newGuest(t, a), newGuest(t, b)
	// Guests cannot reach each other, their gateway (but for DNS), the
	// veths or the host itself.
	bl := gb.ns.listen(t, "tcp4", fmt.Sprintf(":%d", worldPort))
	serveLines(t, bl)
	serveLines(t, w.host.listen(t, "tcp4", fmt.Sprintf(":%d", worldPort)))
	for _, addr := range []netip.Addr{b.Address.Addr(), b.Gateway, a.Gateway, blockAt(testPool, 0).hostEnd().Addr(), hostUplink} {
		noReach(addr).run(t, ga)
	}
	reach(worldAllowed).run(t, ga)
	// The host reaches the world, not the guests.
	hctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if c, err := w.host.dial(hctx, "tcp4", netip.AddrPortFrom(b.Address.Addr(), worldPort).String()); err == nil {
		c.Close()
		t.Errorf("the host opened a connection to guest b")
	}

	// A second manager over the same Dir adopts what the first left.
	resolves("allowed.test", worldAllowed).run(t, gb)
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	m2 := w.manager(t, dir)
	t.Cleanup(func() { m2.Close() })
	if got := m2.List(); !slices.Equal(got, []string{"a", "b"}) {
		t.Errorf("List = %v, want [a b]", got)
	}
	if _, err := m2.Adopt(ctx, "nope"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Adopt(nope) = %v, want ErrNotFound", err)
	}
	for _, want := range []Info{a, b} {
		got, err := m2.Adopt(ctx, filepath.Base(want.Netns))
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Errorf("Adopt = %+v, want %+v", got, want)
		}
	}
	if p, err := m2.Policy("b"); err != nil || p.Mode != AllowList || !slices.Equal(p.Domains, []string{"allowed.test"}) {
		t.Errorf("Policy(b) = %+v, %v", p, err)
	}
	resolves("allowed.test", worldAllowed).run(t, gb) // through m2's proxy
	reach(worldAllowed).run(t, gb)
	answers("denied.test", dns.RcodeRefused).run(t, gb)
	c, err := m2.Attach(ctx, "c", allowAll)
	if err != nil {
		t.Fatal(err)
	}
	if c.Address == a.Address || c.Address == b.Address {
		t.Errorf("c got a live block: %v", c.Address)
	}

	// Detach removes the netns, the veth and the record, and frees the block.
	veth := vethName(m2.records["a"].Index)
	if err := m2.Detach(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if err := m2.Detach(ctx, "a"); err != nil {
		t.Errorf("second Detach(a) = %v", err)
	}
	if _, err := os.Stat(a.Netns); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("netns pin of a after Detach: %v", err)
	}
	w.host.do(t, func(h *netlink.Handle) error {
		if _, err := h.LinkByName(veth); err == nil {
			t.Errorf("veth %s is still in the host netns", veth)
		}
		return nil
	})
	if m2.alloc.used[blockIndex(a.Address)] {
		t.Errorf("a's block is still taken")
	}
	if _, err := m2.Policy("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Policy(a) after Detach = %v", err)
	}
	for _, id := range []string{"b", "c"} {
		if err := m2.Detach(ctx, id); err != nil {
			t.Error(err)
		}
	}
	if got := m2.List(); len(got) != 0 {
		t.Errorf("List after detaching all = %v", got)
	}
	left, _ := filepath.Glob(filepath.Join(dir, "*", "*"))
	if len(left) != 0 {
		t.Errorf("left in Dir: %v", left)
	}
}

func netlinkMAC(s string) ([]byte, error) {
	var b [6]byte
	_, err := fmt.Sscanf(s, "%02x:%02x:%02x:%02x:%02x:%02x", &b[0], &b[1], &b[2], &b[3], &b[4], &b[5])
	return b[:], err
}

func blockIndex(guest netip.Prefix) int {
	a, p := guest.Addr().As4(), testPool.Addr().As4()
	d := (int(a[0])-int(p[0]))<<24 | (int(a[1])-int(p[1]))<<16 | (int(a[2])-int(p[2]))<<8 | (int(a[3]) - int(p[3]))
	return d >> blockBits
}

// TestAttachLeavesNothingOnFailure makes Attach fail half-way (its veth
// name is taken in the host netns, by a leftover "kiln" link) and checks
// that nothing is left: no record, no pin, no block taken, and the
// leftover link is gone too (kiln* links are kiln's), so a retry works.
func TestAttachLeavesNothingOnFailure(t *testing.T) {
	w := newWorld(t)
	dir := t.TempDir()
	m := w.manager(t, dir)
	t.Cleanup(func() { m.Close() })
	// The next block's veth name is taken by someone else.
	next := m.alloc.next
	w.host.do(t, func(h *netlink.Handle) error {
		return h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: vethName(next)}, PeerName: "squatter"})
	})
	if _, err := m.Attach(context.Background(), "x", Policy{}); err == nil || !strings.Contains(err.Error(), vethName(next)) {
		t.Fatalf("Attach with its veth name taken = %v, want an error naming %s", err, vethName(next))
	}
	if got := m.List(); len(got) != 0 {
		t.Errorf("List after a failed Attach = %v", got)
	}
	if len(m.alloc.used) != 0 {
		t.Errorf("blocks taken after a failed Attach: %v", m.alloc.used)
	}
	left, _ := filepath.Glob(filepath.Join(dir, "*", "*"))
	if len(left) != 0 {
		t.Errorf("left in Dir: %v", left)
	}
	// And the next Attach works.
	info, err := m.Attach(context.Background(), "x", Policy{})
	if err != nil {
		t.Fatal(err)
	}
	reach(worldAllowed).run(t, newGuest(t, info))
	if err := m.Detach(context.Background(), "x"); err != nil {
		t.Fatal(err)
	}
}

// BenchmarkAttach times Attach (a netns, veth, tap, routes, nftables
// policy, DNS proxy) and Detach, each op one sandbox, and reports p50 and
// p95 of Attach alone.
func BenchmarkAttach(b *testing.B) {
	w := newWorld(b)
	m := w.manager(b, b.TempDir())
	b.Cleanup(func() { m.Close() })
	ctx := context.Background()
	policy := Policy{Mode: AllowList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.99.1.0/24")}, Domains: []string{"allowed.test", "*.wild.test"}}
	var attach, detach []time.Duration
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		id := fmt.Sprintf("bench-%d", i)
		t0 := time.Now()
		if _, err := m.Attach(ctx, id, policy); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := m.Detach(ctx, id); err != nil {
			b.Fatal(err)
		}
		attach = append(attach, t1.Sub(t0))
		detach = append(detach, time.Since(t1))
	}
	b.StopTimer()
	b.ReportMetric(benchPct(attach, 0.50), "attach-p50-ms")
	b.ReportMetric(benchPct(attach, 0.95), "attach-p95-ms")
	b.ReportMetric(benchPct(detach, 0.50), "detach-p50-ms")
	b.ReportMetric(benchPct(detach, 0.95), "detach-p95-ms")
}

// BenchmarkSetPolicy times replacing a live attachment's policy (one
// nftables transaction and a conntrack sweep; for a deny list by domain,
// also kilnd's own resolution of its names), alternating an allow list
// and a deny list, and reports p50 and p95 of each.
func BenchmarkSetPolicy(b *testing.B) {
	w := newWorld(b)
	m := w.manager(b, b.TempDir())
	b.Cleanup(func() { m.Close() })
	ctx := context.Background()
	if _, err := m.Attach(ctx, "bench", Policy{}); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { m.Detach(ctx, "bench") })
	policies := []Policy{
		{Mode: AllowList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.99.1.0/24")}, Domains: []string{"allowed.test"}},
		{Mode: DenyList, Domains: []string{"denied.test"}},
	}
	took := make([][]time.Duration, len(policies))
	for i := 0; b.Loop(); i++ {
		t0 := time.Now()
		if err := m.SetPolicy(ctx, "bench", policies[i%2]); err != nil {
			b.Fatal(err)
		}
		took[i%2] = append(took[i%2], time.Since(t0))
	}
	b.StopTimer()
	for i, name := range []string{"allow", "deny"} {
		if len(took[i]) == 0 {
			continue
		}
		b.ReportMetric(benchPct(took[i], 0.50), name+"-p50-ms")
		b.ReportMetric(benchPct(took[i], 0.95), name+"-p95-ms")
	}
}

// benchPct is the p-th fraction of d, in milliseconds.
func benchPct(d []time.Duration, p float64) float64 {
	s := slices.Clone(d)
	slices.Sort(s)
	return float64(s[min(len(s)-1, int(p*float64(len(s))))].Microseconds()) / 1000
}

// TestAdoptGoneNetns: a record whose netns is gone (as after a host reboot,
// when the pins are no longer mounted) is cleaned up by Adopt, which
// reports ErrNotFound and frees the block.
func TestAdoptGoneNetns(t *testing.T) {
	w := newWorld(t)
	dir := t.TempDir()
	m := w.manager(t, dir)
	ctx := context.Background()
	info, err := m.Attach(ctx, "r", Policy{})
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Close(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Unmount(info.Netns, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	m2 := w.manager(t, dir)
	t.Cleanup(func() { m2.Close() })
	if got := m2.List(); !slices.Equal(got, []string{"r"}) {
		t.Fatalf("List = %v, want [r]", got)
	}
	if _, err := m2.Adopt(ctx, "r"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Adopt of a gone netns = %v, want ErrNotFound", err)
	}
	if got := m2.List(); len(got) != 0 {
		t.Errorf("List after = %v", got)
	}
	if len(m2.alloc.used) != 0 {
		t.Errorf("blocks still taken: %v", m2.alloc.used)
	}
	left, _ := filepath.Glob(filepath.Join(dir, "*", "*"))
	if len(left) != 0 {
		t.Errorf("left in Dir: %v", left)
	}
}

// TestConcurrent attaches, updates and detaches sandboxes from many
// goroutines at once, some on the same sandbox.
func TestConcurrent(t *testing.T) {
	w := newWorld(t)
	dir := t.TempDir()
	m := w.manager(t, dir)
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()
	const n = 8
	infos := make([]Info, n)
	errs := make(chan error, 3*n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			info, err := m.Attach(ctx, fmt.Sprintf("c%d", i), Policy{})
			if err != nil {
				errs <- err
				return
			}
			infos[i] = info
			// The same sandbox from two goroutines: they take turns.
			var wg2 sync.WaitGroup
			wg2.Add(2)
			go func() {
				defer wg2.Done()
				if err := m.SetPolicy(ctx, fmt.Sprintf("c%d", i), Policy{Mode: DenyAll}); err != nil && !errors.Is(err, ErrNotFound) {
					errs <- err
				}
			}()
			go func() {
				defer wg2.Done()
				if i%2 == 0 {
					if err := m.Detach(ctx, fmt.Sprintf("c%d", i)); err != nil {
						errs <- err
					}
				}
			}()
			wg2.Wait()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	seen := map[netip.Prefix]bool{}
	for _, info := range infos {
		if seen[info.Address] {
			t.Errorf("address %v handed out twice", info.Address)
		}
		seen[info.Address] = true
	}
	var want []string
	for i := 1; i < n; i += 2 {
		want = append(want, fmt.Sprintf("c%d", i))
		if p, err := m.Policy(fmt.Sprintf("c%d", i)); err != nil || p.Mode != DenyAll {
			t.Errorf("Policy(c%d) = %+v, %v", i, p, err)
		}
	}
	if got := m.List(); !slices.Equal(got, want) {
		t.Errorf("List = %v, want %v", got, want)
	}
	for _, id := range want {
		if err := m.Detach(ctx, id); err != nil {
			t.Error(err)
		}
	}
}

func TestNewErrors(t *testing.T) {
	bare := newTestNetns(t, "bare") // no default route
	notNS := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(notNS, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	upstream := []netip.AddrPort{worldDNS}
	cases := []struct {
		name string
		cfg  Config
		want string
	}{
		{"ipv6 pool", Config{Pool: netip.MustParsePrefix("fd00::/64"), Dir: t.TempDir(), DNS: upstream, HostNetns: bare.path}, "want an IPv4 prefix"},
		{"small pool", Config{Pool: netip.MustParsePrefix("10.0.0.0/30"), Dir: t.TempDir(), DNS: upstream, HostNetns: bare.path}, "or larger"},
		{"no dir", Config{Pool: testPool, DNS: upstream, HostNetns: bare.path}, "Dir is empty"},
		{"no default route", Config{Pool: testPool, Dir: t.TempDir(), DNS: upstream, HostNetns: bare.path}, "no IPv4 default route"},
		{"not a netns", Config{Pool: testPool, Dir: t.TempDir(), DNS: upstream, HostNetns: notNS}, "not a network namespace"},
		{"bad dns", Config{Pool: testPool, Dir: t.TempDir(), DNS: []netip.AddrPort{{}}, HostNetns: bare.path, Uplink: "lo"}, "not an address and port"},
		{"long uplink", Config{Pool: testPool, Dir: t.TempDir(), DNS: upstream, HostNetns: bare.path, Uplink: strings.Repeat("u", 16)}, "at most 15"},
		{"missing uplink", Config{Pool: testPool, Dir: t.TempDir(), DNS: upstream, HostNetns: bare.path, Uplink: "nosuch0"}, `uplink "nosuch0": no such interface`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, err := New(context.Background(), tc.cfg)
			if err == nil {
				m.Close()
				t.Fatalf("New succeeded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("New = %v, want an error naming %q", err, tc.want)
			}
		})
	}
}
