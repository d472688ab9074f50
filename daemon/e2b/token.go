package e2b

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// tokenKeyFile is the access-token key's file in the state folder.
const tokenKeyFile = "access-token.key"

const tokenKeyLen = 32

// tokens issues and checks envd access tokens: a sandbox's token is the
// HMAC-SHA256 of its ID, its tenant and the SHA-256 of the API key it was
// given to, under a key kept in the state folder, so that tokens need no
// record, survive restarts of kilnd, and die with their API key.
type tokens struct{ key []byte }

// loadTokens reads the key from dir, making it (0600, and dir 0700) on
// first use.
func loadTokens(dir string) (*tokens, error) {
	if dir == "" {
		return nil, errors.New("no state folder for the access-token key")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("the e2b state folder: %w", err)
	}
	p := filepath.Join(dir, tokenKeyFile)
	b, err := os.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		b = make([]byte, tokenKeyLen)
		rand.Read(b) // never fails (crypto/rand)
		if err := writeExclusive(p, b); err != nil {
			if !errors.Is(err, fs.ErrExist) {
				return nil, fmt.Errorf("making the access-token key: %w", err)
			}
			// Another process made it first: use that one.
			if b, err = os.ReadFile(p); err != nil {
				return nil, fmt.Errorf("the access-token key: %w", err)
			}
		}
	} else if err != nil {
		return nil, fmt.Errorf("the access-token key: %w", err)
	}
	if len(b) != tokenKeyLen {
		return nil, fmt.Errorf("the access-token key %s is %d bytes; want %d (remove it to make a new one, which voids every token given out)", p, len(b), tokenKeyLen)
	}
	return &tokens{key: b}, nil
}

// writeExclusive writes a new file with mode 0600, failing when it exists.
func writeExclusive(p string, b []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(p), ".key-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Link(tmp.Name(), p) // CreateTemp made it 0600
}

// token is sandbox id's access token for the tenant's API key whose
// SHA-256 is key: bound to the key, so that revoking the key (removing
// it from the keys file) revokes every token given out to it, and a
// tenant's other keys have tokens of their own.
func (t *tokens) token(id, tenant string, key [sha256.Size]byte) string {
	m := hmac.New(sha256.New, t.key)
	m.Write([]byte("kiln-e2b-envd-v2\x00"))
	m.Write([]byte(id))
	m.Write([]byte{0})
	m.Write([]byte(tenant))
	m.Write([]byte{0})
	m.Write(key[:])
	return base64.RawURLEncoding.EncodeToString(m.Sum(nil))
}

// check reports whether tok is sandbox id's access token for one of its
// tenant's keys now (each compared in constant time).
func (t *tokens) check(id, tenant string, keys [][sha256.Size]byte, tok string) bool {
	ok := false
	for _, k := range keys {
		if hmac.Equal([]byte(t.token(id, tenant, k)), []byte(tok)) {
			ok = true
		}
	}
	return ok
}
