package linuxboot

import (
	"bytes"
	"debug/elf"
	"encoding/binary"
	"errors"
	"strings"
	"testing"
)

// fakeBzImage builds the smallest file Parse accepts as a bzImage: a setup
// header of protocol 2.15 and kernelLen bytes of "protected-mode code".
func fakeBzImage(kernelLen int) []byte {
	le := binary.LittleEndian
	setupSects := 4
	b := make([]byte, (setupSects+1)*512+kernelLen)
	b[offSetupSects] = byte(setupSects)
	le.PutUint32(b[0x1f4:], uint32(kernelLen/16))
	le.PutUint16(b[offBootFlag:], 0xaa55)
	b[offJump] = 0xeb
	b[offJump+1] = 0x6a // header ends at 0x26c
	copy(b[offHeader:], "HdrS")
	le.PutUint16(b[offVersion:], 0x020f)
	b[offLoadFlags] = loadedHigh
	le.PutUint32(b[offInitrdAddrMax:], 0x7fffffff)
	le.PutUint16(b[offXLoadFlags:], xlfKernel64)
	le.PutUint32(b[offCmdlineSize:], 2047)
	le.PutUint32(b[offInitSize:], uint32(kernelLen*4))
	return b
}

func TestParseBzImage(t *testing.T) {
	img, err := Parse(fakeBzImage(4096))
	if err != nil {
		t.Fatal(err)
	}
	if img.Kind != BzImage || img.Entry64 != KernelLoadAddr+0x200 || img.End != KernelLoadAddr+4*4096 {
		t.Errorf("got kind %v entry %#x end %#x", img.Kind, img.Entry64, img.End)
	}
	if img.CmdlineSize != 2047 || img.InitrdAddrMax != 0x7fffffff || img.ProtocolVersion != 0x020f {
		t.Errorf("header fields: %+v", img)
	}
	if len(img.Setup) != 0x26c-offSetupSects {
		t.Errorf("setup header is %d bytes", len(img.Setup))
	}
}

func TestParseErrors(t *testing.T) {
	le := binary.LittleEndian
	tests := []struct {
		name   string
		mutate func([]byte) []byte
		want   string
	}{
		{"empty", func([]byte) []byte { return nil }, "not a Linux kernel"},
		{"text", func([]byte) []byte { return []byte("#!/bin/sh\necho hi\n") }, "not a Linux kernel"},
		{"truncated", func(b []byte) []byte { return b[:len(b)-100] }, "truncated"},
		{"only setup", func(b []byte) []byte { return b[:5*512] }, "truncated"},
		{"old protocol", func(b []byte) []byte { le.PutUint16(b[offVersion:], 0x0206); return b }, "older than 2.12"},
		{"no 64-bit entry", func(b []byte) []byte { le.PutUint16(b[offXLoadFlags:], 0); return b }, "64-bit"},
		{"bad boot flag", func(b []byte) []byte { b[offBootFlag] = 0; return b }, "boot flag"},
		{"zImage", func(b []byte) []byte { b[offLoadFlags] = 0; return b }, "zImage"},
		{"elf junk", func([]byte) []byte { return append([]byte("\x7fELF"), make([]byte, 100)...) }, "ELF kernel"},
	}
	for _, tt := range tests {
		_, err := Parse(tt.mutate(fakeBzImage(4096)))
		if err == nil {
			t.Errorf("%s: no error", tt.name)
			continue
		}
		if !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: error %q does not mention %q", tt.name, err, tt.want)
		}
	}
	if _, err := Parse([]byte("hello")); !errors.Is(err, ErrNotKernel) {
		t.Errorf("short text: %v does not wrap ErrNotKernel", err)
	}
}

