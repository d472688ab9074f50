package e2b

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kilnvm/kiln/daemon/e2b/apikey"
)

// maxKeysFile bounds what is read of an API keys file.
const maxKeysFile = 1 << 20

// Bounds of one key and one tenant name.
const (
	minKeyLen = 8
	maxKeyLen = 256
)

// KeysError is a bad line of an API keys file (or of an inline key).
type KeysError struct {
	File string // the file, or "--e2b-api-key" for an inline key
	Line int    // 1-based; 0 for the file as a whole
	Err  error
}

func (e *KeysError) Error() string {
	if e.Line == 0 {
		return fmt.Sprintf("e2b api keys %s: %v", e.File, e.Err)
	}
	return fmt.Sprintf("e2b api keys %s:%d: %v", e.File, e.Line, e.Err)
}

func (e *KeysError) Unwrap() error { return e.Err }

// keyEntry is one API key: its SHA-256 (what lookups compare, so that a
// key is never held in the clear longer than parsing takes), tenant, and
// the quota fields its line sets for the tenant.
type keyEntry struct {
	sum    [sha256.Size]byte
	tenant string
	quota  quotaSet
	// pyRefused: E2B's Python SDK refuses this key's format before it
	// sends anything (PythonSDKAccepts).
	pyRefused bool
}

// keyTable is parsed keys: each key's tenant, and the quota fields the
// lines set for each tenant.
type keyTable struct {
	tenants map[[sha256.Size]byte]string
	quotas  map[string]quotaSet
	// quotaLine is where each tenant's quota field was set, for errors.
	quotaLine map[string]map[string]int
	// pyRefused are where the keys E2B's Python SDK refuses are given
	// ("FILE:LINE", "--e2b-api-key N").
	pyRefused []string
}

func newKeyTable() keyTable {
	return keyTable{tenants: map[[sha256.Size]byte]string{}, quotas: map[string]quotaSet{}, quotaLine: map[string]map[string]int{}}
}

// add adds e, from line n; errors are the line's.
func (kt keyTable) add(e keyEntry, n int) error {
	if _, dup := kt.tenants[e.sum]; dup {
		return errors.New("this key is given twice")
	}
	q := kt.quotas[e.tenant]
	if q == nil {
		q = quotaSet{}
		kt.quotas[e.tenant] = q
		kt.quotaLine[e.tenant] = map[string]int{}
	}
	// A tenant's quota is one, whichever of its keys' lines sets it:
	// lines that set one field must agree.
	for k, v := range e.quota {
		if old, ok := q[k]; ok && old != v {
			where := "elsewhere"
			if l := kt.quotaLine[e.tenant][k]; l > 0 {
				where = fmt.Sprintf("at line %d", l)
			}
			return fmt.Errorf("tenant %s's %s quota is %d here and %d %s: a tenant has one quota, give it once", e.tenant, k, v, old, where)
		}
		q[k] = v
		kt.quotaLine[e.tenant][k] = n
	}
	kt.tenants[e.sum] = e.tenant
	return nil
}

// parseKeys parses API keys, one "KEY TENANT [QUOTA=N ...]" a line;
// blank lines and lines starting with # are skipped. name is what errors
// call the text. A key given twice, a line without a key and a tenant,
// a key shorter than 8 bytes, a tenant name with characters other than
// letters, digits, '-', '_' and '.', or a bad quota field (sandboxes=N,
// memory=MiB, hibernated=MiB, snapshots=N; 0 is no limit) is an error
// naming the line.
func parseKeys(name string, text []byte) (keyTable, error) {
	out := newKeyTable()
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 0, 4096), maxKeysFile)
	n := 0
	for sc.Scan() {
		n++
		e, ok, err := parseKeyLine(sc.Text())
		if err != nil {
			return keyTable{}, &KeysError{File: name, Line: n, Err: err}
		}
		if !ok {
			continue
		}
		if err := out.add(e, n); err != nil {
			return keyTable{}, &KeysError{File: name, Line: n, Err: err}
		}
		if e.pyRefused {
			out.pyRefused = append(out.pyRefused, fmt.Sprintf("%s:%d", name, n))
		}
	}
	if err := sc.Err(); err != nil {
		return keyTable{}, &KeysError{File: name, Line: n + 1, Err: err}
	}
	return out, nil
}

// parseKeyLine parses one line; ok is false for a blank or comment line.
func parseKeyLine(line string) (e keyEntry, ok bool, err error) {
	line = strings.TrimSpace(line)
	if line == "" || strings.HasPrefix(line, "#") {
		return e, false, nil
	}
	f := strings.Fields(line)
	if len(f) < 2 {
		return e, false, fmt.Errorf("want KEY TENANT [sandboxes=N memory=MiB hibernated=MiB snapshots=N], got %d fields", len(f))
	}
	key, tenant := f[0], f[1]
	if len(key) < minKeyLen || len(key) > maxKeyLen {
		return e, false, fmt.Errorf("the key is %d bytes: want %d to %d", len(key), minKeyLen, maxKeyLen)
	}
	for _, c := range []byte(key) {
		if c < 0x21 || c > 0x7e {
			return e, false, errors.New("the key has a byte that is not printable ASCII")
		}
	}
	if err := apikey.CheckTenant(tenant); err != nil {
		return e, false, err
	}
	q := quotaSet{}
	for _, field := range f[2:] {
		if err := parseQuotaField(field, q); err != nil {
			return e, false, err
		}
	}
	return keyEntry{sum: sha256.Sum256([]byte(key)), tenant: tenant, quota: q, pyRefused: !PythonSDKAccepts(key)}, true, nil
}

// PythonSDKAccepts reports whether E2B's Python SDK accepts key's format
// (apikey.PythonSDKAccepts).
func PythonSDKAccepts(key string) bool { return apikey.PythonSDKAccepts(key) }

// Keys are the API keys kilnd takes, with their tenants and the
// tenants' quotas: a keys file (re-read when its modification time or
// size changes, or on Reload) and keys given inline (--e2b-api-key). A
// key must not appear in both.
type Keys struct {
	file   string
	inline keyTable
	def    Quota // a tenant's quota where no line sets it

	mu      sync.Mutex
	keys    keyTable  // the file's and the inline ones
	modTime time.Time // the file's when last read (or tried)
	size    int64
}

// LoadKeys reads the keys file (when file is not "") and the inline
// "KEY TENANT [QUOTA=N ...]" values; def is every tenant's quota where no
// line sets one. The file must give others (not its owner or group) no
// access: a world-readable keys file is an error.
func LoadKeys(file string, inline []string, def Quota) (*Keys, error) {
	k := &Keys{file: file, inline: newKeyTable(), def: def}
	for i, l := range inline {
		e, ok, err := parseKeyLine(l)
		if err == nil && !ok {
			err = errors.New("empty")
		}
		if err == nil {
			err = k.inline.add(e, i+1)
		}
		if err != nil {
			return nil, &KeysError{File: "--e2b-api-key", Line: i + 1, Err: err}
		}
		if e.pyRefused {
			k.inline.pyRefused = append(k.inline.pyRefused, fmt.Sprintf("--e2b-api-key %d", i+1))
		}
	}
	k.keys = k.inline
	if file != "" {
		if err := k.Reload(); err != nil {
			return nil, err
		}
	}
	return k, nil
}

// Len is how many keys there are.
func (k *Keys) Len() int {
	k.mu.Lock()
	defer k.mu.Unlock()
	return len(k.keys.tenants)
}

