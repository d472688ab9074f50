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
	return newMemory(host, fd, layout, flags&unix.MAP_PRIVATE != 0), nil
}

func newMemory(host []byte, fd int, layout Layout, private bool) *Memory {
	m := &Memory{fd: fd, size: uint64(len(host)), host: host, private: private}
	var off uint64
	for _, r := range layout {
		m.regions = append(m.regions, &Region{GuestAddr: r.GuestAddr, Size: r.Size, Offset: off, host: host[off : off+r.Size : off+r.Size]})
		off += r.Size
	}
	return m
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
	return newMemory(host, -1, layout, true), nil
}

func unmap(host []byte) error { return unix.Munmap(host) }
func closeFD(fd int) error    { return unix.Close(fd) }

// Freeze makes the memory's current contents the frozen base of forks: it
// returns a new descriptor (the caller's to close) of a file that holds
// them and that nothing will write again, and remaps m copy-on-write over
// that file at the same host addresses, so that whoever holds m's slices
// (KVM's memory slots, device queues) carries on unchanged. Memory on a
// shared memfd freezes without a copy: the memfd becomes the base.
// Private or anonymous memory is first copied into a new memfd (all-zero
// pages skipped). Nothing may access m during the call: pause the vCPUs
// and devices first.
func (m *Memory) Freeze() (int, error) {
	if m.host == nil {
		return -1, fmt.Errorf("freeze: memory is closed")
	}
	base := m.fd
	if m.private || base < 0 {
		fd, err := unix.MemfdCreate("kiln-guest-ram-base", unix.MFD_CLOEXEC)
		if err != nil {
			return -1, fmt.Errorf("freeze: memfd_create: %w", err)
		}
		if err := copyNonZero(fd, m.host); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("freeze: %w", err)
		}
		base = fd
	}
	_, err := unix.MmapPtr(base, 0, unsafe.Pointer(unsafe.SliceData(m.host)), uintptr(len(m.host)),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_FIXED|unix.MAP_NORESERVE)
	if err != nil {
		if base != m.fd {
			unix.Close(base)
		}
		return -1, fmt.Errorf("freeze: remap copy-on-write: %w", err)
	}
	if base != m.fd {
		if m.fd >= 0 {
			unix.Close(m.fd)
		}
		m.fd = base
	}
	m.private = true
	out, err := dup(base)
	if err != nil {
		return -1, fmt.Errorf("freeze: %w", err)
	}
	return out, nil
}

// copyNonZero sizes the file fd to len(b) and writes b's pages that are not
// all zeros into it.
func copyNonZero(fd int, b []byte) error {
	if err := unix.Ftruncate(fd, int64(len(b))); err != nil {
		return fmt.Errorf("size the base file: %w", err)
	}
	var zero [pageSize]byte
	for off := 0; off < len(b); off += pageSize {
		page := b[off:min(off+pageSize, len(b))]
		if string(page) == string(zero[:len(page)]) {
			continue
		}
		for done := 0; done < len(page); {
			n, err := unix.Pwrite(fd, page[done:], int64(off+done))
			if err != nil {
				return fmt.Errorf("copy memory into the base file: %w", err)
			}
			done += n
		}
	}
	return nil
}

// HostAddr returns the host virtual address of region i's first byte.
func (m *Memory) HostAddr(i int) uintptr {
	return uintptr(unsafe.Pointer(unsafe.SliceData(m.regions[i].host)))
}

func dup(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }
