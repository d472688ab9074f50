package e2b

import (
	"fmt"
	"strconv"
	"strings"
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
