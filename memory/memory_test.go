package memory

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func testLayout() Layout {
	return Layout{{0, 1 << 20}, {4 << 20, 2 << 20}}
}

func TestSliceBounds(t *testing.T) {
	m, err := New("test", testLayout())
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	tests := []struct {
		name    string
		addr, n uint64
		ok      bool
	}{
		{"start", 0, 16, true},
		{"end of first region", 1<<20 - 16, 16, true},
		{"crosses region end", 1<<20 - 8, 16, false},
		{"hole", 2 << 20, 1, false},
		{"second region", 4 << 20, 2 << 20, true},
		{"past the end", 6 << 20, 1, false},
		{"overflowing length", 4 << 20, ^uint64(0), false},
		{"huge address", ^uint64(0), 1, false},
	}
	for _, tt := range tests {
		_, err := m.Slice(tt.addr, tt.n)
		if (err == nil) != tt.ok {
			t.Errorf("%s: Slice(%#x, %#x) err = %v, want ok=%v", tt.name, tt.addr, tt.n, err, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrOutOfRange) {
			t.Errorf("%s: error %v does not wrap ErrOutOfRange", tt.name, err)
		}
	}
}

func TestReadWriteRoundTrip(t *testing.T) {
	for _, mk := range []func(Layout) (*Memory, error){
		func(l Layout) (*Memory, error) { return New("rt", l) },
		NewAnonymous,
	} {
		m, err := mk(testLayout())
		if err != nil {
			t.Fatal(err)
		}
		want := []byte("kiln guest memory")
		if err := m.WriteAt(want, 4<<20+100); err != nil {
			t.Fatal(err)
		}
		got := make([]byte, len(want))
		if err := m.ReadAt(got, 4<<20+100); err != nil {
			t.Fatal(err)
		}
		if string(got) != string(want) {
			t.Errorf("read back %q, want %q", got, want)
		}
		if m.Size() != 3<<20 {
			t.Errorf("Size = %d", m.Size())
		}
		m.Close()
	}
}

func TestLayoutErrors(t *testing.T) {
	tests := []struct {
		name string
		l    Layout
	}{
		{"empty", Layout{}},
		{"zero size", Layout{{0, 0}}},
		{"unaligned", Layout{{0, 100}}},
		{"overlap", Layout{{0, 2 << 20}, {1 << 20, 1 << 20}}},
		{"wraps", Layout{{^uint64(0) &^ 4095, 8192}}},
	}
	for _, tt := range tests {
		if _, err := NewAnonymous(tt.l); err == nil {
			t.Errorf("%s: no error", tt.name)
		}
	}
}

func TestPrivateMappingDoesNotWriteFile(t *testing.T) {
	m, err := New("base", Layout{{0, 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.WriteAt([]byte{1}, 0); err != nil {
		t.Fatal(err)
	}
	fd, err := dup(m.FD())
	if err != nil {
		t.Fatal(err)
	}
	c, err := MapFile(fd, Layout{{0, 1 << 20}}, true)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	b := make([]byte, 1)
	c.ReadAt(b, 0)
	if b[0] != 1 {
		t.Fatalf("private mapping reads %d, want the file's 1", b[0])
	}
	c.WriteAt([]byte{2}, 0)
	m.ReadAt(b, 0)
	if b[0] != 1 {
		t.Fatalf("a copy-on-write mapping's write reached the file: %d", b[0])
	}
}

// TestPopulate: Populate makes a range's pages resident (where the kernel
// has MADV_POPULATE_WRITE), keeps what they hold, widens an unaligned range
// to whole pages, and refuses a range outside one region as Slice does.
func TestPopulate(t *testing.T) {
	m, err := New("test", testLayout())
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.WriteAt([]byte("kept"), 4<<20+100); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		addr, n uint64
		ok      bool
	}{
		{"unaligned inside the first region", 10, 3 * 4096, true},
		{"whole second region", 4 << 20, 2 << 20, true},
		{"empty", 8192, 0, true},
		{"crosses region end", 1<<20 - 8, 16, false},
		{"hole", 2 << 20, 1, false},
		{"overflowing length", 4 << 20, ^uint64(0), false},
	}
	for _, tt := range tests {
		err := m.Populate(tt.addr, tt.n)
		if (err == nil) != tt.ok {
			t.Errorf("%s: Populate(%#x, %#x) err = %v, want ok=%v", tt.name, tt.addr, tt.n, err, tt.ok)
		}
		if err != nil && !errors.Is(err, ErrOutOfRange) {
			t.Errorf("%s: error %v does not wrap ErrOutOfRange", tt.name, err)
		}
	}
	got := make([]byte, 4)
	if err := m.ReadAt(got, 4<<20+100); err != nil || string(got) != "kept" {
		t.Errorf("after Populate the memory holds %q, %v; want what was written", got, err)
	}
	// The memfd's allocated blocks tell the pages allocated behind it.
	var st unix.Stat_t
	if err := unix.Fstat(m.fd, &st); err != nil {
		t.Fatal(err)
	}
	s, _ := m.Slice(4<<20, 2<<20)
	supported := !errors.Is(unix.Madvise(s, unix.MADV_POPULATE_WRITE), unix.EINVAL)
	if allocated := st.Blocks * 512; supported && allocated < 2<<20+3*4096 {
		t.Errorf("%d bytes allocated behind the memory after Populate, want at least the %d populated", allocated, 2<<20+3*4096)
	}
}

// TestHugePageAdvice: a fresh guest RAM's mapping is advised
// MADV_HUGEPAGE (smaps shows "hg" among its VmFlags) where the kernel has
// transparent huge pages, and a copy-on-write mapping of a saved file is
// not (a clone's written pages stay small).
func TestHugePageAdvice(t *testing.T) {
	if _, err := os.Stat("/sys/kernel/mm/transparent_hugepage"); err != nil {
		t.Skip("kernel without transparent huge pages:", err)
	}
	fresh, err := New("test", testLayout())
	if err != nil {
		t.Fatal(err)
	}
	defer fresh.Close()
	if flags := vmFlags(t, fresh.hostStart()); !slices.Contains(flags, "hg") {
		t.Errorf("fresh guest RAM VmFlags %v, want hg (MADV_HUGEPAGE)", flags)
	}
	fd, err := dup(fresh.fd)
	if err != nil {
		t.Fatal(err)
	}
	clone, err := MapFile(fd, testLayout(), true)
	if err != nil {
		t.Fatal(err)
	}
	defer clone.Close()
	if flags := vmFlags(t, clone.hostStart()); slices.Contains(flags, "hg") {
		t.Errorf("copy-on-write guest RAM VmFlags %v, want no hg", flags)
	}
}

// vmFlags returns the VmFlags of this process's mapping that starts at addr.
func vmFlags(t *testing.T, addr uintptr) []string {
	t.Helper()
	b, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		t.Fatal(err)
	}
	head := fmt.Sprintf("%x-", addr)
	in := false
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, head) {
			in = true
		}
		if in && strings.HasPrefix(line, "VmFlags:") {
			return strings.Fields(strings.TrimPrefix(line, "VmFlags:"))
		}
	}
	t.Fatalf("no mapping at %#x in /proc/self/smaps", addr)
	return nil
}
