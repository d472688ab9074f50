// Package linuxboot parses Linux kernel images (bzImage and ELF vmlinux, with
// or without a PVH entry note) and builds what the x86 boot protocol hands a
// kernel: the zero page (struct boot_params) with its e820 map, or a PVH
// hvm_start_info. See Documentation/arch/x86/boot.rst and include/xen/interface/
// hvm/start_info.h. Image files are user input: Parse validates every field it
// uses and is fuzzed.
package linuxboot

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
)

// Kind is the format of a kernel image.
type Kind int

// Kernel image formats.
const (
	BzImage Kind = iota + 1
	ELF
)

func (k Kind) String() string {
	switch k {
	case BzImage:
		return "bzImage"
	case ELF:
		return "ELF"
	}
	return "unknown"
}

// Segment is a piece of the image to copy into guest memory.
type Segment struct {
	Addr   uint64 // guest-physical load address
	Data   []byte // bytes from the file; nil when parsed by ParseFile from an ELF
	MemLen uint64 // bytes the segment occupies (>= its file bytes; the rest is zero)
	// FileOff and FileLen locate the segment's bytes in the image file when
	// Data is nil (ParseFile of an ELF kernel): the loader reads them
	// straight into guest memory instead of through a copy of the file.
	FileOff, FileLen uint64
}

// FileBytes is how many bytes of the file the segment holds.
func (s Segment) FileBytes() uint64 {
	if s.Data != nil {
		return uint64(len(s.Data))
	}
	return s.FileLen
}

// Image is a parsed kernel.
type Image struct {
	Kind     Kind
	Segments []Segment
	// Entry64 is the 64-bit entry point (bzImage: load address + 0x200;
	// ELF: e_entry). Zero when the image only has a PVH entry.
	Entry64 uint64
	// PVHEntry is the 32-bit PVH entry point from XEN_ELFNOTE_PHYS32_ENTRY, or 0.
	PVHEntry uint64
	// End is the first guest-physical address the kernel needs past its load
	// address, including the room it decompresses into (bzImage init_size).
	End uint64
	// Setup is the bzImage setup header (from offset 0x1f1), copied into the
	// zero page; nil for ELF.
	Setup []byte
	// ProtocolVersion is the boot protocol version (bzImage), e.g. 0x020f.
	ProtocolVersion uint16
	// InitrdAddrMax is the highest address the initrd may end at (inclusive).
	InitrdAddrMax uint64
	// CmdlineSize is the longest command line the kernel accepts, without NUL.
	CmdlineSize uint32
}

// KernelLoadAddr is where a bzImage's protected-mode code is loaded (1 MiB).
const KernelLoadAddr = 0x100000

// bzImage setup header offsets (from the start of the file / zero page).
const (
	offSetupSects    = 0x1f1
	offBootFlag      = 0x1fe
	offJump          = 0x200
	offHeader        = 0x202
	offVersion       = 0x206
	offTypeOfLoader  = 0x210
	offLoadFlags     = 0x211
	offRamdiskImage  = 0x218
	offRamdiskSize   = 0x21c
	offHeapEndPtr    = 0x224
	offCmdLinePtr    = 0x228
	offInitrdAddrMax = 0x22c
	offKernelAlign   = 0x230
	offRelocatable   = 0x234
	offXLoadFlags    = 0x236
	offCmdlineSize   = 0x238
	offInitSize      = 0x260
)

const (
	minProtocol  = 0x020c // 2.12: 64-bit entry and xloadflags
	xlfKernel64  = 1 << 0
	loadedHigh   = 1 << 0
	canUseHeap   = 1 << 7
	maxImageSize = 512 << 20
)

// ErrNotKernel is wrapped when a file is neither a bzImage nor an ELF kernel.
var ErrNotKernel = errors.New("not a Linux kernel image (neither bzImage nor ELF)")

// Parse recognises and validates a kernel image held in data. The returned
// segments alias data.
func Parse(data []byte) (*Image, error) {
	if len(data) > maxImageSize {
		return nil, fmt.Errorf("kernel image of %d MiB is larger than %d MiB", len(data)>>20, maxImageSize>>20)
	}
	if len(data) >= 4 && bytes.Equal(data[:4], []byte(elf.ELFMAG)) {
		return parseELF(data)
	}
	if len(data) >= offHeader+4 && string(data[offHeader:offHeader+4]) == "HdrS" {
		return parseBzImage(data)
	}
	if len(data) < 1024 {
		return nil, fmt.Errorf("%w: only %d bytes", ErrNotKernel, len(data))
	}
	return nil, ErrNotKernel
}

