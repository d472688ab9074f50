package e2b

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Quota is what one tenant's sandboxes may hold of the host; a zero
// field is no limit of that kind. kilnd's --e2b-tenant-* flags give every
// tenant's, and a keys file line may give its tenant's own
// (sandboxes=N memory=MiB hibernated=MiB snapshots=N).
type Quota struct {
	// Sandboxes is how many live sandboxes (running or paused).
	Sandboxes uint64
	// MemoryMiB is the guest memory of its running sandboxes.
	MemoryMiB uint64
	// HibernatedMiB is what its paused (hibernated) sandboxes' state may
	// take on disk, each counted at its most: its guest memory and its
	// writable disk cap.
	HibernatedMiB uint64
	// Snapshots is how many snapshots it keeps.
	Snapshots uint64
}

// quotaFields are a keys file line's quota fields, by name, with what
// each sets.
var quotaFields = []struct {
	name string
	p    func(*Quota) *uint64
}{
	{"sandboxes", func(q *Quota) *uint64 { return &q.Sandboxes }},
	{"memory", func(q *Quota) *uint64 { return &q.MemoryMiB }},
	{"hibernated", func(q *Quota) *uint64 { return &q.HibernatedMiB }},
	{"snapshots", func(q *Quota) *uint64 { return &q.Snapshots }},
}

// MaxQuotaValue bounds a quota field (so that sums of them cannot wrap).
const MaxQuotaValue = 1 << 40

// quotaSet is the fields a line sets: a tenant's quota is the default's
// with these over it.
type quotaSet map[string]uint64

// parseQuotaField parses one NAME=N field of a keys file line.
func parseQuotaField(f string, into quotaSet) error {
	k, v, ok := strings.Cut(f, "=")
	if !ok {
		return fmt.Errorf("field %.40q: want NAME=N (sandboxes, memory, hibernated or snapshots)", f)
	}
	known := false
	for _, q := range quotaFields {
		known = known || q.name == k
	}
	if !known {
		return fmt.Errorf("field %.40q: unknown quota %.20q (want sandboxes, memory, hibernated or snapshots)", f, k)
	}
	if _, dup := into[k]; dup {
		return fmt.Errorf("quota %s is given twice", k)
	}
	n, err := strconv.ParseUint(v, 10, 64)
	if err != nil || n > MaxQuotaValue || v != strconv.FormatUint(n, 10) {
		return fmt.Errorf("quota %s=%.20q: want a whole number from 0 (no limit) to %d", k, v, uint64(MaxQuotaValue))
	}
	into[k] = n
	return nil
}

// over returns def with the set fields over it.
func (qs quotaSet) over(def Quota) Quota {
	for _, f := range quotaFields {
		if n, ok := qs[f.name]; ok {
			*f.p(&def) = n
		}
	}
	return def
}

// usage is what a tenant's sandboxes and snapshots hold, as a Quota
// counts it.
type usage Quota

// exceeds names the first kind of q that u plus add passes, or "".
func (u usage) exceeds(add usage, q Quota) string {
	for _, c := range []struct {
		name      string
		have, add uint64
		limit     uint64
		unit      string
	}{
		{"sandboxes", u.Sandboxes, add.Sandboxes, q.Sandboxes, ""},
		{"memory", u.MemoryMiB, add.MemoryMiB, q.MemoryMiB, " MiB"},
		{"hibernated", u.HibernatedMiB, add.HibernatedMiB, q.HibernatedMiB, " MiB"},
		{"snapshots", u.Snapshots, add.Snapshots, q.Snapshots, ""},
	} {
		if c.add > 0 && c.limit > 0 && c.have+c.add > c.limit {
			return fmt.Sprintf("%s quota of %d%s (you have %d%s, this needs %d%s more)", c.name, c.limit, c.unit, c.have, c.unit, c.add, c.unit)
		}
	}
	return ""
}

// admission admits tenants' requests against their quotas: what a
// tenant holds now (its sandboxes as kilnd lists them, its snapshots in
// the index) and what its requests under way were admitted for. The
// listing is taken under mu, after every admitted request either still
// counts as pending or is done (and then listed), so that two requests
// cannot both take a tenant's last place.
type admission struct {
	mu      sync.Mutex
	pending map[string]usage // by tenant
}

// QuotaError is a request refused for its tenant's quota: its message
// names the tenant's own quota, nothing of other tenants or the host.
type QuotaError struct {
	Tenant string
	What   string // the quota passed, as exceeds says it
}

func (e *QuotaError) Error() string {
	return fmt.Sprintf("capacity: tenant %s is at its %s", e.Tenant, e.What)
}

// admit checks that tenant may add add, and counts it as pending until
// done is called (after the request, whatever its outcome).
func (s *Server) admit(ctx context.Context, tenant string, add usage) (done func(), err error) {
	q := s.keys.Quota(tenant)
	if q == (Quota{}) {
		return func() {}, nil
	}
	a := &s.admission
	a.mu.Lock()
	defer a.mu.Unlock()
	have, err := s.usage(ctx, tenant)
	if err != nil {
		return nil, err
	}
	p := a.pending[tenant]
	have.Sandboxes += p.Sandboxes
	have.MemoryMiB += p.MemoryMiB
	have.HibernatedMiB += p.HibernatedMiB
	have.Snapshots += p.Snapshots
	if what := have.exceeds(add, q); what != "" {
		return nil, &QuotaError{Tenant: tenant, What: what}
	}
	if a.pending == nil {
		a.pending = map[string]usage{}
	}
	p.Sandboxes += add.Sandboxes
	p.MemoryMiB += add.MemoryMiB
	p.HibernatedMiB += add.HibernatedMiB
	p.Snapshots += add.Snapshots
	a.pending[tenant] = p
	var once sync.Once
	return func() {
		once.Do(func() {
			a.mu.Lock()
			defer a.mu.Unlock()
			p := a.pending[tenant]
			p.Sandboxes -= add.Sandboxes
			p.MemoryMiB -= add.MemoryMiB
			p.HibernatedMiB -= add.HibernatedMiB
			p.Snapshots -= add.Snapshots
			if p == (usage{}) {
				delete(a.pending, tenant)
			} else {
				a.pending[tenant] = p
			}
		})
	}, nil
}

// usage is what tenant holds now.
func (s *Server) usage(ctx context.Context, tenant string) (usage, error) {
	resp, err := s.kiln.ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{Labels: map[string]string{TenantLabel: tenant}})
	if err != nil {
		return usage{}, fmt.Errorf("counting tenant %s's sandboxes: %w", tenant, err)
	}
	var u usage
	for _, sb := range resp.GetSandboxes() {
		if !isLive(sb.GetState()) || sb.GetLabels()[TenantLabel] != tenant {
			continue
		}
		u.Sandboxes++
		if sb.GetState() == kilnpb.SandboxState_SANDBOX_STATE_PAUSED {
			u.HibernatedMiB += hibernatedMiB(sb)
		} else {
			u.MemoryMiB += uint64(sb.GetResources().GetMemoryMib())
		}
	}
	u.Snapshots = uint64(len(s.snaps.list(tenant)))
	return u, nil
}

// hibernatedMiB is the most a paused sandbox's state takes on disk: its
// guest memory and its writable layer's cap (half its memory when it
// has none, as listed says).
func hibernatedMiB(sb *kilnpb.Sandbox) uint64 {
	res := sb.GetResources()
	disk := res.GetDiskMib()
	if disk == 0 {
		disk = res.GetMemoryMib() / 2
	}
	return uint64(res.GetMemoryMib()) + uint64(disk)
}
