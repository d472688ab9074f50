package e2b

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"
)

// maxKeysFile bounds what is read of an API keys file.
const maxKeysFile = 1 << 20

// Bounds of one key and one tenant name.
const (
	minKeyLen    = 8
	maxKeyLen    = 256
	maxTenantLen = 128
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
// key is never held in the clear longer than parsing takes) and tenant.
type keyEntry struct {
	sum    [sha256.Size]byte
	tenant string
}

// ParseKeys parses API keys, one "KEY TENANT" a line; blank lines and
// lines starting with # are skipped. name is what errors call the text.
// A key given twice, a line without exactly two fields, a key shorter
// than 8 bytes or a tenant name with characters other than letters,
// digits, '-', '_' and '.' is an error naming the line.
func ParseKeys(name string, text []byte) (map[[sha256.Size]byte]string, error) {
	out := map[[sha256.Size]byte]string{}
	sc := bufio.NewScanner(bytes.NewReader(text))
	sc.Buffer(make([]byte, 0, 4096), maxKeysFile)
	n := 0
	for sc.Scan() {
		n++
		e, ok, err := parseKeyLine(sc.Text())
		if err != nil {
			return nil, &KeysError{File: name, Line: n, Err: err}
		}
		if !ok {
			continue
		}
		if _, dup := out[e.sum]; dup {
			return nil, &KeysError{File: name, Line: n, Err: errors.New("this key is given twice")}
		}
		out[e.sum] = e.tenant
	}
	if err := sc.Err(); err != nil {
		return nil, &KeysError{File: name, Line: n + 1, Err: err}
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
	if len(f) != 2 {
		return e, false, fmt.Errorf("want KEY TENANT, got %d fields", len(f))
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
	if err := checkTenant(tenant); err != nil {
		return e, false, err
	}
	return keyEntry{sum: sha256.Sum256([]byte(key)), tenant: tenant}, true, nil
}

func checkTenant(t string) error {
	if t == "" || len(t) > maxTenantLen {
		return fmt.Errorf("tenant %q: want 1 to %d bytes", t, maxTenantLen)
	}
	for _, c := range []byte(t) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_', c == '.':
		default:
			return fmt.Errorf("tenant %q: want letters, digits, '-', '_' or '.'", t)
		}
	}
	return nil
}

// Keys are the API keys kilnd takes, with their tenants: a keys file
// (re-read when its modification time or size changes, or on Reload) and
// keys given inline (--e2b-api-key). A key must not appear in both.
type Keys struct {
	file   string
	inline map[[sha256.Size]byte]string

	mu      sync.Mutex
	keys    map[[sha256.Size]byte]string // the file's and the inline ones
	modTime time.Time                    // the file's when last read (or tried)
	size    int64
}

// LoadKeys reads the keys file (when file is not "") and the inline
// "KEY TENANT" values. The file must give others (not its owner or
// group) no access: a world-readable keys file is an error.
func LoadKeys(file string, inline []string) (*Keys, error) {
	k := &Keys{file: file, inline: map[[sha256.Size]byte]string{}}
	for i, l := range inline {
		e, ok, err := parseKeyLine(l)
		if err == nil && !ok {
			err = errors.New("empty")
		}
		if err != nil {
			return nil, &KeysError{File: "--e2b-api-key", Line: i + 1, Err: err}
		}
		if _, dup := k.inline[e.sum]; dup {
			return nil, &KeysError{File: "--e2b-api-key", Line: i + 1, Err: errors.New("this key is given twice")}
		}
		k.inline[e.sum] = e.tenant
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
	return len(k.keys)
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
	m, err := ParseKeys(k.file, b)
	if err != nil {
		return err
	}
	all := make(map[[sha256.Size]byte]string, len(m)+len(k.inline))
	for s, t := range k.inline {
		all[s] = t
	}
	for s, t := range m {
		if _, dup := all[s]; dup {
			return &KeysError{File: k.file, Err: errors.New("a key is also given by --e2b-api-key")}
		}
		all[s] = t
	}
	k.keys, k.modTime, k.size = all, fi.ModTime(), fi.Size()
	return nil
}

// Tenant returns the tenant of key, re-reading the keys file first when
// it changed. changeErr is a failed re-read's error, returned once per
// change of the file (the old keys then still hold).
func (k *Keys) Tenant(key string) (tenant string, ok bool, changeErr error) {
	var fi os.FileInfo
	if k.file != "" {
		fi, _ = os.Stat(k.file)
	}
	sum := sha256.Sum256([]byte(key))
	k.mu.Lock()
	defer k.mu.Unlock()
	if fi != nil && (!fi.ModTime().Equal(k.modTime) || fi.Size() != k.size) {
		if err := k.reloadLocked(fi); err != nil {
			// Tried once per change, not on every request.
			k.modTime, k.size = fi.ModTime(), fi.Size()
			changeErr = err
		}
	}
	// Compare every key's digest in constant time, so that the time
	// taken tells nothing of which (or whether one) matched.
	found := ""
	for s, t := range k.keys {
		if subtle.ConstantTimeCompare(s[:], sum[:]) == 1 {
			found = t
		}
	}
	return found, found != "", changeErr
}
