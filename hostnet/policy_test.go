package hostnet

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	"github.com/miekg/dns"
)

func TestPolicyValidate(t *testing.T) {
	many := func(n int, f func(i int) string) []string {
		var out []string
		for i := range n {
			out = append(out, f(i))
		}
		return out
	}
	prefixes := func(ss ...string) []netip.Prefix {
		var out []netip.Prefix
		for _, s := range ss {
			out = append(out, netip.MustParsePrefix(s))
		}
		return out
	}
	cases := []struct {
		name    string
		p       Policy
		wantErr string // "" = valid
	}{
		{"allow-all", Policy{Mode: AllowAll}, ""},
		{"deny-all", Policy{Mode: DenyAll}, ""},
		{"allow-list", Policy{Mode: AllowList, CIDRs: prefixes("10.0.0.0/8", "192.0.2.7/32"), Domains: []string{"example.com", "*.Example.ORG.", "_svc.a-b.test"}}, ""},
		{"deny-list", Policy{Mode: DenyList, Domains: []string{"x"}}, ""},
		{"empty allow-list", Policy{Mode: AllowList}, ""},
		{"mode out of range", Policy{Mode: 4}, "mode 4 is out of range"},
		{"negative mode", Policy{Mode: -1}, "mode -1 is out of range"},
		{"allow-all with cidrs", Policy{Mode: AllowAll, CIDRs: prefixes("10.0.0.0/8")}, "takes no CIDRs"},
		{"deny-all with domains", Policy{Mode: DenyAll, Domains: []string{"a.test"}}, "takes no CIDRs"},
		{"ipv6", Policy{Mode: AllowList, CIDRs: prefixes("2001:db8::/32")}, "no IPv6 egress"},
		{"4in6", Policy{Mode: DenyList, CIDRs: prefixes("::ffff:10.0.0.0/104")}, "no IPv6 egress"},
		{"zero prefix", Policy{Mode: AllowList, CIDRs: []netip.Prefix{{}}}, "not a valid prefix"},
		{"too many cidrs", Policy{Mode: AllowList, CIDRs: make([]netip.Prefix, MaxCIDRs+1)}, "at most 256"},
		{"too many domains", Policy{Mode: AllowList, Domains: many(MaxDomains+1, func(i int) string { return "a.test" })}, "at most 256"},
		{"empty domain", Policy{Mode: AllowList, Domains: []string{""}}, "empty name"},
		{"bare wildcard", Policy{Mode: AllowList, Domains: []string{"*."}}, "character '*'"},
		{"wildcard of nothing", Policy{Mode: AllowList, Domains: []string{"*.."}}, "empty name"},
		{"inner wildcard", Policy{Mode: AllowList, Domains: []string{"a.*.test"}}, "character '*'"},
		{"empty label", Policy{Mode: AllowList, Domains: []string{"a..test"}}, "empty label"},
		{"long label", Policy{Mode: AllowList, Domains: []string{strings.Repeat("a", 64) + ".test"}}, "longer than 63"},
		{"long name", Policy{Mode: AllowList, Domains: []string{strings.Repeat(strings.Repeat("a", 60)+".", 5) + "test"}}, "at most 253"},
		{"hyphen", Policy{Mode: AllowList, Domains: []string{"-a.test"}}, "starts or ends with '-'"},
		{"space", Policy{Mode: AllowList, Domains: []string{"a b.test"}}, "character ' '"},
		{"url", Policy{Mode: AllowList, Domains: []string{"http://a.test"}}, "character ':'"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.p.Validate()
			if tc.wantErr == "" {
				if err != nil {
					t.Fatalf("Validate = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.wantErr) || !errors.Is(err, ErrPolicy) {
				t.Fatalf("Validate = %v, want an ErrPolicy naming %q", err, tc.wantErr)
			}
		})
	}
}

func TestPolicyMatch(t *testing.T) {
	p := Policy{Mode: AllowList, Domains: []string{"Exact.Test.", "*.wild.test"}}.normalized()
	cases := []struct {
		name string
		want bool
	}{
		{"exact.test", true},
		{"sub.exact.test", false},
		{"wild.test", true},
		{"a.wild.test", true},
		{"a.b.wild.test", true},
		{"notwild.test", false},
		{"test", false},
		{"", false},
	}
	for _, tc := range cases {
		if got := p.matchName(tc.name); got != tc.want {
			t.Errorf("matchName(%q) = %v, want %v", tc.name, got, tc.want)
		}
	}
	a := netip.MustParseAddr("10.1.2.3")
	public := netip.MustParseAddr("11.1.2.3")
	meta := netip.MustParseAddr("169.254.169.254")
	cidr := []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}
	all := []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0")}
	allows := []struct {
		p       Policy
		addr    netip.Addr
		learned bool
		want    bool
	}{
		{Policy{Mode: AllowAll}, public, false, true},
		{Policy{Mode: AllowAll}, a, false, false},
		{Policy{Mode: AllowAll}, meta, false, false},
		{Policy{Mode: DenyAll}, public, true, false},
		{Policy{Mode: AllowList, CIDRs: cidr}, a, false, true},
		{Policy{Mode: AllowList, CIDRs: all}, a, false, false},
		{Policy{Mode: AllowList, CIDRs: all}, public, false, true},
		{Policy{Mode: AllowList, CIDRs: all}, meta, false, false},
		{Policy{Mode: AllowList}, a, false, false},
		{Policy{Mode: AllowList}, a, true, true},
		{Policy{Mode: DenyList, CIDRs: cidr}, a, false, false},
		{Policy{Mode: DenyList}, public, true, false},
		{Policy{Mode: DenyList}, public, false, true},
		{Policy{Mode: DenyList}, a, false, false},
		{Policy{Mode: DenyList}, meta, false, false},
	}
	for _, tc := range allows {
		refused := refusedSpans(DefaultRefused, tc.p)
		if got := tc.p.allows(tc.addr, tc.learned, refused); got != tc.want {
			t.Errorf("%v %v.allows(%v, learned %v) = %v, want %v", tc.p.Mode, tc.p.CIDRs, tc.addr, tc.learned, got, tc.want)
		}
	}
}

