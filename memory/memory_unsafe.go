package memory

import (
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"
)

// New creates guest RAM on a fresh memfd named name, mapped shared, with the
// given layout (regions sorted by address, page-aligned). The mapping asks
// for transparent huge pages (MADV_HUGEPAGE): on a host whose shmem_enabled
// allows them (advise or always, see adviseHuge) the guest's RAM faults in
// 2 MiB at a time and KVM maps it with 2 MiB pages.
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
	if m.huge, err = adviseHuge(m.host); err != nil {
		unmap(m.host)
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
	m, err := mapFile(fd, layout, total, flags)
	if err != nil || !private {
		return m, err
	}
	if _, err := m.anonHoles(); err != nil {
		unmap(m.host)
		return nil, err
	}
	return m, nil
}

// Holes of a copy-on-write mapping's file that anonHoles maps anonymous:
// those of minAnonHole bytes or more, the first maxAnonHoles of them. Each
// is a mapping of the process's (vm.max_map_count bounds them), and a
// freeze that remaps memory of many costs more (BenchmarkFreeze's file of
// 2048 holes of 768 KiB: 95 ms a freeze with none, 130-150 with them).
const (
	minAnonHole  = 2 << 20
	maxAnonHoles = 4096
)

// anonHoles maps the holes of a copy-on-write mapping's file anonymous,
// and returns how many. A write fault on a private file mapping first
// reads the file's page into the page cache (in a memfd or on tmpfs, a
// hole's page is allocated in the file) and then copies it: each page the
// guest first writes in a hole would cost two, and the file's copy, shared
// by every mapping of the file, stays charged to the memory cgroup of the
// process that touched it first, not to the kilnd that keeps the file. An
// anonymous mapping reads as zeros, as the hole does, and costs one page
// when written. Nothing may access m during the call.
func (m *Memory) anonHoles() (int, error) {
	size := int64(len(m.host))
	e := &extents{fd: m.fd, size: size}
	n := 0
	for off := int64(0); off < size && n < maxAnonHoles; {
		start, stop, err := e.within(off, size)
		if err != nil {
			return n, err
		}
		if start == stop { // no data from off on
			start, stop = size, size
		}
		if start-off >= minAnonHole {
			_, err := unix.MmapPtr(-1, 0, unsafe.Add(unsafe.Pointer(unsafe.SliceData(m.host)), off), uintptr(start-off),
				unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS|unix.MAP_FIXED|unix.MAP_NORESERVE)
			if err != nil {
				return n, fmt.Errorf("map the memory file's hole at %#x (%d KiB) anonymous: %w", off, (start-off)>>10, err)
			}
			n++
		}
		off = stop
	}
	return n, nil
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
// Private or anonymous memory is first copied into a new, sparse memfd:
// memory copy-on-write over a file copies the file's data extents from the
// file and reads from the mapping only the pages the guest wrote since it
// was mapped (told apart by /proc/self/pagemap), so the copy costs what
// the guest holds, not its size; all-zero pages and the file's holes stay
// holes. Nothing may access m during the call: pause the vCPUs and devices
// first.
func (m *Memory) Freeze() (int, error) {
	fd, _, err := m.freeze(freezeOptions{})
	return fd, err
}

func (m *Memory) freeze(opts freezeOptions) (int, freezeStats, error) {
	var st freezeStats
	if m.host == nil {
		return -1, st, fmt.Errorf("freeze: memory is closed")
	}
	base := m.fd
	if m.private || base < 0 {
		fd, err := unix.MemfdCreate("kiln-guest-ram-base", unix.MFD_CLOEXEC)
		if err != nil {
			return -1, st, fmt.Errorf("freeze: memfd_create: %w", err)
		}
		if st, err = m.copyToBase(fd, opts); err != nil {
			unix.Close(fd)
			return -1, st, fmt.Errorf("freeze: %w", err)
		}
		base = fd
	}
	_, err := unix.MmapPtr(base, 0, unsafe.Pointer(unsafe.SliceData(m.host)), uintptr(len(m.host)),
		unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_FIXED|unix.MAP_NORESERVE)
	if err != nil {
		if base != m.fd {
			unix.Close(base)
		}
		return -1, st, fmt.Errorf("freeze: remap copy-on-write: %w", err)
	}
	// The base's holes, anonymous: as MapFile's (the remap is whole).
	if _, err := (&Memory{host: m.host, fd: base}).anonHoles(); err != nil {
		if base != m.fd {
			unix.Close(base)
		}
		return -1, st, fmt.Errorf("freeze: %w", err)
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
		return -1, st, fmt.Errorf("freeze: %w", err)
	}
	return out, st, nil
}

// hostStart returns the host address of the mapping's first byte.
func (m *Memory) hostStart() uintptr { return addrOf(m.host) }

// addrOf returns the address of b's first byte.
func addrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }

// HostAddr returns the host virtual address of region i's first byte.
func (m *Memory) HostAddr(i int) uintptr {
	return uintptr(unsafe.Pointer(unsafe.SliceData(m.regions[i].host)))
}

func dup(fd int) (int, error) { return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) }
