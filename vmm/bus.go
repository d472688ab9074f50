package vmm

import (
	"fmt"
	"sort"
	"sync"
)

// Device is something the guest reaches through port I/O or MMIO. offset is
// relative to the start of the range the device was added at; len(data) is the
// access size (1, 2, 4 or 8). Read fills data.
type Device interface {
	Read(offset uint64, data []byte)
	Write(offset uint64, data []byte)
}

type busRange struct {
	base, size uint64
	dev        Device
}

// Bus dispatches accesses in one address space (I/O ports or MMIO) to the
// device whose range holds the address. Accesses nobody claims read as all
// ones and are otherwise ignored, as on a real machine.
type Bus struct {
	mu     sync.RWMutex
	ranges []busRange // sorted by base
}

// Add claims [base, base+size) for dev.
func (b *Bus) Add(base, size uint64, dev Device) error {
	if size == 0 || base+size < base {
		return fmt.Errorf("bus range %#x+%#x is empty or wraps", base, size)
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, r := range b.ranges {
		if base < r.base+r.size && r.base < base+size {
			return fmt.Errorf("bus range %#x+%#x overlaps %#x+%#x", base, size, r.base, r.size)
		}
	}
	b.ranges = append(b.ranges, busRange{base, size, dev})
	sort.Slice(b.ranges, func(i, j int) bool { return b.ranges[i].base < b.ranges[j].base })
	return nil
}

func (b *Bus) find(addr uint64) (Device, uint64, bool) {
	b.mu.RLock()
	defer b.mu.RUnlock()
	i := sort.Search(len(b.ranges), func(i int) bool { return b.ranges[i].base+b.ranges[i].size > addr })
	if i < len(b.ranges) && b.ranges[i].base <= addr {
		return b.ranges[i].dev, addr - b.ranges[i].base, true
	}
	return nil, 0, false
}

// Read dispatches a read; it reports whether a device claimed the address.
func (b *Bus) Read(addr uint64, data []byte) bool {
	if d, off, ok := b.find(addr); ok {
		d.Read(off, data)
		return true
	}
	for i := range data {
		data[i] = 0xff
	}
	return false
}

// Write dispatches a write; it reports whether a device claimed the address.
func (b *Bus) Write(addr uint64, data []byte) bool {
	if d, off, ok := b.find(addr); ok {
		d.Write(off, data)
		return true
	}
	return false
}
