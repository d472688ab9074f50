package snapshot

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/vmm"
)

// file is what the saver writes to; *os.File is one. Tests substitute a
// file that fails.
type file interface {
	io.Writer
	io.WriterAt
	Truncate(size int64) error
	Sync() error
	Close() error
}

// saver writes snapshots.
type saver struct {
	config
	now    func() time.Time
	create func(path string) (file, error)
	// open opens a file create made, read-only (to seal it with
	// fs-verity, which needs no writer left).
	open func(path string) (*os.File, error)
}

func newSaver(opts []Option) *saver {
	s := &saver{
		config: *newConfig(opts),
		now:    time.Now,
		create: func(path string) (file, error) {
			return os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
		},
		open: func(path string) (*os.File, error) {
			return os.OpenFile(path, os.O_RDONLY|unix.O_NOFOLLOW, 0)
		},
	}
	return s
}

// Save writes a snapshot of vm into dir, which must not exist (unless
// Overwrite is given) and whose parent must. With WithKey the manifest is
// authenticated (MACFile); without it, Sign must authenticate the
// snapshot before it can be loaded. The VM is paused (vm.Pause);
// Save saves its state (vm.SaveState, which pauses its virtio devices) and
// its memory, and leaves it paused: vm.Resume lets it go on, devices and
// all. (A VM still running is paused for the save and resumed after it.)
// Save is one vm.Checkpoint: the VM stays in the saving state until the
// memory is written, and a Resume meanwhile waits. On any error, nothing
// is left at dir or beside it.
func Save(ctx context.Context, vm *vmm.VM, dir string, opts ...Option) error {
	s := newSaver(opts)
	if err := s.checkTarget(dir); err != nil {
		return err
	}
	var werr error
	err := vm.Checkpoint(ctx, func(st *vmm.State) error {
		werr = s.write(ctx, dir, st, vm.Memory())
		return werr
	})
	if err != nil && werr == nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return err
}

// SaveAt is Save into the open, empty directory d (a descriptor passed by
// a parent that made it: a jailed VMM process sees no host path): the
// files are created relative to d (openat, O_EXCL, O_NOFOLLOW), with no
// temporary folder and no rename; the caller renames d into place and
// signs it (Sign). Overwrite has no meaning here. On error, what was
// written into d stays for the caller to remove.
func SaveAt(ctx context.Context, vm *vmm.VM, d *os.File, opts ...Option) error {
	s := newSaver(opts)
	s.create, s.open = createAt(d), openAt(d)
	name := d.Name()
	var werr error
	err := vm.Checkpoint(ctx, func(st *vmm.State) error {
		werr = s.writeAt(ctx, name, d, st, vm.Memory())
		return werr
	})
	if err != nil && werr == nil {
		return fmt.Errorf("snapshot %s: %w", name, err)
	}
	return err
}

// createAt creates files by their base name in the directory d: new ones
// only, and never through a link (O_EXCL, O_NOFOLLOW).
func createAt(d *os.File) func(path string) (file, error) {
	return func(path string) (file, error) {
		name := filepath.Base(path)
		fd, err := unix.Openat(int(d.Fd()), name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return nil, fmt.Errorf("create %s: %w", name, err)
		}
		return os.NewFile(uintptr(fd), name), nil
	}
}

// openAt opens a file of the directory d by its base name, read-only and
// never through a link.
func openAt(d *os.File) func(path string) (*os.File, error) {
	return func(path string) (*os.File, error) {
		name := filepath.Base(path)
		fd, err := unix.Openat(int(d.Fd()), name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", name, err)
		}
		return os.NewFile(uintptr(fd), name), nil
	}
}