func TestZeroPage(t *testing.T) {
	img, err := Parse(fakeBzImage(4096))
	if err != nil {
		t.Fatal(err)
	}
	bi := BootInfo{
		CmdlineAddr: 0x20000, CmdlineLen: 12, InitrdAddr: 0x7000000, InitrdSize: 0x1000, RSDPAddr: 0xe0000,
		E820: []E820Entry{{0, 0x9fc00, E820RAM}, {0x100000, 0x7f00000, E820RAM}},
	}
	zp, err := img.ZeroPage(bi)
	if err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	checks := []struct {
		name      string
		got, want uint64
	}{
		{"cmd_line_ptr", uint64(le.Uint32(zp[offCmdLinePtr:])), 0x20000},
		{"ramdisk_image", uint64(le.Uint32(zp[offRamdiskImage:])), 0x7000000},
		{"ramdisk_size", uint64(le.Uint32(zp[offRamdiskSize:])), 0x1000},
		{"acpi_rsdp_addr", le.Uint64(zp[offACPIRSDPAddr:]), 0xe0000},
		{"e820_entries", uint64(zp[offE820Entries]), 2},
		{"e820[1].addr", le.Uint64(zp[offE820Table+20:]), 0x100000},
		{"e820[1].type", uint64(le.Uint32(zp[offE820Table+36:])), E820RAM},
		{"type_of_loader", uint64(zp[offTypeOfLoader]), 0xff},
		{"header magic", uint64(le.Uint32(zp[offHeader:])), uint64(le.Uint32([]byte("HdrS")))},
	}
	for _, c := range checks {
		if c.got != c.want {
			t.Errorf("%s = %#x, want %#x", c.name, c.got, c.want)
		}
	}
	bi.CmdlineLen = 5000
	if _, err := img.ZeroPage(bi); err == nil {
		t.Error("an overlong command line was accepted")
	}
	bi.CmdlineLen = 1
	bi.InitrdAddr = 0x80000000
	if _, err := img.ZeroPage(bi); err == nil {
		t.Error("an initrd above initrd_addr_max was accepted")
	}
}

func TestPVHStartInfo(t *testing.T) {
	bi := BootInfo{CmdlineAddr: 0x20000, RSDPAddr: 0xe0000, InitrdAddr: 0x800000, InitrdSize: 100,
		E820: []E820Entry{{0, 0x9fc00, E820RAM}, {0x100000, 0x100000, E820RAM}}}
	info, mm, err := PVHStartInfo(bi, 0x6000)
	if err != nil {
		t.Fatal(err)
	}
	le := binary.LittleEndian
	if le.Uint32(info) != pvhMagic || le.Uint64(info[40:]) != 0x6000 || le.Uint32(info[48:]) != 2 || le.Uint32(info[12:]) != 1 {
		t.Errorf("start info %x", info)
	}
	if le.Uint64(info[16:]) != 0x6000+48 || le.Uint64(mm[48:]) != 0x800000 || le.Uint64(mm[56:]) != 100 {
		t.Errorf("module list wrong: info %x memmap %x", info, mm)
	}
}

func FuzzParse(f *testing.F) {
	f.Add(fakeBzImage(4096))
	f.Add([]byte("\x7fELF\x02\x01\x01"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		img, err := Parse(data)
		if err != nil {
			return
		}
		for _, s := range img.Segments {
			if uint64(len(s.Data)) > s.MemLen || s.Addr+s.MemLen > img.End {
				t.Fatalf("segment %#x+%#x (%d bytes) exceeds image end %#x", s.Addr, s.MemLen, len(s.Data), img.End)
			}
		}
	})
}

// segmentBytes is a segment's file bytes: Data, or read from the file.
func segmentBytes(t *testing.T, s Segment, file []byte) []byte {
	t.Helper()
	if s.Data != nil {
		return s.Data
	}
	if s.FileOff+s.FileLen > uint64(len(file)) {
		t.Fatalf("segment at %#x names file bytes %#x+%#x past the file's %d", s.Addr, s.FileOff, s.FileLen, len(file))
	}
	return file[s.FileOff : s.FileOff+s.FileLen]
}

// checkSameImage fails unless ParseFile's image is Parse's, segment bytes
// included.
func checkSameImage(t *testing.T, data []byte, want, got *Image) {
	t.Helper()
	if got.Kind != want.Kind || got.Entry64 != want.Entry64 || got.PVHEntry != want.PVHEntry || got.End != want.End ||
		!bytes.Equal(got.Setup, want.Setup) || got.CmdlineSize != want.CmdlineSize || got.InitrdAddrMax != want.InitrdAddrMax ||
		len(got.Segments) != len(want.Segments) {
		t.Fatalf("ParseFile = %+v, Parse = %+v", got, want)
	}
	for i := range want.Segments {
		w, g := want.Segments[i], got.Segments[i]
		if g.Addr != w.Addr || g.MemLen != w.MemLen || g.FileBytes() != w.FileBytes() ||
			!bytes.Equal(segmentBytes(t, g, data), segmentBytes(t, w, data)) {
			t.Fatalf("segment %d: ParseFile %#x+%#x, Parse %#x+%#x, or different bytes", i, g.Addr, g.MemLen, w.Addr, w.MemLen)
		}
	}
}

