// Package apikey is what an E2B API key and its keys-file line are,
// apart from the E2B server: the tenant name's syntax, the key format
// E2B's SDKs accept, and making a new key into a keys file (kiln e2b key
// new). Package e2b parses and serves the file; the kiln CLI links only
// this.
package apikey

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"regexp"
)

// MaxTenantLen bounds a tenant's name.
const MaxTenantLen = 128

// CheckTenant checks a tenant's name: 1 to MaxTenantLen letters, digits,
// '-', '_' or '.'.
func CheckTenant(t string) error {
	if t == "" || len(t) > MaxTenantLen {
		return fmt.Errorf("tenant %q: want 1 to %d bytes", t, MaxTenantLen)
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

// pythonSDKKey is the format E2B's Python SDK (2.34) demands of an API key
// before it sends anything (e2b/api: _API_KEY_PATTERN) unless
// E2B_VALIDATE_API_KEY=false. The npm SDK has no such check.
var pythonSDKKey = regexp.MustCompile(`\Ae2b_[0-9a-f]+\z`)

// PythonSDKAccepts reports whether E2B's Python SDK accepts key's format:
// "e2b_" and lowercase hex digits.
func PythonSDKAccepts(key string) bool { return pythonSDKKey.MatchString(key) }

// keyBytes is how much randomness a new key holds (E2B's own keys are
// e2b_ and 40 hex digits).
const keyBytes = 20

// New returns a fresh random key in E2B's format.
func New() string {
	b := make([]byte, keyBytes)
	rand.Read(b) // never fails (crypto/rand)
	return "e2b_" + hex.EncodeToString(b)
}

// Append adds the line "KEY TENANT" to the keys file at path, making it
// (mode 0600) when missing. An existing file must give others no access
// (kilnd refuses one that does) and is extended after a newline of its
// own; tenant must be a valid name. kilnd re-reads the file when it
// changes, so the key works at once.
func Append(path, key, tenant string) error {
	if err := CheckTenant(tenant); err != nil {
		return err
	}
	if !PythonSDKAccepts(key) {
		return errors.New("the key is not in E2B's format (e2b_ and lowercase hex)")
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return fmt.Errorf("keys file: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return fmt.Errorf("keys file %s: %w", path, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("keys file %s: not a regular file", path)
	}
	if perm := fi.Mode().Perm(); perm&0o007 != 0 {
		return fmt.Errorf("keys file %s: mode %04o lets every user of the host read it: chmod o-rwx it first", path, perm)
	}
	sep, err := needsNewline(f, fi.Size())
	if err != nil {
		return fmt.Errorf("keys file %s: %w", path, err)
	}
	line := sep + key + " " + tenant + "\n"
	if _, err := io.WriteString(f, line); err != nil {
		return fmt.Errorf("keys file %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("keys file %s: %w", path, err)
	}
	return nil
}

// needsNewline is "\n" when the file's last byte is not one (so the new
// line does not join the last), else "".
func needsNewline(f *os.File, size int64) (string, error) {
	if size == 0 {
		return "", nil
	}
	b := make([]byte, 1)
	if _, err := f.ReadAt(b, size-1); err != nil {
		return "", err
	}
	if b[0] == '\n' {
		return "", nil
	}
	return "\n", nil
}
