package hostnet

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
)

// blockBits is the size of the address block each attachment takes from
// the pool: a /29, split into two /30s. The first /30 numbers the veth
// (host end .1, sandbox end .2), the second the tap (gateway .5, guest .6).
const blockBits = 3

// block is an attachment's /29 in the pool.
type block struct {
	base netip.Addr // the /29's first address
}

func (b block) add(n uint32) netip.Addr {
	a := b.base.As4()
	binary.BigEndian.PutUint32(a[:], binary.BigEndian.Uint32(a[:])+n)
	return netip.AddrFrom4(a)
}

// hostEnd is the host netns's address on the veth.
func (b block) hostEnd() netip.Prefix { return netip.PrefixFrom(b.add(1), 30) }

// nsEnd is the sandbox netns's address on the veth.
func (b block) nsEnd() netip.Prefix { return netip.PrefixFrom(b.add(2), 30) }

// gateway is the tap's address in the sandbox netns.
func (b block) gateway() netip.Prefix { return netip.PrefixFrom(b.add(5), 30) }

// guest is the guest's address.
func (b block) guest() netip.Prefix { return netip.PrefixFrom(b.add(6), 30) }

// guestNet is the guest's /30, routed from the host netns via the veth.
func (b block) guestNet() netip.Prefix { return netip.PrefixFrom(b.add(4), 30) }

// poolBlocks is how many /29 blocks pool holds.
func poolBlocks(pool netip.Prefix) int {
	return 1 << (32 - pool.Bits() - blockBits)
}

// blockAt is the pool's index'th block.
func blockAt(pool netip.Prefix, index int) block {
	return block{base: block{base: pool.Masked().Addr()}.add(uint32(index) << blockBits)}
}

// checkPool checks that pool is an IPv4 prefix with room for a block.
func checkPool(pool netip.Prefix) error {
	if !pool.IsValid() || !pool.Addr().Is4() {
		return fmt.Errorf("hostnet: pool %v: want an IPv4 prefix", pool)
	}
	if pool.Bits() > 32-blockBits {
		return fmt.Errorf("hostnet: pool %v: want /%d or larger (each sandbox takes a /%d)", pool, 32-blockBits, 32-blockBits)
	}
	if pool.Bits() < 8 {
		return fmt.Errorf("hostnet: pool %v: want /8 or smaller", pool)
	}
	return nil
}

// record is what the manager keeps on disk per attachment, so that a later
// manager adopts it and does not reuse its block.
type record struct {
	ID     string `json:"id"`
	Index  int    `json:"index"`
	MAC    string `json:"mac"`
	Policy Policy `json:"policy"`
}

// recordDir and netnsDir are under the manager's Dir.
func recordDir(dir string) string { return filepath.Join(dir, "records") }
func netnsDir(dir string) string  { return filepath.Join(dir, "netns") }

func recordPath(dir, id string) string { return filepath.Join(recordDir(dir), id+".json") }

// writeRecord writes r durably (temporary file, fsync, rename).
func writeRecord(dir string, r record) error {
	data, err := json.Marshal(r)
	if err != nil {
		return fmt.Errorf("hostnet: encoding the record of %s: %w", r.ID, err)
	}
	path := recordPath(dir, r.ID)
	tmp := path + ".tmp"
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return fmt.Errorf("hostnet: writing the record of %s: %w", r.ID, err)
	}
	_, err = f.Write(data)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("hostnet: writing the record of %s: %w", r.ID, err)
	}
	return nil
}

// readRecords reads every record under dir; a record that does not parse
// or does not fit pool is an error naming its file.
func readRecords(dir string, pool netip.Prefix) ([]record, error) {
	paths, err := filepath.Glob(filepath.Join(recordDir(dir), "*.json"))
	if err != nil {
		return nil, fmt.Errorf("hostnet: listing records: %w", err)
	}
	var out []record
	seen := map[int]string{}
	for _, p := range paths {
		data, err := os.ReadFile(p)
		if err != nil {
			return nil, fmt.Errorf("hostnet: reading record %s: %w", p, err)
		}
		var r record
		if err := json.Unmarshal(data, &r); err != nil {
			return nil, fmt.Errorf("hostnet: record %s: %w", p, err)
		}
		if err := checkID(r.ID); err != nil || filepath.Base(p) != r.ID+".json" {
			return nil, fmt.Errorf("hostnet: record %s names sandbox %q", p, r.ID)
		}
		if r.Index < 0 || r.Index >= poolBlocks(pool) {
			return nil, fmt.Errorf("hostnet: record %s: block %d is outside pool %v (was the pool changed under live sandboxes?)", p, r.Index, pool)
		}
		if other, ok := seen[r.Index]; ok {
			return nil, fmt.Errorf("hostnet: records of %s and %s hold the same block %d", other, r.ID, r.Index)
		}
		if err := r.Policy.Validate(); err != nil {
			return nil, fmt.Errorf("hostnet: record %s: %w", p, err)
		}
		seen[r.Index] = r.ID
		out = append(out, r)
	}
	return out, nil
}

// ErrNotFound is returned (wrapped) for a sandbox id with no attachment.
var ErrNotFound = errors.New("no network attachment")

// ErrExists is returned (wrapped) by Attach for an id already attached.
var ErrExists = errors.New("network attachment exists")

// ErrPoolExhausted is returned (wrapped) by Attach when every block of the
// pool is in use.
var ErrPoolExhausted = errors.New("address pool exhausted")

// checkID checks that a sandbox id can name files: 1..64 letters, digits,
// '-', '_' or '.', not starting with '.'.
func checkID(id string) error {
	if id == "" || len(id) > 64 || id[0] == '.' {
		return fmt.Errorf("hostnet: sandbox id %q: want 1..64 characters, not starting with '.'", id)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return fmt.Errorf("hostnet: sandbox id %q: character %q is not a letter, digit, '-', '_' or '.'", id, c)
		}
	}
	return nil
}

// allocator hands out pool blocks next-fit, so a just-freed block is the
// last to be reused.
type allocator struct {
	n    int
	next int
	used map[int]bool
}

func newAllocator(n int) *allocator { return &allocator{n: n, used: map[int]bool{}} }

func (a *allocator) take(i int) { a.used[i] = true }

func (a *allocator) alloc() (int, error) {
	if len(a.used) >= a.n {
		return 0, fmt.Errorf("hostnet: %w: all %d blocks in use", ErrPoolExhausted, a.n)
	}
	for range a.n {
		i := a.next
		a.next = (a.next + 1) % a.n
		if !a.used[i] {
			a.used[i] = true
			return i, nil
		}
	}
	return 0, fmt.Errorf("hostnet: %w", ErrPoolExhausted)
}

func (a *allocator) free(i int) { delete(a.used, i) }
