package snapshot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/fsverity"
	"github.com/kilnvm/kiln/memory"
)

// sealVerity seals the memory file at path with fs-verity and returns its
// digest (hex), or "" where its file system has no fs-verity or the saver
// was asked for none (NoVerity): the snapshot is then restored by copy.
// Sealing reads and hashes the whole file (holes included) once, at save,
// so that every restore maps the file instead of copying it.
func (s *saver) sealVerity(path string) string {
	if s.noVerity {
		return ""
	}
	start := time.Now()
	f, err := s.open(path)
	if err != nil {
		s.log.Warn("snapshot: memory file not sealed with fs-verity; restores will copy it", "file", path, "err", err)
		return ""
	}
	defer f.Close()
	if err := fsverity.Enable(f); err != nil {
		if errors.Is(err, fsverity.ErrUnsupported) {
			s.log.Debug("snapshot: no fs-verity here; restores will copy the memory file", "dir", filepath.Dir(path), "err", err)
		} else {
			s.log.Warn("snapshot: memory file not sealed with fs-verity; restores will copy it", "file", path, "err", err)
		}
		return ""
	}
	d, err := fsverity.Measure(f)
	if err != nil {
		s.log.Warn("snapshot: memory file sealed with fs-verity, but not measured; restores will copy it", "file", path, "err", err)
		return ""
	}
	s.log.Debug("snapshot: memory file sealed with fs-verity", "file", path, "took", time.Since(start).Round(time.Millisecond))
	return d.String()
}

// verityMemory is the memory file f itself, to be mapped copy-on-write,
// when the manifest has its fs-verity digest and f measures so: the
// kernel then checks every page read from it against the digest, and
// nobody can write it. It returns ok false when f has no fs-verity (a
// snapshot copied to a file system without it: the caller copies and
// checks the file instead), and ErrChecksum when f's digest is another.
func verityMemory(f *os.File, m *Manifest) (fd int, ok bool, err error) {
	if m.MemoryVerity == "" {
		return -1, false, nil
	}
	if err := checkVerity(f, m); err != nil {
		if errors.Is(err, fsverity.ErrNotEnabled) || errors.Is(err, fsverity.ErrUnsupported) {
			return -1, false, nil
		}
		return -1, false, err
	}
	fd, err = unix.FcntlInt(f.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, false, fmt.Errorf("memory file: %w", err)
	}
	return fd, true, nil
}

// checkVerity checks that f, a regular file of the manifest's memory
// size, has the fs-verity digest the manifest names. The errors of a
// file without fs-verity wrap fsverity's; another digest is ErrChecksum,
// whose message does not say what it should have been.
func checkVerity(f *os.File, m *Manifest) error {
	want, err := fsverity.ParseDigest(m.MemoryVerity)
	if err != nil {
		return fmt.Errorf("memory file: %w: %w", err, ErrCorrupt)
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return fmt.Errorf("memory file: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || uint64(st.Size) != m.MemorySize {
		return fmt.Errorf("memory file: not a regular file of %d bytes: %w", m.MemorySize, ErrCorrupt)
	}
	got, err := fsverity.Measure(f)
	if err != nil {
		return fmt.Errorf("memory file: %w", err)
	}
	if got != want {
		return fmt.Errorf("memory file: %w: its fs-verity digest is not the manifest's", ErrChecksum)
	}
	return nil
}

// checkGiven checks the memory a caller handed over (WithSealedMemory):
// a sealed memfd of the manifest's size, or, for a snapshot with an
// fs-verity digest, its memory file with that digest.
func checkGiven(fd int, m *Manifest) error {
	serr := memory.CheckSealed(fd, int64(m.MemorySize))
	if serr == nil || m.MemoryVerity == "" {
		return serr
	}
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("memory image: %w", err)
	}
	f := os.NewFile(uintptr(dup), "memory image")
	defer f.Close()
	if err := checkVerity(f, m); err != nil {
		return fmt.Errorf("memory image is neither a sealed memfd (%v) nor the memory file with fs-verity: %w", serr, err)
	}
	return nil
}
