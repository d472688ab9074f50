package linuxboot

import (
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
