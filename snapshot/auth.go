package snapshot

import (
	"bytes"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// KeySize is the size of a host key in bytes.
const KeySize = 32

// ErrAuth: the snapshot's manifest is not authenticated by the host key
// (or by the manifest digest the caller pinned): it was not made here, or
// it was changed since. Its message never says what the MAC should have
// been.
var ErrAuth = errors.New("snapshot not authenticated by this host's key")

// macDomain separates a snapshot's MAC from any other use of the key.
const macDomain = "kiln snapshot manifest v3\x00"

// LoadKey reads the host key at path, or creates it (KeySize random
// bytes, mode 0600, in a directory created 0700) when there is none. A
// key that is a symbolic link, not a regular file, of another size, or
// that others than its owner may read or write, is refused: whoever can
// read it can forge snapshots this host restores.
func LoadKey(path string) ([]byte, error) {
	key, err := ReadKey(path)
	if err == nil || !errors.Is(err, os.ErrNotExist) {
		return key, err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	key = make([]byte, KeySize)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), filepath.Base(path)+".tmp-")
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write([]byte(hex.EncodeToString(key) + "\n")); err != nil {
		tmp.Close()
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	// Link, not rename: of two processes creating the key at once, one
	// wins and the other reads the winner's.
	if err := os.Link(tmp.Name(), path); err != nil {
		if errors.Is(err, os.ErrExist) {
			return ReadKey(path)
		}
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	return key, nil
}

// ReadKey reads and checks the host key file at path, as LoadKey does,
// but never makes one: a missing key is an error wrapping os.ErrNotExist.
// It is for a reader of another process's key (kilnd's), where a key made
// here would authenticate nothing of that process's.
func ReadKey(path string) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW|unix.O_NONBLOCK, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, fmt.Errorf("snapshot key %s: %w", path, os.ErrNotExist)
		}
		if errors.Is(err, unix.ELOOP) {
			return nil, fmt.Errorf("snapshot key %s is a symbolic link: refused", path)
		}
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	f := os.NewFile(uintptr(fd), path)
	defer f.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFREG:
		return nil, fmt.Errorf("snapshot key %s is not a regular file", path)
	case st.Mode&0o077 != 0:
		return nil, fmt.Errorf("snapshot key %s has mode %#o: others than its owner may use it (want 0600)", path, st.Mode&0o777)
	case st.Uid != uint32(os.Geteuid()):
		return nil, fmt.Errorf("snapshot key %s belongs to uid %d, not to this process's %d", path, st.Uid, os.Geteuid())
	}
	b, err := io.ReadAll(io.LimitReader(f, 4*KeySize))
	if err != nil {
		return nil, fmt.Errorf("snapshot key: %w", err)
	}
	key, err := hex.DecodeString(string(bytes.TrimSpace(b)))
	if err != nil || len(key) != KeySize {
		return nil, fmt.Errorf("snapshot key %s is not %d hex-encoded bytes", path, KeySize)
	}
	return key, nil
}

// manifestMAC returns the MAC of a manifest's bytes under key, hex.
func manifestMAC(key, manifest []byte) string {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(macDomain))
	h.Write(manifest)
	return hex.EncodeToString(h.Sum(nil))
}

// authenticate checks the manifest's bytes against what c authenticates
// them with: the MAC file under c.key, or the digest c pins.
func (c *config) authenticate(d *os.File, manifest []byte) error {
	switch {
	case c.pin != nil:
		if sum := sha256.Sum256(manifest); !hmac.Equal(sum[:], c.pin[:]) {
			return fmt.Errorf("manifest is not the one verified before: %w", ErrAuth)
		}
		return nil
	case c.key != nil:
		f, err := openIn(d, MACFile)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				return fmt.Errorf("no %s: %w", MACFile, ErrAuth)
			}
			return fmt.Errorf("%w: %w", err, ErrAuth)
		}
		defer f.Close()
		b, err := io.ReadAll(io.LimitReader(f, 256))
		if err != nil {
			return fmt.Errorf("read %s: %w", MACFile, err)
		}
		want := manifestMAC(c.key, manifest)
		if !hmac.Equal(bytes.TrimSpace(b), []byte(want)) {
			return fmt.Errorf("%s does not match the manifest: %w", MACFile, ErrAuth)
		}
		return nil
	}
	return fmt.Errorf("no host key given (WithKey) to check it with: %w", ErrAuth)
}
