package snapshot

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// openDir opens the snapshot directory dir (the caller's path, which may
// itself be a symbolic link) for openIn.
func openDir(dir string) (*os.File, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			return nil, fmt.Errorf("no directory %s: %w: %w", dir, err, os.ErrNotExist)
		}
		return nil, fmt.Errorf("open directory %s: %w", dir, err)
	}
	return os.NewFile(uintptr(fd), dir), nil
}

// openIn opens the file name of the snapshot directory d read-only. name
// is one path component, resolved beneath d (openat2 RESOLVE_BENEATH) with
// no symbolic link followed anywhere (RESOLVE_NO_SYMLINKS; O_NOFOLLOW on
// kernels without openat2), and it must be a regular file: a link, a
// directory, a FIFO (opened without blocking) or a device is refused,
// wrapping ErrCorrupt.
func openIn(d *os.File, name string) (*os.File, error) {
	if name == "" || name == "." || name == ".." || strings.ContainsRune(name, '/') {
		return nil, fmt.Errorf("%q is not a file name of a snapshot: %w", name, ErrCorrupt)
	}
	flags := uint64(unix.O_RDONLY | unix.O_CLOEXEC | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_NOCTTY)
	fd, err := unix.Openat2(int(d.Fd()), name, &unix.OpenHow{
		Flags:   flags,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EPERM) {
		// No openat2 here (or a filter forbids it): one component with
		// O_NOFOLLOW cannot leave d or follow a link either.
		fd, err = unix.Openat(int(d.Fd()), name, int(flags), 0)
	}
	switch {
	case errors.Is(err, unix.ELOOP):
		return nil, fmt.Errorf("%s is a symbolic link: a snapshot's files are its own, never links: %w", name, ErrCorrupt)
	case errors.Is(err, unix.EXDEV):
		return nil, fmt.Errorf("%s leads outside the snapshot directory: %w", name, ErrCorrupt)
	case errors.Is(err, unix.ENOENT):
		return nil, fmt.Errorf("no %s: %w: %w", name, os.ErrNotExist, ErrCorrupt)
	case err != nil:
		return nil, fmt.Errorf("open %s: %w", name, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("stat %s: %w", name, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("%s is not a regular file: %w", name, ErrCorrupt)
	}
	// Reads block as usual: O_NONBLOCK only kept the open of a FIFO
	// from waiting for a writer.
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	return f, nil
}