// Reload re-reads the keys file. On an error the keys stay as they were.
func (k *Keys) Reload() error {
	if k.file == "" {
		return nil
	}
	fi, err := os.Stat(k.file)
	if err != nil {
		return &KeysError{File: k.file, Err: err}
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.reloadLocked(fi)
}

func (k *Keys) reloadLocked(fi os.FileInfo) error {
	if !fi.Mode().IsRegular() {
		return &KeysError{File: k.file, Err: errors.New("not a regular file")}
	}
	if fi.Mode().Perm()&0o007 != 0 {
		return &KeysError{File: k.file, Err: fmt.Errorf("mode %04o lets every user of the host read it: chmod o-rwx it", fi.Mode().Perm())}
	}
	if fi.Size() > maxKeysFile {
		return &KeysError{File: k.file, Err: fmt.Errorf("%d bytes: at most %d", fi.Size(), maxKeysFile)}
	}
	b, err := os.ReadFile(k.file)
	if err != nil {
		return &KeysError{File: k.file, Err: err}
	}
	m, err := parseKeys(k.file, b)
	if err != nil {
		return err
	}
	all := newKeyTable()
	for s, t := range k.inline.tenants {
		all.add(keyEntry{sum: s, tenant: t, quota: k.inline.quotas[t]}, 0) // checked by LoadKeys: no error
	}
	for s, t := range m.tenants {
		if _, dup := all.tenants[s]; dup {
			return &KeysError{File: k.file, Err: errors.New("a key is also given by --e2b-api-key")}
		}
		if err := all.add(keyEntry{sum: s, tenant: t, quota: m.quotas[t]}, 0); err != nil {
			return &KeysError{File: k.file, Err: fmt.Errorf("%w (the other is an --e2b-api-key's)", err)}
		}
	}
	all.pyRefused = append(slices.Clone(k.inline.pyRefused), m.pyRefused...)
	k.keys, k.modTime, k.size = all, fi.ModTime(), fi.Size()
	return nil
}

// PythonSDKRefuses says where the keys are given ("FILE:LINE" or
// "--e2b-api-key N", never the keys) whose format E2B's Python SDK
// refuses before it sends them (PythonSDKAccepts): clients of those keys
// need E2B_VALIDATE_API_KEY=false, or a key in E2B's format.
func (k *Keys) PythonSDKRefuses() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Clone(k.keys.pyRefused)
}

// caller is who an API key is: its tenant and the key's SHA-256 (what
// envd access tokens are bound to, so that revoking the key revokes
// them).
type caller struct {
	tenant string
	key    [sha256.Size]byte
}

// Tenant returns the tenant of key, re-reading the keys file first when
// it changed. changeErr is a failed re-read's error, returned once per
// change of the file (the old keys then still hold).
func (k *Keys) Tenant(key string) (tenant string, ok bool, changeErr error) {
	c, ok, changeErr := k.lookup(key)
	return c.tenant, ok, changeErr
}

func (k *Keys) lookup(key string) (c caller, ok bool, changeErr error) {
	var fi os.FileInfo
	if k.file != "" {
		fi, _ = os.Stat(k.file)
	}
	sum := sha256.Sum256([]byte(key))
	k.mu.Lock()
	defer k.mu.Unlock()
	k.refreshLocked(fi, &changeErr)
	// Compare every key's digest in constant time, so that the time
	// taken tells nothing of which (or whether one) matched.
	found := ""
	for s, t := range k.keys.tenants {
		if subtle.ConstantTimeCompare(s[:], sum[:]) == 1 {
			found = t
		}
	}
	return caller{tenant: found, key: sum}, found != "", changeErr
}

// refreshLocked re-reads the keys file when fi says it changed; k.mu is
// held.
func (k *Keys) refreshLocked(fi os.FileInfo, changeErr *error) {
	if fi != nil && (!fi.ModTime().Equal(k.modTime) || fi.Size() != k.size) {
		if err := k.reloadLocked(fi); err != nil {
			// Tried once per change, not on every request.
			k.modTime, k.size = fi.ModTime(), fi.Size()
			*changeErr = err
		}
	}
}

// sumsOf returns the digests of tenant's keys now (the keys file re-read
// first when it changed).
func (k *Keys) sumsOf(tenant string) [][sha256.Size]byte {
	var fi os.FileInfo
	if k.file != "" {
		fi, _ = os.Stat(k.file)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	var ignored error // reported by the next lookup's caller
	k.refreshLocked(fi, &ignored)
	var out [][sha256.Size]byte
	for s, t := range k.keys.tenants {
		if t == tenant {
			out = append(out, s)
		}
	}
	return out
}

// Quota is tenant's quota: the fields its keys' lines set over the
// default (kilnd's --e2b-tenant-* flags).
func (k *Keys) Quota(tenant string) Quota {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.keys.quotas[tenant].over(k.def)
}
