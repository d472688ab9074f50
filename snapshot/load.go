package snapshot

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// Load builds a VM from the snapshot in dir. The machine (vCPUs, memory,
// devices) is the snapshot's; cfg gives what the new VM is connected to:
// overrides of the snapshot's devices (a new vsock socket, a tap), its
// console and logger, and every one of its disks: a disk path the
// snapshot recorded is never opened, cfg.Devices must name each disk's
// image (it must have the size the snapshot's disk had).
//
// Every file is checked before anything is built: the manifest is
// authenticated (WithKey: its MAC; or WithManifestDigest), the state and
// memory files must have the digests it records, and the overrides must
// fit the snapshot's devices. Files are opened beneath dir, never through
// a symbolic link. The memory is copied, as it is checked, into a sealed
// memfd (memory.NewSealed; once per file and process WithCache, or given
// WithSealedMemory) that the VM maps copy-on-write: whatever happens to
// the memory file after (a write, a truncation), the VM's memory does not
// change. The VM continues where the snapshot's stopped when Run is
// called.
func Load(dir string, cfg vmm.RestoreConfig, opts ...Option) (*vmm.VM, error) {
	c := newConfig(opts)
	st, mem, err := c.open(context.Background(), dir, &cfg)
	if err != nil {
		return nil, err
	}
	vm, err := vmm.Restore(cfg, st, mem) // closes mem when it fails
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return vm, nil
}

// Verified is a snapshot Verify checked in full.
type Verified struct {
	Manifest *Manifest
	// ManifestSHA256 pins the manifest checked (WithManifestDigest).
	ManifestSHA256 [sha256.Size]byte
	// Memory is the checked memory (WithSealedMemory): a sealed memfd,
	// or the memory file itself where it has the fs-verity digest the
	// manifest names; the caller closes it.
	Memory *os.File

	dir   string
	state *vmm.State // the state file, checked (LoadVerified)
}

// LoadVerified is Load of the snapshot v checked, in this process, with
// no file of it read or checked again: the caller's config against its
// state, then the VM restored over a copy-on-write mapping of v.Memory
// (which stays the caller's to close). v restores once.
func LoadVerified(v *Verified, cfg vmm.RestoreConfig) (*vmm.VM, error) {
	if v.state == nil {
		return nil, errors.New("snapshot: LoadVerified of a snapshot Verify did not check, or restored already")
	}
	st := v.state
	v.state = nil
	if err := checkRestore(st, &cfg); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", v.dir, err)
	}
	fd, err := unix.FcntlInt(v.Memory.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: memory: %w", v.dir, err)
	}
	mem, err := memory.MapFile(fd, st.Layout(), true)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("snapshot %s: map memory: %w", v.dir, err)
	}
	vm, err := vmm.Restore(cfg, st, mem) // closes mem when it fails
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", v.dir, err)
	}
	return vm, nil
}

// Verify checks the snapshot in dir as Load does, without building a
// VM: the manifest against the key (WithKey), the state file and the
// memory file against the manifest. It returns the manifest's digest and
// the memory's sealed copy, for a Load elsewhere (a VMM process, which
// does not hold the key) to use.
func Verify(ctx context.Context, dir string, opts ...Option) (*Verified, error) {
	c := newConfig(opts)
	d, err := openDir(dir)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	defer d.Close()
	m, b, err := c.readManifest(d, true)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	st, err := readState(d, m)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	fd, err := c.memory(ctx, d, m)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return &Verified{Manifest: m, ManifestSHA256: sha256.Sum256(b), Memory: os.NewFile(uintptr(fd), "snapshot memory"), dir: dir, state: st}, nil
}