// TestMatchLabels: domains match label by label; a label with an
// escaped dot is one label (as the proxy sees names: unpacked from the
// wire by package dns).
func TestMatchLabels(t *testing.T) {
	p := Policy{Mode: AllowList, Domains: []string{"*.allowed.com", "exact.org"}}.normalized()
	for _, tc := range []struct {
		wire string // a name as a guest puts it in a query
		want bool
	}{
		{"a.allowed.com.", true},
		{"allowed.com.", true},
		{`a.b\.allowed.com.`, false},
		{`b\.allowed.com.`, false},
		{`x\046allowed.com.`, false},
		{"exact.org.", true},
		{`exact\.org.`, false},
		{"evilallowed.com.", false},
		{"allowed.com.evil.", false},
	} {
		q := new(dns.Msg)
		q.SetQuestion(tc.wire, dns.TypeA)
		b, err := q.Pack()
		if err != nil {
			t.Fatalf("%q: %v", tc.wire, err)
		}
		var got dns.Msg
		if err := got.Unpack(b); err != nil {
			t.Fatal(err)
		}
		name := canonicalName(got.Question[0].Name)
		if m := p.matchName(name); m != tc.want {
			t.Errorf("matchName(%q) = %v, want %v", name, m, tc.want)
		}
	}
}

