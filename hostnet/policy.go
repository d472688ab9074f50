package hostnet

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"
	"strings"

	"github.com/miekg/dns"
)

// Mode is what an egress Policy does with traffic its lists do not name.
type Mode int

// The egress modes.
const (
	// AllowAll lets the guest reach everything outside kiln's pool. It
	// takes no lists.
	AllowAll Mode = iota
	// DenyAll lets nothing out; every DNS query is refused. It takes no
	// lists.
	DenyAll
	// AllowList lets out only traffic to CIDRs and to addresses the DNS
	// proxy resolved for Domains; queries for other names are refused.
	AllowList
	// DenyList lets out everything but traffic to CIDRs and to Domains'
	// addresses; queries for Domains are answered NXDOMAIN.
	DenyList
)

// Bounds on a Policy: what one sandbox can make kilnd hold in nftables and
// match per DNS query.
const (
	MaxCIDRs   = 256
	MaxDomains = 256
)

// String names the mode.
func (m Mode) String() string {
	switch m {
	case AllowAll:
		return "allow-all"
	case DenyAll:
		return "deny-all"
	case AllowList:
		return "allow-list"
	case DenyList:
		return "deny-list"
	}
	return fmt.Sprintf("Mode(%d)", int(m))
}

// Policy is a sandbox's egress policy. CIDRs are IPv4 only: sandboxes get
// no IPv6 (their namespace has it disabled and drops it). A domain is a name
// ("example.com", matching only itself) or a wildcard ("*.example.com",
// matching example.com itself and every name under it); names are matched
// case-insensitively, a trailing dot is ignored.
type Policy struct {
	Mode    Mode
	CIDRs   []netip.Prefix
	Domains []string
}

// ErrPolicy is wrapped by every error Validate returns.
var ErrPolicy = errors.New("invalid egress policy")

// Validate reports what is wrong with p: a mode out of range, lists on a
// mode that takes none, too many entries, an invalid or IPv6 prefix, a
// domain that is not a valid name. Errors wrap ErrPolicy.
func (p Policy) Validate() error {
	switch p.Mode {
	case AllowAll, DenyAll:
		if len(p.CIDRs) > 0 || len(p.Domains) > 0 {
			return fmt.Errorf("%w: mode %v takes no CIDRs or domains (got %d and %d)", ErrPolicy, p.Mode, len(p.CIDRs), len(p.Domains))
		}
	case AllowList, DenyList:
	default:
		return fmt.Errorf("%w: mode %d is out of range", ErrPolicy, int(p.Mode))
	}
	if len(p.CIDRs) > MaxCIDRs {
		return fmt.Errorf("%w: %d CIDRs, at most %d", ErrPolicy, len(p.CIDRs), MaxCIDRs)
	}
	if len(p.Domains) > MaxDomains {
		return fmt.Errorf("%w: %d domains, at most %d", ErrPolicy, len(p.Domains), MaxDomains)
	}
	for i, c := range p.CIDRs {
		if !c.IsValid() {
			return fmt.Errorf("%w: CIDR %d is not a valid prefix", ErrPolicy, i)
		}
		if !c.Addr().Is4() {
			return fmt.Errorf("%w: CIDR %s: sandboxes have no IPv6 egress, only IPv4 prefixes are allowed", ErrPolicy, c)
		}
	}
	for _, d := range p.Domains {
		if err := CheckDomain(d); err != nil {
			return fmt.Errorf("%w: domain %q: %w", ErrPolicy, d, err)
		}
	}
	return nil
}

// normalized returns a copy of a valid p with masked prefixes and domains
// lower-cased without a trailing dot.
func (p Policy) normalized() Policy {
	q := Policy{Mode: p.Mode}
	for _, c := range p.CIDRs {
		q.CIDRs = append(q.CIDRs, c.Masked())
	}
	for _, d := range p.Domains {
		q.Domains = append(q.Domains, canonicalName(d))
	}
	return q
}

// canonicalName lower-cases a DNS name and drops its trailing dot.
func canonicalName(name string) string {
	return strings.ToLower(strings.TrimSuffix(name, "."))
}

// CheckDomain checks a policy domain's syntax: an optional leading "*."
// and then a name of letters, digits, '-' and '_' in labels of 1..63
// characters, 253 at most in all.
func CheckDomain(d string) error {
	name := strings.TrimSuffix(d, ".")
	if rest, ok := strings.CutPrefix(name, "*."); ok {
		name = rest
	}
	if name == "" {
		return errors.New("empty name")
	}
	if len(name) > 253 {
		return fmt.Errorf("%d characters, at most 253", len(name))
	}
	for label := range strings.SplitSeq(name, ".") {
		if label == "" {
			return errors.New("empty label")
		}
		if len(label) > 63 {
			return fmt.Errorf("label %q is longer than 63 characters", label)
		}
		if label[0] == '-' || label[len(label)-1] == '-' {
			return fmt.Errorf("label %q starts or ends with '-'", label)
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return fmt.Errorf("label %q: character %q is not a letter, digit, '-' or '_'", label, c)
			}
		}
	}
	return nil
}

// matchName reports whether a (canonical) query name matches one of p's
// (normalized) domains, label by label: a query label that holds an
// escaped dot stands for one label, never two ("a.b\.allowed.com" is the
// labels "a", "b.allowed" and "com", not a name under allowed.com).
func (p Policy) matchName(name string) bool {
	labels := dns.SplitDomainName(name)
	for _, d := range p.Domains {
		base, wild := strings.CutPrefix(d, "*.")
		want := strings.Split(base, ".")
		if len(labels) < len(want) || !wild && len(labels) != len(want) {
			continue
		}
		if slices.Equal(labels[len(labels)-len(want):], want) {
			return true
		}
	}
	return false
}

// inCIDRs reports whether a is in one of p's prefixes.
func (p Policy) inCIDRs(a netip.Addr) bool {
	for _, c := range p.CIDRs {
		if c.Contains(a) {
			return true
		}
	}
	return false
}

// allows reports whether p lets the guest open a connection to a, where
// learned says whether the DNS proxy learned a for the policy's domains
// and refused is refusedSpans for p.
func (p Policy) allows(a netip.Addr, learned bool, refused []span) bool {
	switch p.Mode {
	case AllowAll:
		return !inSpans(refused, a)
	case AllowList:
		return learned || p.inCIDRs(a) && !inSpans(refused, a)
	case DenyList:
		return !p.inCIDRs(a) && !learned && !inSpans(refused, a)
	}
	return false
}