// writeAt is write for SaveAt: the checks, the files into d, d synced.
func (s *saver) writeAt(ctx context.Context, name string, d *os.File, st *vmm.State, mem *memory.Memory) error {
	start := s.now()
	if err := s.precheck(name, st, mem); err != nil {
		return err
	}
	written, err := s.writeFiles(ctx, name, name, st, mem)
	if err != nil {
		return err
	}
	if err := d.Sync(); err != nil {
		return fmt.Errorf("snapshot %s: sync directory: %w", name, err)
	}
	s.log.Info("snapshot saved", "dir", name, "cpus", st.CPUs, "memory_mib", st.MemoryMiB,
		"memory_written", written, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// checkTarget refuses a target that exists, unless overwriting a snapshot.
func (s *saver) checkTarget(dir string) error {
	fi, err := os.Lstat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if !s.overwrite {
		return fmt.Errorf("snapshot %s: %w (not asked to overwrite it)", dir, ErrExists)
	}
	if !fi.IsDir() {
		return fmt.Errorf("snapshot %s: exists and is not a directory: not overwriting it", dir)
	}
	if _, err := os.Lstat(filepath.Join(dir, ManifestFile)); err != nil {
		return fmt.Errorf("snapshot %s: exists and is not a snapshot (no %s): not overwriting it", dir, ManifestFile)
	}
	return nil
}

// write writes st and mem as a snapshot at dir, through a temporary
// directory beside it.
func (s *saver) write(ctx context.Context, dir string, st *vmm.State, mem *memory.Memory) (err error) {
	start := s.now()
	if err := s.checkTarget(dir); err != nil {
		return err
	}
	if err := s.precheck(dir, st, mem); err != nil {
		return err
	}
	dir = filepath.Clean(dir)
	parent, base := filepath.Dir(dir), filepath.Base(dir)
	tmp, err := os.MkdirTemp(parent, base+".tmp-")
	if err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	defer func() {
		if err != nil {
			if rerr := os.RemoveAll(tmp); rerr != nil {
				s.log.Warn("snapshot: removing the unfinished snapshot", "dir", tmp, "err", rerr)
			}
		}
	}()

	written, err := s.writeFiles(ctx, dir, tmp, st, mem)
	if err != nil {
		return err
	}
	if err := syncDir(tmp); err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if err := s.install(tmp, dir); err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if err := syncDir(parent); err != nil {
		// The snapshot is in place; only its durability is in doubt.
		s.log.Warn("snapshot: sync parent directory", "dir", parent, "err", err)
	}
	s.log.Info("snapshot saved", "dir", dir, "cpus", st.CPUs, "memory_mib", st.MemoryMiB,
		"memory_written", written, "took", time.Since(start).Round(time.Millisecond))
	return nil
}

// precheck checks what is to be saved as dir: the state, that mem fits
// it, the labels and the expected disks.
func (s *saver) precheck(dir string, st *vmm.State, mem *memory.Memory) error {
	if err := st.Validate(); err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if mem == nil || mem.Size() != st.MemorySize() {
		return fmt.Errorf("snapshot %s: memory does not have the state's %d bytes", dir, st.MemorySize())
	}
	if err := checkLabels(s.labels); err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if err := s.checkExpectedDisks(st.Specs()); err != nil {
		return fmt.Errorf("snapshot %s: %w", dir, err)
	}
	return nil
}

// writeFiles writes st and mem as a snapshot's files into the folder
// into (the files go through s.create), naming dir in errors. It returns
// the memory's bytes written.
func (s *saver) writeFiles(ctx context.Context, dir, into string, st *vmm.State, mem *memory.Memory) (written int64, err error) {
	var memSum string
	stateJSON, err := json.Marshal(st)
	if err != nil {
		return written, fmt.Errorf("snapshot %s: encode state: %w", dir, err)
	}
	sum := sha256.Sum256(stateJSON)
	if err := s.writeFile(filepath.Join(into, StateFile), stateJSON); err != nil {
		return written, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	memPath := filepath.Join(into, MemoryFile)
	written, memSum, err = s.writeMemory(ctx, memPath, mem)
	if err != nil {
		return written, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	verity := s.sealVerity(memPath)
	m := Manifest{
		Format:       FormatVersion,
		Created:      s.now().UTC(),
		CPUs:         st.CPUs,
		MemoryMiB:    st.MemoryMiB,
		StateVersion: st.Version,
		StateSize:    int64(len(stateJSON)),
		StateSHA256:  hex.EncodeToString(sum[:]),
		MemorySize:   mem.Size(),
		MemoryLayout: st.Memory,
		MemorySHA256: memSum,
		MemoryVerity: verity,
		Devices:      st.Specs(),
		Labels:       s.labels,
	}
	manifest, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return written, fmt.Errorf("snapshot %s: encode manifest: %w", dir, err)
	}
	manifest = append(manifest, '\n')
	if err := s.writeFile(filepath.Join(into, ManifestFile), manifest); err != nil {
		return written, fmt.Errorf("snapshot %s: %w", dir, err)
	}
	if s.key != nil {
		if err := s.writeFile(filepath.Join(into, MACFile), []byte(manifestMAC(s.key, manifest)+"\n")); err != nil {
			return written, fmt.Errorf("snapshot %s: %w", dir, err)
		}
	}
	return written, nil
}

// writeFile creates path with b in it, synced.
func (s *saver) writeFile(path string, b []byte) error {
	f, err := s.create(path)
	if err != nil {
		return err
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", filepath.Base(path), err)
	}
	return closeSynced(f, path)
}

// closeSynced syncs and closes f: a full disk may show only at the sync.
func closeSynced(f file, path string) error {
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("sync %s: %w", filepath.Base(path), err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("close %s: %w", filepath.Base(path), err)
	}
	return nil
}

// syncDir fsyncs a directory, making the names in it durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

// install renames the finished temporary directory to dir. Without
// overwrite, dir must not exist (RENAME_NOREPLACE: a plain rename would
// replace an empty directory). With it, an existing snapshot is exchanged
// with the new one and then removed.
func (s *saver) install(tmp, dir string) error {
	err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, dir, unix.RENAME_NOREPLACE)
	switch {
	case err == nil:
		return nil
	case errors.Is(err, unix.EEXIST) || errors.Is(err, unix.ENOTEMPTY):
		if !s.overwrite {
			return fmt.Errorf("%w (not asked to overwrite it)", ErrExists)
		}
		if err := s.checkTarget(dir); err != nil {
			return err
		}
		return s.replace(tmp, dir)
	case errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS):
		// The filesystem has no renameat2 flags: check, then rename.
		if _, err := os.Lstat(dir); err == nil {
			if !s.overwrite {
				return fmt.Errorf("%w (not asked to overwrite it)", ErrExists)
			}
			if err := s.checkTarget(dir); err != nil {
				return err
			}
			return s.replace(tmp, dir)
		}
		if err := os.Rename(tmp, dir); err != nil {
			return fmt.Errorf("rename into place: %w", err)
		}
		return nil
	}
	return fmt.Errorf("rename into place: %w", err)
}

// replace puts the snapshot at tmp in the place of the one at dir and
// removes the old one.
func (s *saver) replace(tmp, dir string) error {
	if err := unix.Renameat2(unix.AT_FDCWD, tmp, unix.AT_FDCWD, dir, unix.RENAME_EXCHANGE); err == nil {
		// tmp now holds the old snapshot.
		if err := os.RemoveAll(tmp); err != nil {
			s.log.Warn("snapshot: removing the replaced snapshot", "dir", tmp, "err", err)
		}
		return nil
	}
	// No exchange here: move the old one aside, then the new one in.
	old, err := os.MkdirTemp(filepath.Dir(dir), filepath.Base(dir)+".old-")
	if err != nil {
		return err
	}
	if err := os.Rename(dir, old); err != nil {
		os.Remove(old)
		return fmt.Errorf("move the old snapshot aside: %w", err)
	}
	if err := os.Rename(tmp, dir); err != nil {
		if rerr := os.Rename(old, dir); rerr != nil {
			s.log.Error("snapshot: the old snapshot could not be put back", "old", old, "dir", dir, "err", rerr)
		}
		return fmt.Errorf("rename into place: %w", err)
	}
	if err := os.RemoveAll(old); err != nil {
		s.log.Warn("snapshot: removing the replaced snapshot", "dir", old, "err", err)
	}
	return nil
}
