package jail

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// The per-sandbox ids IDs hands out by default: uid and gid alike.
const (
	FirstID = 900000
	IDCount = 65536
)

// DefaultIDsDir is the folder kilnd and kiln run/fork keep their id locks
// under by default: one for the host, so that no two jails share an id
// (a tmpfs: after a reboot every holder is gone anyway).
const DefaultIDsDir = "/run/kiln"

// IDsDir is the folder under an IDs' directory that holds the id files.
const IDsDir = "jail-ids"

// ErrNoIDs: every id of the range is held.
var ErrNoIDs = errors.New("jail: every id of the range is held by a running VMM process")

// IDs allocates per-sandbox ids (used as both uid and gid) from a range.
// Each id is held by an exclusive flock on the file <dir>/jail-ids/<id>:
// the VMM process inherits the locked descriptor, so the id is free again
// when that process dies, whatever became of its parent. Safe for
// concurrent use, and between processes sharing dir.
type IDs struct {
	dir          string
	first, count int

	mu   sync.Mutex
	next int // where the next search starts, relative to first
}

// NewIDs returns an allocator over [first, first+count) with its id files
// in dir/jail-ids (created).
func NewIDs(dir string, first, count int) (*IDs, error) {
	if first <= 0 || count <= 0 || first+count-1 > 1<<31-2 {
		return nil, fmt.Errorf("jail: id range %d+%d is not a range of non-root ids", first, count)
	}
	if !filepath.IsAbs(dir) {
		return nil, fmt.Errorf("jail: id folder %q is not an absolute path", dir)
	}
	d := filepath.Join(dir, IDsDir)
	if err := os.MkdirAll(d, 0o700); err != nil {
		return nil, fmt.Errorf("jail: id folder: %w", err)
	}
	return &IDs{dir: d, first: first, count: count}, nil
}

// Dir returns the folder of the id files.
func (a *IDs) Dir() string { return a.dir }

// Allocate returns a free id and its locked file: pass the file to the
// process that uses the id (exec.Cmd.ExtraFiles) and close it here once
// that process has started; the id stays held while a descriptor of that
// open file lives. A full range is ErrNoIDs.
func (a *IDs) Allocate() (int, *os.File, error) {
	a.mu.Lock()
	start := a.next
	a.mu.Unlock()
	for i := range a.count {
		off := (start + i) % a.count
		id := a.first + off
		f, err := a.try(id)
		if err != nil {
			return 0, nil, err
		}
		if f != nil {
			a.mu.Lock()
			a.next = (off + 1) % a.count
			a.mu.Unlock()
			return id, f, nil
		}
	}
	return 0, nil, fmt.Errorf("%w (%d ids from %d, files in %s)", ErrNoIDs, a.count, a.first, a.dir)
}

// try locks id's file; nil, nil when another holds it.
func (a *IDs) try(id int) (*os.File, error) {
	path := filepath.Join(a.dir, strconv.Itoa(id))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("jail: id file: %w", err)
	}
	err = unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
	switch {
	case err == nil:
		return f, nil
	case errors.Is(err, unix.EWOULDBLOCK):
		f.Close()
		return nil, nil
	}
	f.Close()
	return nil, fmt.Errorf("jail: lock id file %s: %w", path, err)
}

// Held reports whether id's file is locked by someone (a VMM process, or
// a file Allocate returned and not yet closed).
func (a *IDs) Held(id int) (bool, error) {
	path := filepath.Join(a.dir, strconv.Itoa(id))
	f, err := os.OpenFile(path, os.O_RDONLY, 0)
	if errors.Is(err, os.ErrNotExist) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("jail: id file: %w", err)
	}
	defer f.Close()
	err = unix.Flock(int(f.Fd()), unix.LOCK_SH|unix.LOCK_NB)
	switch {
	case err == nil:
		return false, nil // closing f drops the probe's lock
	case errors.Is(err, unix.EWOULDBLOCK):
		return true, nil
	}
	return false, fmt.Errorf("jail: probe id file %s: %w", path, err)
}
