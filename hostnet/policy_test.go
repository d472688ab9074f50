package hostnet

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
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
	cidr := []netip.Prefix{netip.MustParsePrefix("10.1.0.0/16")}
	allows := []struct {
		p       Policy
		addr    netip.Addr
		learned bool
		want    bool
	}{
		{Policy{Mode: AllowAll}, a, false, true},
		{Policy{Mode: DenyAll}, a, true, false},
		{Policy{Mode: AllowList, CIDRs: cidr}, a, false, true},
		{Policy{Mode: AllowList}, a, false, false},
		{Policy{Mode: AllowList}, a, true, true},
		{Policy{Mode: DenyList, CIDRs: cidr}, a, false, false},
		{Policy{Mode: DenyList}, a, true, false},
		{Policy{Mode: DenyList}, a, false, true},
	}
	for _, tc := range allows {
		if got := tc.p.allows(tc.addr, tc.learned); got != tc.want {
			t.Errorf("%v.allows(%v, learned %v) = %v, want %v", tc.p.Mode, tc.addr, tc.learned, got, tc.want)
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
