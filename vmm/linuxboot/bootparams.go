package linuxboot

import (
	"encoding/binary"
	"fmt"
)

// E820 memory types.
const (
	E820RAM      = 1
	E820Reserved = 2
	E820ACPI     = 3
)

// E820Entry is one range of the BIOS memory map.
type E820Entry struct {
	Addr, Size uint64
	Type       uint32
}

// zero page (struct boot_params) offsets.
const (
	zeroPageSize       = 4096
	offACPIRSDPAddr    = 0x070
	offExtRamdiskImage = 0x0c0
	offExtRamdiskSize  = 0x0c4
	offExtCmdLinePtr   = 0x0c8
	offE820Entries     = 0x1e8
	offE820Table       = 0x2d0
	maxE820            = 128
	e820EntrySize      = 20
)

// BootInfo is what the VMM placed in guest memory for the kernel.
type BootInfo struct {
	CmdlineAddr uint64
	CmdlineLen  uint64 // without the NUL
	InitrdAddr  uint64
	InitrdSize  uint64
	RSDPAddr    uint64
	E820        []E820Entry
}

// ZeroPage builds struct boot_params for the 64-bit boot protocol.
func (img *Image) ZeroPage(bi BootInfo) ([]byte, error) {
	if len(bi.E820) == 0 || len(bi.E820) > maxE820 {
		return nil, fmt.Errorf("boot params: %d e820 entries, want 1..%d", len(bi.E820), maxE820)
	}
	if bi.CmdlineLen > uint64(img.CmdlineSize) {
		return nil, fmt.Errorf("command line of %d bytes is longer than the kernel's limit of %d", bi.CmdlineLen, img.CmdlineSize)
	}
	if bi.InitrdSize > 0 && bi.InitrdAddr+bi.InitrdSize-1 > img.InitrdAddrMax {
		return nil, fmt.Errorf("initrd at %#x+%#x ends above the kernel's limit %#x", bi.InitrdAddr, bi.InitrdSize, img.InitrdAddrMax)
	}
	le := binary.LittleEndian
	zp := make([]byte, zeroPageSize)
	if img.Setup != nil {
		copy(zp[offSetupSects:], img.Setup)
	} else {
		// An ELF vmlinux carries no setup header: write the fields the
		// kernel checks when entered at startup_64.
		le.PutUint16(zp[offBootFlag:], 0xaa55)
		copy(zp[offHeader:], "HdrS")
		le.PutUint16(zp[offVersion:], 0x020f)
		le.PutUint32(zp[offKernelAlign:], 0x1000000)
	}
	zp[offTypeOfLoader] = 0xff
	zp[offLoadFlags] |= loadedHigh | canUseHeap
	le.PutUint16(zp[offHeapEndPtr:], 0xfe00)
	le.PutUint32(zp[offCmdLinePtr:], uint32(bi.CmdlineAddr))
	le.PutUint32(zp[offExtCmdLinePtr:], uint32(bi.CmdlineAddr>>32))
	le.PutUint32(zp[offRamdiskImage:], uint32(bi.InitrdAddr))
	le.PutUint32(zp[offExtRamdiskImage:], uint32(bi.InitrdAddr>>32))
	le.PutUint32(zp[offRamdiskSize:], uint32(bi.InitrdSize))
	le.PutUint32(zp[offExtRamdiskSize:], uint32(bi.InitrdSize>>32))
	le.PutUint64(zp[offACPIRSDPAddr:], bi.RSDPAddr)
	zp[offE820Entries] = uint8(len(bi.E820))
	for i, e := range bi.E820 {
		o := offE820Table + i*e820EntrySize
		le.PutUint64(zp[o:], e.Addr)
		le.PutUint64(zp[o+8:], e.Size)
		le.PutUint32(zp[o+16:], e.Type)
	}
	return zp, nil
}

// PVH start info (struct hvm_start_info, version 1) and its memory map.
const (
	pvhMagic         = 0x336ec578
	pvhStartInfoSize = 56
	pvhMemmapEntry   = 24
)

// PVHStartInfo builds struct hvm_start_info followed, at memmapAddr, by the
// memory map; it returns both blobs. The start info goes at its own address,
// which the VMM passes in EBX.
func PVHStartInfo(bi BootInfo, memmapAddr uint64) (info, memmap []byte, err error) {
	if len(bi.E820) == 0 || len(bi.E820) > maxE820 {
		return nil, nil, fmt.Errorf("PVH: %d memory map entries, want 1..%d", len(bi.E820), maxE820)
	}
	le := binary.LittleEndian
	info = make([]byte, pvhStartInfoSize)
	// struct hvm_start_info: magic, version, flags, nr_modules (u32 each),
	// modlist, cmdline, rsdp, memmap (u64 each), memmap_entries, reserved.
	le.PutUint32(info[0:], pvhMagic)
	le.PutUint32(info[4:], 1) // version 1: has the memory map
	le.PutUint64(info[24:], bi.CmdlineAddr)
	le.PutUint64(info[32:], bi.RSDPAddr)
	le.PutUint64(info[40:], memmapAddr)
	le.PutUint32(info[48:], uint32(len(bi.E820)))
	if bi.InitrdSize > 0 {
		// One module, the initrd: a struct hvm_modlist_entry placed right
		// after the memory map.
		le.PutUint32(info[12:], 1)
		le.PutUint64(info[16:], memmapAddr+uint64(len(bi.E820))*pvhMemmapEntry)
	}
	memmap = make([]byte, len(bi.E820)*pvhMemmapEntry, len(bi.E820)*pvhMemmapEntry+32)
	for i, e := range bi.E820 {
		o := i * pvhMemmapEntry
		le.PutUint64(memmap[o:], e.Addr)
		le.PutUint64(memmap[o+8:], e.Size)
		le.PutUint32(memmap[o+16:], e.Type)
	}
	if bi.InitrdSize > 0 {
		mod := make([]byte, 32)
		le.PutUint64(mod[0:], bi.InitrdAddr)
		le.PutUint64(mod[8:], bi.InitrdSize)
		memmap = append(memmap, mod...)
	}
	return info, memmap, nil
}