// open checks the snapshot in dir against cfg and returns its state and
// its memory, mapped copy-on-write.
func (c *config) open(ctx context.Context, dir string, cfg *vmm.RestoreConfig) (*vmm.State, *memory.Memory, error) {
	given := c.memFD
	c.memFD = -1
	closeGiven := func() {
		if given >= 0 {
			unix.Close(given)
		}
	}
	d, err := openDir(dir)
	if err != nil {
		closeGiven()
		return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	defer d.Close()
	m, _, err := c.readManifest(d, true)
	if err != nil {
		closeGiven()
		return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	st, err := readState(d, m)
	if err != nil {
		closeGiven()
		return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if err := checkRestore(st, cfg); err != nil {
		closeGiven()
		return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	var fd int
	if given >= 0 {
		if err := checkGiven(given, m); err != nil {
			closeGiven()
			return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
		}
		fd = given
	} else if fd, err = c.memory(ctx, d, m); err != nil {
		return nil, nil, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	mem, err := memory.MapFile(fd, st.Layout(), true)
	if err != nil {
		unix.Close(fd)
		return nil, nil, fmt.Errorf("snapshot %s: map memory: %w", dir, err)
	}
	return st, mem, nil
}

// checkRestore checks cfg against the snapshot's state st: its disks
// named (checkDisks), its vCPUs, memory and device types.
func checkRestore(st *vmm.State, cfg *vmm.RestoreConfig) error {
	if err := checkDisks(st, cfg); err != nil {
		return fmt.Errorf("%w: %w", err, ErrMismatch)
	}
	if _, err := st.Check(cfg); err != nil {
		return fmt.Errorf("%w: %w", err, ErrMismatch)
	}
	return nil
}

// checkDisks checks that cfg names the image of every disk of st: the
// paths the snapshot recorded are never opened (a crafted snapshot would
// make a restore open any host file read-write). An empty volume slot
// has no image to name (its state says it holds none: a slot the
// snapshot's guest saw filled restores only filled).
func checkDisks(st *vmm.State, cfg *vmm.RestoreConfig) error {
	for _, d := range st.Devices {
		if d.Spec.Kind != virtio.KindBlock || d.Spec.Block.EmptySlot() {
			continue
		}
		named := false
		for _, o := range cfg.Devices {
			if o.ID == d.Spec.ID && o.Kind == virtio.KindBlock && o.Block != nil && (o.Block.Path != "" || o.Block.FD > 0) {
				named = true
			}
		}
		if !named {
			return fmt.Errorf("disk %q: the restore must name its image (a disk path in a snapshot is never opened)", d.Spec.ID)
		}
	}
	return nil
}

// checkExpectedDisks checks that the disks among specs are those
// ExpectDisks gave, when it was given.
func (c *config) checkExpectedDisks(specs []virtio.DeviceSpec) error {
	if c.disks == nil {
		return nil
	}
	n := 0
	for _, d := range specs {
		if d.Kind != virtio.KindBlock {
			continue
		}
		n++
		want, ok := c.disks[d.ID]
		switch {
		case !ok:
			return fmt.Errorf("disk %q is not one of the VM's", d.ID)
		case d.Block == nil || d.Block.Path != want:
			return fmt.Errorf("disk %q is not the image the VM was given", d.ID)
		}
	}
	if n != len(c.disks) {
		return fmt.Errorf("%d disks, the VM was given %d", n, len(c.disks))
	}
	return nil
}

// readState reads the state file of the snapshot directory d and checks
// it against the manifest: its size, its checksum, and the VM it
// describes.
func readState(d *os.File, m *Manifest) (*vmm.State, error) {
	f, err := openIn(d, StateFile)
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
	if hex.EncodeToString(sum[:]) != m.StateSHA256 {
		return nil, fmt.Errorf("state file: %w: its contents are not what the manifest says", ErrChecksum)
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

// memory opens the memory file of the snapshot directory d, checks its
// size, and returns its sealed copy, checked against the manifest's
// digest.
func (c *config) memory(ctx context.Context, d *os.File, m *Manifest) (int, error) {
	f, err := openMemory(d, m)
	if err != nil {
		return -1, err
	}
	defer f.Close()
	if fd, ok, err := verityMemory(f, m); ok || err != nil {
		return fd, err
	}
	return sealedMemory(ctx, c.cache, f, int64(m.MemorySize), m.MemorySHA256)
}

// openMemory opens the memory file read-only and checks its size.
func openMemory(d *os.File, m *Manifest) (*os.File, error) {
	f, err := openIn(d, MemoryFile)
	if err != nil {
		return nil, fmt.Errorf("memory file: %w: %w", err, ErrCorrupt)
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("memory file: %w", err)
	}
	if uint64(fi.Size()) != m.MemorySize {
		f.Close()
		return nil, fmt.Errorf("memory file is %d bytes, the manifest says %d (truncated, or not this snapshot's): %w", fi.Size(), m.MemorySize, ErrCorrupt)
	}
	return f, nil
}

// Sign authenticates the snapshot in dir with the key (WithKey, which it
// needs): it checks the state and memory files against the manifest and
// writes the manifest's MAC (MACFile). It is for a snapshot saved
// without the key, by a process that must not hold it (a VMM process):
// the caller that holds the key signs what it saved.
func Sign(ctx context.Context, dir string, opts ...Option) error {
	c := newConfig(opts)
	if c.key == nil {
		return fmt.Errorf("snapshot %s: sign: no key given (WithKey)", dir)
	}
	d, err := openDir(dir)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	defer d.Close()
	m, b, err := c.readManifest(d, false)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if _, err := readState(d, m); err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if err := c.checkExpectedDisks(m.Devices); err != nil {
		return fmt.Errorf("snapshot %s: not signing it: %w", dir, err)
	}
	f, err := openMemory(d, m)
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	got, err := digestMemory(ctx, f, int64(m.MemorySize), nil)
	if err == nil && m.MemoryVerity != "" {
		// Read through fs-verity, the bytes checked are the ones its
		// digest names: the digest is then as good as the manifest's.
		err = checkVerity(f, m)
	}
	f.Close()
	if err != nil {
		return fmt.Errorf("snapshot %s: memory file: %w", dir, err)
	}
	if got != m.MemorySHA256 {
		return fmt.Errorf("snapshot %s: memory file: %w: its contents are not what the manifest says", dir, ErrChecksum)
	}
	tmp, err := os.CreateTemp(dir, MACFile+".tmp-")
	if err != nil {
		return fmt.Errorf("snapshot %s: sign: %w", dir, err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(manifestMAC(c.key, b) + "\n"); err != nil {
		tmp.Close()
		return fmt.Errorf("snapshot %s: sign: %w", dir, err)
	}
	if err := closeSynced(tmp, tmp.Name()); err != nil {
		return fmt.Errorf("snapshot %s: sign: %w", dir, err)
	}
	if err := unix.Renameat(int(d.Fd()), filepath.Base(tmp.Name()), int(d.Fd()), MACFile); err != nil {
		return fmt.Errorf("snapshot %s: sign: %w", dir, err)
	}
	if err := d.Sync(); err != nil {
		return fmt.Errorf("snapshot %s: sign: sync: %w", dir, err)
	}
	return nil
}
