package snapshot

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/vmm"
)

// Load builds a VM from the snapshot in dir. The machine (vCPUs, memory,
// devices) is the snapshot's; cfg gives what the new VM is connected to:
// overrides of the snapshot's devices (a new vsock socket, a tap, a disk
// path), its console and logger. Every file is checked before anything is
// built: the manifest's format version, the state file's size and
// SHA-256, the memory file's size, and the overrides against the
// snapshot's devices. The memory file is mapped copy-on-write
// (MAP_PRIVATE) and stays mapped until the VM is closed; the snapshot's
// files never change. The VM continues where the snapshot's stopped when
// Run is called.
func Load(dir string, cfg vmm.RestoreConfig) (*vmm.VM, error) {
	st, mem, err := open(dir, &cfg)
	if err != nil {
		return nil, err
	}
	vm, err := vmm.Restore(cfg, st, mem) // closes mem when it fails
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return vm, nil
}

// open checks the snapshot in dir against cfg and returns its state and
// its memory, mapped copy-on-write.
func open(dir string, cfg *vmm.RestoreConfig) (*vmm.State, *memory.Memory, error) {
	m, err := Info(dir)
	if err != nil {
		return nil, nil, err
	}
	st, err := readState(dir, m)
	if err != nil {
		return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	fd, err := openMemory(dir, m)
	if err != nil {
		return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if _, err := st.Check(cfg); err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("snapshot %s: %w: %w", dir, err, ErrMismatch)
	}
	mem, err := memory.MapFile(fd, st.Layout(), true)
	if err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("snapshot %s: map memory: %w", dir, err)
	}
	return st, mem, nil
}

// readState reads the state file and checks it against the manifest: its
// size, its checksum, and the VM it describes.
func readState(dir string, m *Manifest) (*vmm.State, error) {
	f, err := os.Open(filepath.Join(dir, StateFile))
	if err != nil {
		return nil, fmt.Errorf("state file: %w: %w", err, ErrCorrupt)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("state file: %w", err)
	}
	if fi.Size() != m.StateSize {
		return nil, fmt.Errorf("state file is %d bytes, the manifest says %d: %w", fi.Size(), m.StateSize, ErrCorrupt)
	}
	b, err := io.ReadAll(io.LimitReader(f, m.StateSize+1))
	if err != nil {
		return nil, fmt.Errorf("read state file: %w", err)
	}
	if int64(len(b)) != m.StateSize {
		return nil, fmt.Errorf("state file changed size while read (%d bytes, the manifest says %d): %w", len(b), m.StateSize, ErrCorrupt)
	}
	sum := sha256.Sum256(b)
	if got := hex.EncodeToString(sum[:]); got != m.StateSHA256 {
		return nil, fmt.Errorf("state file: %w: SHA-256 %s, the manifest says %s", ErrChecksum, got, m.StateSHA256)
	}
	var st vmm.State
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&st); err != nil {
		return nil, fmt.Errorf("decode state file: %v: %w", err, ErrCorrupt)
	}
	if err := st.Validate(); err != nil {
		return nil, fmt.Errorf("state file: %w: %w", err, ErrCorrupt)
	}
	if err := m.checkState(&st); err != nil {
		return nil, err
	}
	return &st, nil
}

// openMemory opens the memory file read-only (a private mapping of it may
// still be written: the writes go to copies) and checks its size.
func openMemory(dir string, m *Manifest) (int, error) {
	p := filepath.Join(dir, MemoryFile)
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("memory file: open %s: %w: %w", p, err, ErrCorrupt)
	}
	var s unix.Stat_t
	if err := unix.Fstat(fd, &s); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("memory file: %w", err)
	}
	if s.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return -1, fmt.Errorf("memory file %s is not a regular file: %w", p, ErrCorrupt)
	}
	if uint64(s.Size) != m.MemorySize {
		unix.Close(fd)
		return -1, fmt.Errorf("memory file is %d bytes, the manifest says %d (truncated, or not this snapshot's): %w", s.Size, m.MemorySize, ErrCorrupt)
	}
	return fd, nil
}