// TestRefusedSpans: the refused ranges less an allow list's explicit
// CIDRs inside them; nothing exempt in other modes.
func TestRefusedSpans(t *testing.T) {
	r := func(s ...string) []netip.Prefix {
		var out []netip.Prefix
		for _, x := range s {
			out = append(out, netip.MustParsePrefix(x))
		}
		return out
	}
	ip := func(s string) uint64 {
		a := netip.MustParseAddr(s).As4()
		return uint64(a[0])<<24 | uint64(a[1])<<16 | uint64(a[2])<<8 | uint64(a[3])
	}
	for _, tc := range []struct {
		name    string
		refused []netip.Prefix
		p       Policy
		want    []span
	}{
		{"merged", r("10.0.0.0/8", "10.1.0.0/16", "11.0.0.0/8"), Policy{Mode: AllowAll}, []span{{ip("10.0.0.0"), ip("11.255.255.255")}}},
		{"deny list exempts nothing", r("10.0.0.0/8"), Policy{Mode: DenyList, CIDRs: r("10.1.0.0/16")}, []span{{ip("10.0.0.0"), ip("10.255.255.255")}}},
		{"hole", r("10.0.0.0/8"), Policy{Mode: AllowList, CIDRs: r("10.1.0.0/16")}, []span{{ip("10.0.0.0"), ip("10.0.255.255")}, {ip("10.2.0.0"), ip("10.255.255.255")}}},
		{"whole", r("10.0.0.0/8", "192.168.0.0/16"), Policy{Mode: AllowList, CIDRs: r("10.0.0.0/8")}, []span{{ip("192.168.0.0"), ip("192.168.255.255")}}},
		{"wider exempts nothing", r("10.0.0.0/8"), Policy{Mode: AllowList, CIDRs: r("0.0.0.0/0", "8.0.0.0/6")}, []span{{ip("10.0.0.0"), ip("10.255.255.255")}}},
		{"edges", r("240.0.0.0/4"), Policy{Mode: AllowList, CIDRs: r("240.0.0.0/32", "255.255.255.255/32")}, []span{{ip("240.0.0.1"), ip("255.255.255.254")}}},
		{"none", []netip.Prefix{}, Policy{Mode: AllowAll}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := refusedSpans(tc.refused, tc.p.normalized())
			if !slices.Equal(got, tc.want) {
				t.Errorf("refusedSpans = %v, want %v", got, tc.want)
			}
		})
	}
	// The metadata service, the host's LAN and loopback are in the
	// default list.
	d := refusedSpans(DefaultRefused, Policy{Mode: AllowAll})
	for _, a := range []string{"169.254.169.254", "192.168.1.1", "10.0.0.1", "172.16.0.1", "100.64.0.1", "127.0.0.1", "0.0.0.0", "255.255.255.255", "224.0.0.1"} {
		if !inSpans(d, netip.MustParseAddr(a)) {
			t.Errorf("%s is not refused by default", a)
		}
	}
	for _, a := range []string{"1.1.1.1", "11.99.1.1", "100.128.0.1", "172.32.0.1", "192.169.0.1"} {
		if inSpans(d, netip.MustParseAddr(a)) {
			t.Errorf("%s is refused by default", a)
		}
	}
}

func TestPool(t *testing.T) {
	pool := netip.MustParsePrefix("10.200.0.0/16")
	if n := poolBlocks(pool); n != 8192 {
		t.Errorf("poolBlocks(/16) = %d", n)
	}
	b := blockAt(pool, 1)
	for _, c := range []struct {
		got  netip.Prefix
		want string
	}{{b.hostEnd(), "10.200.0.9/30"}, {b.nsEnd(), "10.200.0.10/30"}, {b.gateway(), "10.200.0.13/30"}, {b.guest(), "10.200.0.14/30"}, {b.guestNet(), "10.200.0.12/30"}} {
		if c.got.String() != c.want {
			t.Errorf("block 1: %v, want %s", c.got, c.want)
		}
	}
	for _, bad := range []string{"10.0.0.0/30", "2001:db8::/64", "10.0.0.0/7"} {
		if err := checkPool(netip.MustParsePrefix(bad)); err == nil {
			t.Errorf("checkPool(%s) = nil", bad)
		}
	}
	a := newAllocator(3)
	var got []int
	for range 3 {
		i, err := a.alloc()
		if err != nil {
			t.Fatal(err)
		}
		got = append(got, i)
	}
	if _, err := a.alloc(); !errors.Is(err, ErrPoolExhausted) {
		t.Errorf("alloc on a full pool = %v", err)
	}
	a.free(got[1])
	if i, err := a.alloc(); err != nil || i != got[1] {
		t.Errorf("alloc after free = %d, %v, want %d", i, err, got[1])
	}
}
