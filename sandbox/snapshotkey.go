package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/snapshot"
)

// SnapshotKeyFile is the host key file (snapshot.LoadKey) a sandbox's
// snapshots are authenticated with when the caller gives none
// (Options.SnapshotKey): kiln/snapshot.key under the user's config
// folder, or, where that cannot be written (a read-only home), under a
// folder of this uid's in the temporary directory. A snapshot saved with
// one key restores only with the same key.
func SnapshotKeyFile() string {
	if dir, err := os.UserConfigDir(); err == nil {
		p := filepath.Join(dir, "kiln", "snapshot.key")
		if _, err := os.Stat(p); err == nil || writable(filepath.Dir(p)) {
			return p
		}
	}
	return filepath.Join(os.TempDir(), "kiln-"+strconv.Itoa(os.Geteuid()), "snapshot.key")
}

// writable reports whether dir, or the nearest folder above it that
// exists, may be written by this process.
func writable(dir string) bool {
	for {
		err := unix.Access(dir, unix.W_OK)
		if err == nil {
			return true
		}
		if !errors.Is(err, unix.ENOENT) {
			return false
		}
		up := filepath.Dir(dir)
		if up == dir {
			return false
		}
		dir = up
	}
}

// snapshotKey returns key, or the key of SnapshotKeyFile (created on
// first use) when key is nil.
func snapshotKey(key []byte) ([]byte, error) {
	if key != nil {
		if len(key) < 16 {
			return nil, fmt.Errorf("sandbox: a snapshot key of %d bytes: want at least 16", len(key))
		}
		return key, nil
	}
	k, err := snapshot.LoadKey(SnapshotKeyFile())
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return k, nil
}
