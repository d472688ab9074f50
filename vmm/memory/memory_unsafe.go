package memory

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// New creates guest RAM on a fresh memfd named name, mapped shared, with the
// given layout (regions sorted by address, page-aligned).
func New(name string, layout Layout) (*Memory, error) {
	total, err := layout.validate()
	if err != nil {
		return nil, err
	}
	fd, err := unix.MemfdCreate(name, unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	if err := unix.Ftruncate(fd, int64(total)); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("size guest memory to %d MiB: %w", total>>20, err)
	}
	m, err := mapFile(fd, layout, total, unix.MAP_SHARED)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	return m, nil
}

// MapFile maps an existing file (a memfd or a saved memory image) as guest
// RAM. With private set the mapping is copy-on-write: guest writes never reach
// the file. The Memory takes ownership of fd.
func MapFile(fd int, layout Layout, private bool) (*Memory, error) {
	total, err := layout.validate()
	if err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return nil, fmt.Errorf("stat memory file: %w", err)
	}
	if uint64(st.Size) < total {
		return nil, fmt.Errorf("memory file holds %d bytes, layout needs %d", st.Size, total)
	}
	flags := unix.MAP_SHARED
	if private {
		flags = unix.MAP_PRIVATE
	}
	return mapFile(fd, layout, total, flags)
}

func mapFile(fd int, layout Layout, total uint64, flags int) (*Memory, error) {
	// One mapping for the whole file keeps the regions' host addresses stable.
	host, err := unix.Mmap(fd, 0, int(total), unix.PROT_READ|unix.PROT_WRITE, flags|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("mmap %d MiB of guest memory: %w", total>>20, err)
	}
	m := &Memory{fd: fd, size: total}
	var off uint64
	for _, r := range layout {
		m.regions = append(m.regions, &Region{GuestAddr: r.GuestAddr, Size: r.Size, Offset: off, host: host[off : off+r.Size : off+r.Size]})
		off += r.Size
	}
	m.unmap = func() error {
		err := unix.Munmap(host)
		if fd >= 0 {
			if cerr := unix.Close(fd); err == nil {
				err = cerr
			}
		}
		return err
	}
	return m, nil
}

// NewAnonymous creates guest RAM on private anonymous memory; for tests of
// device code that need no file behind it.
func NewAnonymous(layout Layout) (*Memory, error) {
	total, err := layout.validate()
	if err != nil {
		return nil, err
	}
	host, err := unix.Mmap(-1, 0, int(total), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_NORESERVE)
	if err != nil {
		return nil, fmt.Errorf("mmap %d MiB anonymous: %w", total>>20, err)
	}
	m := &Memory{fd: -1, size: total}
	var off uint64
	for _, r := range layout {
		m.regions = append(m.regions, &Region{GuestAddr: r.GuestAddr, Size: r.Size, Offset: off, host: host[off : off+r.Size : off+r.Size]})
		off += r.Size
	}
	m.unmap = func() error { return unix.Munmap(host) }
	return m, nil
}

// HostAddr returns the host virtual address of region i's first byte.
func (m *Memory) HostAddr(i int) uintptr {
	return uintptr(unsafe.Pointer(unsafe.SliceData(m.regions[i].host)))
}

func dup(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }
