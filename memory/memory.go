// Package memory holds a guest's physical RAM: one memfd (so a snapshot can
// save it and a restore can map it copy-on-write) laid out as regions of
// guest-physical address space. Every access from device code goes through a
// bounds-checked method, so an address or length a guest chose can never reach
// outside RAM.
package memory

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// Region is one contiguous range of guest RAM, backed by the memfd at Offset.
type Region struct {
	GuestAddr uint64
	Size      uint64
	Offset    uint64 // offset in the backing file
	host      []byte
}

// End returns the first guest address past the region.
func (r *Region) End() uint64 { return r.GuestAddr + r.Size }

// ErrOutOfRange is wrapped by every access that falls outside guest RAM.
var ErrOutOfRange = errors.New("outside guest memory")

// Memory is a guest's RAM.
type Memory struct {
	regions []*Region // sorted by GuestAddr, not overlapping
	fd      int       // backing memfd, -1 for anonymous memory
	size    uint64    // total bytes
	host    []byte    // the one mapping of all regions
	private bool      // the mapping is copy-on-write (or anonymous)
	// huge: the mapping is advised MADV_HUGEPAGE and the host gives shmem
	// huge pages to such mappings, so pages made through it are 2 MiB.
	huge bool
}

// Private reports whether the memory is a copy-on-write (or anonymous)
// mapping, whose writes do not reach its file.
func (m *Memory) Private() bool { return m.private }

// Regions returns the regions in guest-address order.
func (m *Memory) Regions() []Region {
	out := make([]Region, len(m.regions))
	for i, r := range m.regions {
		out[i] = *r
	}
	return out
}

// Size returns the total RAM in bytes.
func (m *Memory) Size() uint64 { return m.size }

// FD returns the backing memfd, or -1 when the memory is anonymous.
func (m *Memory) FD() int { return m.fd }

// Host returns the host mapping of region i (for KVM memory slots).
func (m *Memory) Host(i int) []byte { return m.regions[i].host }

// find returns the region holding addr.
func (m *Memory) find(addr uint64) *Region {
	i := sort.Search(len(m.regions), func(i int) bool { return m.regions[i].End() > addr })
	if i < len(m.regions) && m.regions[i].GuestAddr <= addr {
		return m.regions[i]
	}
	return nil
}

// Slice returns the host bytes for guest range [addr, addr+n). The range must
// lie inside one region; a guest-chosen range that does not is an error, never
// a panic. The slice aliases guest memory.
func (m *Memory) Slice(addr, n uint64) ([]byte, error) {
	r := m.find(addr)
	if r == nil {
		return nil, fmt.Errorf("guest address %#x: %w", addr, ErrOutOfRange)
	}
	off := addr - r.GuestAddr
	if n > r.Size-off {
		return nil, fmt.Errorf("guest range %#x+%#x: %w", addr, n, ErrOutOfRange)
	}
	return r.host[off : off+n : off+n], nil
}

// Populate allocates the host pages behind guest range [addr, addr+n)
// (widened to whole pages) in one call, MADV_POPULATE_WRITE, before the
// VMM writes the range: a loader filling tens of MiB (a kernel, an
// initramfs) then takes no page fault per page, which under nested or
// emulated virtualisation costs far more than the copy. Where the kernel
// lacks it (before 5.14) it does nothing. The range must lie inside one
// region.
func (m *Memory) Populate(addr, n uint64) error {
	r := m.find(addr)
	if r == nil {
		return fmt.Errorf("guest address %#x: %w", addr, ErrOutOfRange)
	}
	off := addr - r.GuestAddr
	if n > r.Size-off {
		return fmt.Errorf("guest range %#x+%#x: %w", addr, n, ErrOutOfRange)
	}
	page := uint64(os.Getpagesize())
	start, end := off&^(page-1), min((off+n+page-1)&^(page-1), r.Size)
	if start == end {
		return nil
	}
	err := unix.Madvise(r.host[start:end], unix.MADV_POPULATE_WRITE)
	if errors.Is(err, unix.EINVAL) {
		return nil // an older kernel: the pages fault in as written
	}
	if err != nil {
		return fmt.Errorf("populate guest range %#x+%#x: %w", addr, n, err)
	}
	return nil
}

// adviseHuge marks a fresh guest RAM mapping MADV_HUGEPAGE. Guest RAM in
// 4 KiB host pages costs the guest a nested page fault (an exit to the
// host kernel) for every page it first touches, and a TLB entry for each
// page after that: a guest reading 64 MiB from its disk into fresh page
// cache takes 16,384 of those faults, where 2 MiB pages take 32 (QEMU
// advises its RAM the same way). A memfd's pages are shmem, which the host
// kernel gives huge pages only where
// /sys/kernel/mm/transparent_hugepage/shmem_enabled says advise (with
// this call), always or within_size; with never (the kernel's default) the
// advice is recorded and nothing changes (kiln doctor warns). A kernel
// built without transparent huge pages refuses it with EINVAL, which is no
// error here. Restored and forked memory is not advised: a clone's
// private pages stay 4 KiB, so one it writes costs 4 KiB, not 2 MiB.
//
// It reports whether pages made through the mapping will be huge: the
// advice was taken and shmem_enabled allows it.
func adviseHuge(host []byte) (bool, error) {
	if len(host) == 0 {
		return false, nil
	}
	err := unix.Madvise(host, unix.MADV_HUGEPAGE)
	if errors.Is(err, unix.EINVAL) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("madvise guest memory (%d MiB) MADV_HUGEPAGE: %w", len(host)>>20, err)
	}
	b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
	if err != nil {
		return false, nil
	}
	for _, mode := range []string{"[advise]", "[always]", "[within_size]", "[force]"} {
		if strings.Contains(string(b), mode) {
			return true, nil
		}
	}
	return false, nil
}

// ReadAt copies guest memory at addr into b.
func (m *Memory) ReadAt(b []byte, addr uint64) error {
	s, err := m.Slice(addr, uint64(len(b)))
	if err != nil {
		return err
	}
	copy(b, s)
	return nil
}

// WriteAt copies b into guest memory at addr.
func (m *Memory) WriteAt(b []byte, addr uint64) error {
	s, err := m.Slice(addr, uint64(len(b)))
	if err != nil {
		return err
	}
	copy(s, b)
	return nil
}

// Close unmaps the memory and closes the memfd.
func (m *Memory) Close() error {
	if m.host == nil {
		return nil
	}
	err := unmap(m.host)
	if m.fd >= 0 {
		if cerr := closeFD(m.fd); err == nil {
			err = cerr
		}
	}
	m.host, m.regions, m.fd = nil, nil, -1
	return err
}

// Layout describes the regions to create: guest address and size of each.
type Layout []struct{ GuestAddr, Size uint64 }

func (l Layout) validate() (uint64, error) {
	if len(l) == 0 {
		return 0, errors.New("memory layout has no regions")
	}
	var total uint64
	for i, r := range l {
		if r.Size == 0 || r.Size%pageSize != 0 || r.GuestAddr%pageSize != 0 {
			return 0, fmt.Errorf("memory region %d (%#x+%#x) is empty or not page-aligned", i, r.GuestAddr, r.Size)
		}
		if r.GuestAddr+r.Size < r.GuestAddr {
			return 0, fmt.Errorf("memory region %d (%#x+%#x) wraps around", i, r.GuestAddr, r.Size)
		}
		if i > 0 && l[i-1].GuestAddr+l[i-1].Size > r.GuestAddr {
			return 0, fmt.Errorf("memory region %d (%#x) overlaps or precedes region %d", i, r.GuestAddr, i-1)
		}
		total += r.Size
	}
	return total, nil
}

const pageSize = 4096
