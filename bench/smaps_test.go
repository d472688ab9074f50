package bench

import (
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

const smapsFixture = `00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/kiln
Size:                328 kB
Rss:                 300 kB
Pss:                 300 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me dw
7f0000000000-7f0000100000 rw-p 00000000 00:01 2049        /memfd:kiln-guest-ram-base (deleted)
Size:               1024 kB
KernelPageSize:        4 kB
Rss:                 512 kB
Pss:                 128 kB
Pss_Dirty:           128 kB
Shared_Clean:          0 kB
Shared_Dirty:        448 kB
Private_Clean:         0 kB
Private_Dirty:        64 kB
Anonymous:            64 kB
THPeligible:    0
VmFlags: rd wr mr mw me ac sd
7f0000100000-7f0000200000 rw-p 00100000 00:01 2049        /memfd:kiln-guest-ram-base (deleted)
Size:               1024 kB
Rss:                  16 kB
Pss:                   8 kB
Shared_Dirty:         16 kB
Anonymous:             0 kB
VmFlags: rd wr mr mw me ac sd
7fff00000000-7fff00021000 rw-p 00000000 00:00 0           [stack]
Rss:                  12 kB
Pss:                  12 kB
`

func TestParseSmapsRange(t *testing.T) {
	u, err := parseSmapsRange(strings.NewReader(smapsFixture), 0x7f0000000000, 0x7f0000200000)
	if err != nil {
		t.Fatal(err)
	}
	want := MemUsage{Rss: 528 << 10, Pss: 136 << 10, SharedDirty: 464 << 10, PrivateDirty: 64 << 10, Anonymous: 64 << 10, Mappings: 2}
	if u != want {
		t.Errorf("got %+v\nwant %+v", u, want)
	}
	if _, err := parseSmapsRange(strings.NewReader(smapsFixture), 0x7f0000000000, 0x7f0000180000); err == nil || !strings.Contains(err.Error(), "straddles") {
		t.Errorf("a range ending inside a mapping: %v", err)
	}
	if _, err := parseSmapsRange(strings.NewReader(smapsFixture), 0x1000, 0x2000); err == nil {
		t.Error("a range with no mapping gave no error")
	}
	bad := strings.Replace(smapsFixture, "Pss:                 128 kB", "Pss:                 12x kB", 1)
	if _, err := parseSmapsRange(strings.NewReader(bad), 0x7f0000000000, 0x7f0000200000); err == nil {
		t.Error("a malformed figure gave no error")
	}
}

func TestSmapsHeader(t *testing.T) {
	for _, tt := range []struct {
		line   string
		lo, hi uint64
		ok     bool
	}{
		{"7f00-7f80 rw-p 00000000 00:01 12 /memfd:x", 0x7f00, 0x7f80, true},
		{"00400000-00452000 r-xp 00000000 08:02 173521", 0x400000, 0x452000, true},
		{"Rss:                 300 kB", 0, 0, false},
		{"VmFlags: rd ex mr mw me dw", 0, 0, false},
		{"7f80-7f00 rw-p 0 0:0 0", 0, 0, false},
		{"", 0, 0, false},
	} {
		lo, hi, ok := smapsHeader(tt.line)
		if lo != tt.lo || hi != tt.hi || ok != tt.ok {
			t.Errorf("smapsHeader(%q) = %x, %x, %v", tt.line, lo, hi, ok)
		}
	}
}

// TestRangeUsageSharedMemfd maps one memfd twice, shared, and touches
// every page through both: each mapping's PSS is half its RSS. A third,
// private mapping writes half its pages: those are its own (anonymous).
func TestRangeUsageSharedMemfd(t *testing.T) {
	const size = 1 << 20
	fd, err := unix.MemfdCreate("kiln-bench-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	var maps [][]byte
	for _, flags := range []int{unix.MAP_SHARED, unix.MAP_SHARED, unix.MAP_PRIVATE} {
		m, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, flags)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(m)
		maps = append(maps, m)
	}
	var sum int
	for off := 0; off < size; off += 4096 {
		maps[0][off] = 1
		sum += int(maps[1][off]) // a read maps the page
	}
	if sum != size/4096 {
		t.Fatalf("read %d through the second mapping", sum)
	}
	for off := 0; off < size/2; off += 4096 {
		maps[2][off] = 2
	}
	usage := func(m []byte) MemUsage {
		t.Helper()
		u, err := RangeUsage(sliceAddr(m), uint64(len(m)))
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	a, priv := usage(maps[0]), usage(maps[2])
	if a.Rss != size || a.Mappings != 1 {
		t.Errorf("shared mapping: %+v, want RSS %d in one mapping", a, size)
	}
	// The private mapping maps only the pages it wrote (its copies), so
	// the shared ones have two mappers.
	if a.Pss < size/2 || a.Pss > size*3/4+4096 {
		t.Errorf("shared mapping: PSS %d, want about half of %d", a.Pss, size)
	}
	if priv.Anonymous != size/2 || priv.Rss != size/2 || priv.Pss != size/2 {
		t.Errorf("private mapping: %+v, want %d anonymous, all its own", priv, size/2)
	}
	if s := a.String(); !strings.Contains(s, "RSS 1.0 MiB") {
		t.Errorf("String() = %q", s)
	}
}