// maxNoteBytes bounds an ELF note segment ParseFile reads (the PVH note is
// a few dozen bytes; Debian's whole .notes is under 1 KiB).
const maxNoteBytes = 1 << 20

// ParseFile is Parse of an image read through r, size bytes long. An ELF
// kernel is parsed from its headers and notes alone: its segments are
// left in the file (FileOff, FileLen), so that a 70 MiB vmlinux is never
// held in memory twice. Anything else is read whole and given to Parse.
func ParseFile(r io.ReaderAt, size int64) (*Image, error) {
	if size < 0 || size > maxImageSize {
		return nil, fmt.Errorf("kernel image of %d bytes: at most %d MiB allowed", size, maxImageSize>>20)
	}
	var magic [4]byte
	if n, _ := r.ReadAt(magic[:], 0); n == len(magic) && bytes.Equal(magic[:], []byte(elf.ELFMAG)) {
		return parseELFFrom(io.NewSectionReader(r, 0, size), uint64(size), nil)
	}
	data := make([]byte, size)
	if n, err := r.ReadAt(data, 0); int64(n) < size {
		return nil, fmt.Errorf("reading kernel image: %d of %d bytes: %w", n, size, err)
	}
	return Parse(data)
}

func parseBzImage(data []byte) (*Image, error) {
	le := binary.LittleEndian
	if len(data) < offInitSize+4 {
		return nil, fmt.Errorf("bzImage: %d bytes, shorter than a setup header of boot protocol 2.12 (%d)", len(data), offInitSize+4)
	}
	if le.Uint16(data[offBootFlag:]) != 0xaa55 {
		return nil, fmt.Errorf("bzImage: boot flag %#x, want 0xaa55", le.Uint16(data[offBootFlag:]))
	}
	version := le.Uint16(data[offVersion:])
	if version < minProtocol {
		return nil, fmt.Errorf("bzImage: boot protocol %d.%02d is older than 2.12 (no 64-bit entry)", version>>8, version&0xff)
	}
	// The header runs from 0x1f1 to 0x202 + the jump's byte offset.
	hdrEnd := offHeader + int(data[offJump+1])
	if hdrEnd <= offInitSize+4 || hdrEnd > len(data) || hdrEnd > 0x1000 {
		return nil, fmt.Errorf("bzImage: setup header ends at %#x, outside the file or the zero page", hdrEnd)
	}
	if le.Uint16(data[offXLoadFlags:])&xlfKernel64 == 0 {
		return nil, errors.New("bzImage: kernel has no 64-bit entry point (XLF_KERNEL_64 unset)")
	}
	if data[offLoadFlags]&loadedHigh == 0 {
		return nil, errors.New("bzImage: kernel is not loaded high (zImage); not supported")
	}
	setupSects := int(data[offSetupSects])
	if setupSects == 0 {
		setupSects = 4
	}
	kernelOff := (setupSects + 1) * 512
	if kernelOff >= len(data) {
		return nil, fmt.Errorf("bzImage: %d setup sectors reach past the end of the %d-byte file (truncated?)", setupSects, len(data))
	}
	// syssize (in 16-byte paragraphs) says how much protected-mode code follows.
	syssize := uint64(le.Uint32(data[0x1f4:])) * 16
	if syssize == 0 || uint64(kernelOff)+syssize > uint64(len(data)) {
		return nil, fmt.Errorf("bzImage: file has %d bytes of kernel, header promises %d (truncated?)", len(data)-kernelOff, syssize)
	}
	code := data[kernelOff:]
	initSize := uint64(le.Uint32(data[offInitSize:]))
	need := max(initSize, uint64(len(code)))
	img := &Image{
		Kind:            BzImage,
		Segments:        []Segment{{Addr: KernelLoadAddr, Data: code, MemLen: uint64(len(code))}},
		Entry64:         KernelLoadAddr + 0x200,
		End:             KernelLoadAddr + need,
		Setup:           data[offSetupSects:hdrEnd],
		ProtocolVersion: version,
		InitrdAddrMax:   uint64(le.Uint32(data[offInitrdAddrMax:])),
		CmdlineSize:     le.Uint32(data[offCmdlineSize:]),
	}
	if img.InitrdAddrMax == 0 {
		img.InitrdAddrMax = 0x37ffffff
	}
	if img.CmdlineSize == 0 {
		img.CmdlineSize = 255
	}
	return img, nil
}

