package hostnet

import (
	"context"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// Deny lists by domain are resolved by kilnd itself, not only when a guest
// asks the proxy: at attach, on a policy change and again as each answer's
// TTL runs out, so that a guest that learned a denied name's address some
// other way (its own resolver, DNS over HTTPS, a literal address) is still
// refused it.
const (
	// denyGrace is how much longer than its TTL a resolved address stays
	// in deny_dns: the refresh at the TTL has that long to land.
	denyGrace = 30 * time.Second
	// denyRetry is when a failed resolution is tried again.
	denyRetry = minLearnTTL
	// denyEmptyRetry is when a name that had no address is asked again.
	denyEmptyRetry = 5 * time.Minute
	// denyParallel bounds a round's queries in flight.
	denyParallel = 8
	// denyWait bounds how long Attach, Adopt and SetPolicy wait for a
	// round before they return (it goes on in the background).
	denyWait = 5 * time.Second
)

// denyName is the name a deny-list domain is resolved as: the domain
// itself, and for "*.example.com" example.com (the names under it cannot
// be listed; the proxy denies them when the guest asks).
func denyName(d string) string { return strings.TrimPrefix(d, "*.") }

// resolveDenied resolves every domain of p, a deny list, from upstream and
// learns the addresses (deny, for their TTL plus denyGrace). It returns
// when the next round is due: the least TTL, or denyRetry after a failure;
// zero when p has nothing to resolve.
func resolveDenied(ctx context.Context, up exchanger, learn learner, p Policy, log *rateLog) time.Duration {
	if p.Mode != DenyList || len(p.Domains) == 0 {
		return 0
	}
	var (
		mu   sync.Mutex
		next = maxLearnTTL
		wg   sync.WaitGroup
		sem  = make(chan struct{}, denyParallel)
		seen = map[string]bool{}
	)
	for _, d := range p.Domains {
		name := denyName(d)
		if seen[name] {
			continue
		}
		seen[name] = true
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
			return denyRetry
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			wait := denyRetry
			q := new(dns.Msg)
			q.SetQuestion(dns.Fqdn(name), dns.TypeA)
			resp, err := up.exchange(ctx, q)
			switch {
			case err != nil:
				log.Warn("deny list: resolving a denied domain failed; trying again", "name", name, "in", denyRetry, "err", err)
			default:
				addrs, ttl := answerAddrs(resp)
				if len(addrs) == 0 {
					wait = denyEmptyRetry
					break
				}
				wait = ttl
				if err := learn(name, true, addrs, ttl+denyGrace); err != nil {
					log.Warn("deny list: adding a denied domain's addresses failed", "name", name, "err", err)
					wait = denyRetry
				}
			}
			mu.Lock()
			next = min(next, wait)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return next
}
