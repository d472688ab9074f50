package hostnet

import (
	"context"
	"errors"
	"net/netip"
	"slices"
	"testing"
	"time"
)

// TestResolveDenied: a deny list's domains (a wildcard's base name, each
// name once) are resolved from upstream and learned for their TTL plus
// denyGrace; the next round is due at the least TTL, or at denyRetry
// after a failure; other modes resolve nothing.
func TestResolveDenied(t *testing.T) {
	for _, tc := range []struct {
		name     string
		p        Policy
		fail     bool
		learnErr error
		asked    []string
		learned  []learnCall
		next     time.Duration
	}{
		{name: "allow-all", p: Policy{Mode: AllowAll}},
		{name: "allow list", p: Policy{Mode: AllowList, Domains: []string{"allowed.test"}}},
		{name: "deny list, no domains", p: Policy{Mode: DenyList, CIDRs: []netip.Prefix{netip.MustParsePrefix("11.0.0.0/8")}}},
		{
			name:  "deny list",
			p:     Policy{Mode: DenyList, Domains: []string{"denied.test", "*.denied.test", "allowed.test"}},
			asked: []string{"allowed.test.", "denied.test."},
			learned: []learnCall{
				{"allowed.test", true, []netip.Addr{netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")}, minLearnTTL + denyGrace},
				{"denied.test", true, []netip.Addr{netip.MustParseAddr("198.51.100.1")}, 300*time.Second + denyGrace},
			},
			next: minLearnTTL,
		},
		{
			name:  "a name with no addresses is asked again later",
			p:     Policy{Mode: DenyList, Domains: []string{"nowhere.test"}},
			asked: []string{"nowhere.test."},
			next:  denyEmptyRetry,
		},
		{
			name:  "upstream down",
			p:     Policy{Mode: DenyList, Domains: []string{"denied.test"}},
			fail:  true,
			asked: []string{"denied.test."},
			next:  denyRetry,
		},
		{
			name:     "learning fails",
			p:        Policy{Mode: DenyList, Domains: []string{"denied.test"}},
			learnErr: errors.New("set full"),
			asked:    []string{"denied.test."},
			learned:  []learnCall{{"denied.test", true, []netip.Addr{netip.MustParseAddr("198.51.100.1")}, 300*time.Second + denyGrace}},
			next:     denyRetry,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			up := &zoneUpstream{fail: tc.fail}
			l := &learnLog{err: tc.learnErr}
			next := resolveDenied(context.Background(), up, l.learn, tc.p.normalized(), newRateLog(quietLog(), time.Second))
			if next != tc.next {
				t.Errorf("next round in %v, want %v", next, tc.next)
			}
			asked := slices.Clone(up.asked)
			slices.Sort(asked)
			if !slices.Equal(asked, tc.asked) {
				t.Errorf("asked %v, want %v", asked, tc.asked)
			}
			got := l.calls()
			slices.SortFunc(got, func(a, b learnCall) int {
				if a.name < b.name {
					return -1
				}
				return 1
			})
			if len(got) != len(tc.learned) {
				t.Fatalf("learned %+v, want %+v", got, tc.learned)
			}
			for i := range got {
				g, w := got[i], tc.learned[i]
				if g.name != w.name || g.deny != w.deny || !slices.Equal(g.addrs, w.addrs) || g.ttl != w.ttl {
					t.Errorf("learned %+v, want %+v", g, w)
				}
			}
		})
	}
}