// xenElfNotePhys32Entry is the PVH entry note type in a "Xen" ELF note.
const xenElfNotePhys32Entry = 18

func parseELF(data []byte) (*Image, error) {
	return parseELFFrom(bytes.NewReader(data), uint64(len(data)), data)
}

// parseELFFrom parses an ELF kernel of size bytes read through ra. With
// data (the whole file, as ra reads it) segments alias it; without, they
// name their place in the file.
func parseELFFrom(ra io.ReaderAt, size uint64, data []byte) (*Image, error) {
	f, err := elf.NewFile(ra)
	if err != nil {
		return nil, fmt.Errorf("ELF kernel: %w", err)
	}
	if f.Class != elf.ELFCLASS64 || f.Machine != elf.EM_X86_64 {
		return nil, fmt.Errorf("ELF kernel: %v %v, want ELFCLASS64 x86-64", f.Class, f.Machine)
	}
	img := &Image{Kind: ELF, Entry64: f.Entry, InitrdAddrMax: 0x37ffffff, CmdlineSize: 2048}
	for _, p := range f.Progs {
		switch p.Type {
		case elf.PT_LOAD:
			if p.Filesz > p.Memsz || p.Off+p.Filesz > size || p.Off+p.Filesz < p.Off {
				return nil, fmt.Errorf("ELF kernel: segment at %#x has file size %#x past the file (truncated?)", p.Paddr, p.Filesz)
			}
			if p.Paddr < KernelLoadAddr || p.Paddr+p.Memsz < p.Paddr {
				return nil, fmt.Errorf("ELF kernel: segment at physical %#x+%#x is below 1 MiB or wraps", p.Paddr, p.Memsz)
			}
			seg := Segment{Addr: p.Paddr, MemLen: p.Memsz}
			if data != nil {
				seg.Data = data[p.Off : p.Off+p.Filesz]
			} else {
				seg.FileOff, seg.FileLen = p.Off, p.Filesz
			}
			img.Segments = append(img.Segments, seg)
			img.End = max(img.End, p.Paddr+p.Memsz)
		case elf.PT_NOTE:
			if p.Off+p.Filesz > size || p.Off+p.Filesz < p.Off {
				return nil, fmt.Errorf("ELF kernel: note segment past the end of the file")
			}
			var notes []byte
			if data != nil {
				notes = data[p.Off : p.Off+p.Filesz]
			} else {
				if p.Filesz > maxNoteBytes {
					return nil, fmt.Errorf("ELF kernel: note segment of %d bytes, at most %d read", p.Filesz, maxNoteBytes)
				}
				notes = make([]byte, p.Filesz)
				if _, err := ra.ReadAt(notes, int64(p.Off)); err != nil {
					return nil, fmt.Errorf("ELF kernel: reading notes: %w", err)
				}
			}
			if e, ok := pvhEntry(notes); ok {
				img.PVHEntry = e
			}
		}
	}
	if len(img.Segments) == 0 {
		return nil, errors.New("ELF kernel: no loadable segments")
	}
	if img.Entry64 < KernelLoadAddr || img.Entry64 >= img.End {
		// A vmlinux's e_entry is physical (phys_startup_64); anything else
		// cannot be entered with paging identity-mapped.
		if img.PVHEntry == 0 {
			return nil, fmt.Errorf("ELF kernel: entry %#x is outside its loaded segments and there is no PVH note", f.Entry)
		}
		img.Entry64 = 0
	}
	return img, nil
}

// pvhEntry walks ELF notes looking for the Xen PHYS32_ENTRY note.
func pvhEntry(notes []byte) (uint64, bool) {
	le := binary.LittleEndian
	for len(notes) >= 12 {
		namesz, descsz, typ := le.Uint32(notes), le.Uint32(notes[4:]), le.Uint32(notes[8:])
		nameEnd := 12 + align4(uint64(namesz))
		descEnd := nameEnd + align4(uint64(descsz))
		if nameEnd > uint64(len(notes)) || descEnd > uint64(len(notes)) {
			return 0, false
		}
		name := notes[12 : 12+uint64(namesz)]
		desc := notes[nameEnd : nameEnd+uint64(descsz)]
		if typ == xenElfNotePhys32Entry && string(bytes.TrimRight(name, "\x00")) == "Xen" {
			switch len(desc) {
			case 4:
				return uint64(le.Uint32(desc)), true
			case 8:
				return le.Uint64(desc), true
			}
		}
		notes = notes[descEnd:]
	}
	return 0, false
}

func align4(v uint64) uint64 { return (v + 3) &^ 3 }