func TestParseFileELFLeavesSegmentsInFile(t *testing.T) {
	data := fakeELF(t)
	img, err := ParseFile(bytes.NewReader(data), int64(len(data)))
	if err != nil {
		t.Fatal(err)
	}
	want, err := Parse(data)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range img.Segments {
		if s.Data != nil || s.FileLen == 0 {
			t.Errorf("segment at %#x: Data %d bytes, FileLen %d; want it left in the file", s.Addr, len(s.Data), s.FileLen)
		}
	}
	checkSameImage(t, data, want, img)
	if _, err := ParseFile(bytes.NewReader(data), int64(len(data))-1); err == nil {
		t.Error("ParseFile of a file cut short of its segments succeeded")
	}
	if _, err := ParseFile(bytes.NewReader(nil), -1); err == nil {
		t.Error("ParseFile of a negative size succeeded")
	}
	if _, err := ParseFile(bytes.NewReader(nil), maxImageSize+1); err == nil {
		t.Error("ParseFile over the size limit succeeded")
	}
}

// FuzzParseFile checks that ParseFile, which leaves an ELF's segments in the
// file, accepts exactly what Parse accepts and describes the same image.
func FuzzParseFile(f *testing.F) {
	f.Add(fakeBzImage(4096))
	f.Add([]byte("\x7fELF\x02\x01\x01"))
	f.Add([]byte{})
	f.Add(fakeELF(f))
	f.Fuzz(func(t *testing.T, data []byte) {
		want, werr := Parse(data)
		got, gerr := ParseFile(bytes.NewReader(data), int64(len(data)))
		if (werr == nil) != (gerr == nil) {
			t.Fatalf("Parse error %v, ParseFile error %v", werr, gerr)
		}
		if werr != nil {
			return
		}
		checkSameImage(t, data, want, got)
	})
}

// fakeELF builds a small ELF64 x86-64 kernel: two loadable segments (the
// second with a zero tail) and a note segment with the PVH entry note.
func fakeELF(t testing.TB) []byte {
	le := binary.LittleEndian
	const ehsz, phsz, nph = 64, 56, 3
	note := make([]byte, 12+4+4)
	le.PutUint32(note, 4) // namesz: "Xen\0"
	le.PutUint32(note[4:], 4)
	le.PutUint32(note[8:], xenElfNotePhys32Entry)
	copy(note[12:], "Xen\x00")
	le.PutUint32(note[16:], 0x1000040)
	seg1 := bytes.Repeat([]byte{0xa5}, 3000)
	seg2 := bytes.Repeat([]byte{0x5a}, 1000)
	off1 := uint64(ehsz + phsz*nph)
	off2 := off1 + uint64(len(seg1))
	offN := off2 + uint64(len(seg2))
	hdr := make([]byte, ehsz)
	copy(hdr, elf.ELFMAG)
	hdr[4], hdr[5], hdr[6] = byte(elf.ELFCLASS64), byte(elf.ELFDATA2LSB), byte(elf.EV_CURRENT)
	le.PutUint16(hdr[16:], uint16(elf.ET_EXEC))
	le.PutUint16(hdr[18:], uint16(elf.EM_X86_64))
	le.PutUint32(hdr[20:], uint32(elf.EV_CURRENT))
	le.PutUint64(hdr[24:], 0x1000000) // e_entry
	le.PutUint64(hdr[32:], ehsz)      // e_phoff
	le.PutUint16(hdr[52:], ehsz)
	le.PutUint16(hdr[54:], phsz)
	le.PutUint16(hdr[56:], nph)
	le.PutUint16(hdr[58:], 64) // e_shentsize, no sections
	ph := func(typ elf.ProgType, off, paddr, filesz, memsz uint64) []byte {
		p := make([]byte, phsz)
		le.PutUint32(p, uint32(typ))
		le.PutUint64(p[8:], off)
		le.PutUint64(p[16:], paddr|0xffffffff80000000)
		le.PutUint64(p[24:], paddr)
		le.PutUint64(p[32:], filesz)
		le.PutUint64(p[40:], memsz)
		return p
	}
	var b []byte
	b = append(b, hdr...)
	b = append(b, ph(elf.PT_LOAD, off1, 0x1000000, uint64(len(seg1)), uint64(len(seg1)))...)
	b = append(b, ph(elf.PT_LOAD, off2, 0x1200000, uint64(len(seg2)), 8192)...)
	b = append(b, ph(elf.PT_NOTE, offN, 0x1300000, uint64(len(note)), uint64(len(note)))...)
	b = append(b, seg1...)
	b = append(b, seg2...)
	b = append(b, note...)
	return b
}
