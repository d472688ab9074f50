package memory

import (
	"bytes"
	"fmt"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// cowLayout has a region below and one above a gap, laid one after the
// other in the file (region 1 at file offset 6 MiB) and both crossing
// freezeWindow boundaries.
var cowLayout = Layout{{0, 6 << 20}, {1 << 32, 5 << 20}}

const cowTotal = 11 << 20

// cowFileData is what the backing file holds, as [start, end) file ranges
// (the rest are holes); zeroData is a page written with zeros (data to
// SEEK_DATA, zeros to read).
var cowFileData = [][2]int64{
	{0, 64 << 10},
	{1 << 20, 1<<20 + 256<<10},
	{4<<20 - 100<<10, 4<<20 + 200<<10}, // crosses a window boundary
	{7 << 20, 8 << 20},                 // in region 1
	{cowTotal - pageSize, cowTotal},    // the last page
}

const zeroData = 2 << 20

// pattern returns a page's worth of bytes, none zero, that tell page off
// and generation gen apart.
func pattern(off int64, gen byte) []byte {
	b := make([]byte, pageSize)
	for i := range b {
		b[i] = byte(off/pageSize*31+int64(i)*7+int64(gen)*13)%251 + 1
	}
	return b
}

// newBacking makes the file a restored VM's memory is mapped from: a memfd
// (an earlier base), a file on disk (a snapshot's memory file), or a memfd
// that holds zeros as data in every page but the data ones (as a file on a
// file system that cannot tell holes, such as 9p, looks). It returns the fd
// and the file's contents.
func newBacking(t testing.TB, kind string, size int64, data [][2]int64, zeroPages ...int64) (int, []byte) {
	t.Helper()
	var fd int
	var err error
	switch kind {
	case "memfd", "zero-filled memfd":
		fd, err = unix.MemfdCreate("kiln-test-backing", unix.MFD_CLOEXEC)
	case "disk file":
		fd, err = unix.Open(filepath.Join(t.TempDir(), "mem"), unix.O_RDWR|unix.O_CREAT|unix.O_CLOEXEC, 0o600)
	default:
		t.Fatalf("unknown backing %q", kind)
	}
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	content := make([]byte, size)
	if kind == "zero-filled memfd" {
		if err := pwriteAll(fd, content, 0); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range data {
		for off := d[0]; off < d[1]; off += pageSize {
			copy(content[off:], pattern(off, 0))
		}
		if err := pwriteAll(fd, content[d[0]:d[1]], d[0]); err != nil {
			t.Fatal(err)
		}
	}
	for _, off := range zeroPages {
		if err := pwriteAll(fd, zeroPage[:], off); err != nil {
			t.Fatal(err)
		}
	}
	return fd, content
}

// dataPages returns the file offsets of the pages SEEK_DATA counts as data.
func dataPages(t *testing.T, fd int, size int64) map[int64]bool {
	t.Helper()
	pages := map[int64]bool{}
	for off := int64(0); off < size; {
		start, err := unix.Seek(fd, off, unix.SEEK_DATA)
		if err == unix.ENXIO {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		end, err := unix.Seek(fd, start, unix.SEEK_HOLE)
		if err != nil {
			t.Fatal(err)
		}
		for p := start &^ (pageSize - 1); p < end && p < size; p += pageSize {
			pages[p] = true
		}
		off = end
	}
	return pages
}

func readFile(t *testing.T, fd int, size int64) []byte {
	t.Helper()
	b := make([]byte, size)
	for got := int64(0); got < size; {
		n, err := unix.Pread(fd, b[got:], got)
		if err != nil || n == 0 {
			t.Fatalf("read the base at %#x: n=%d, %v", got, n, err)
		}
		got += int64(n)
	}
	return b
}

// guestOp is an access to one page of guest memory, named by the page's
// file offset.
type guestOp struct {
	off  int64  // file offset (region offset + offset in region)
	kind string // "write", "zero", "partial", "read", "drop" (write, then MADV_DONTNEED)
}

// apply does op to m through guest addresses, and to the model of what the
// guest sees. It returns whether the page ends up anonymous.
func apply(t *testing.T, m *Memory, model, file []byte, op guestOp, gen byte) bool {
	t.Helper()
	var addr uint64
	for _, r := range m.Regions() {
		if uint64(op.off) >= r.Offset && uint64(op.off) < r.Offset+r.Size {
			addr = r.GuestAddr + uint64(op.off) - r.Offset
		}
	}
	page := model[op.off : op.off+pageSize]
	switch op.kind {
	case "write", "drop":
		p := pattern(op.off, gen)
		if err := m.WriteAt(p, addr); err != nil {
			t.Fatal(err)
		}
		copy(page, p)
		if op.kind == "write" {
			return true
		}
		if err := unix.Madvise(m.host[op.off:op.off+pageSize], unix.MADV_DONTNEED); err != nil {
			t.Fatal(err)
		}
		// What the guest sees again is the file's page.
		copy(page, file[op.off:op.off+pageSize])
		return false
	case "zero":
		if err := m.WriteAt(zeroPage[:], addr); err != nil {
			t.Fatal(err)
		}
		clear(page)
		return true
	case "partial":
		msg := []byte(fmt.Sprintf("guest wrote %#x gen %d", op.off, gen))
		if err := m.WriteAt(msg, addr+100); err != nil {
			t.Fatal(err)
		}
		copy(page[100:], msg)
		return true
	case "read":
		got := make([]byte, pageSize)
		if err := m.ReadAt(got, addr); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, page) {
			t.Fatalf("guest reads page %#x unlike the model", op.off)
		}
		return false
	}
	t.Fatalf("unknown op %q", op.kind)
	return false
}

// track records in anon whether op left its page anonymous; a read leaves
// it as it was.
func track(anon map[int64]bool, op guestOp, isAnon bool) {
	switch {
	case op.kind == "read":
	case isAnon:
		anon[op.off] = true
	default:
		delete(anon, op.off)
	}
}

// anonHoleRanges are the holes of fd that a private mapping maps
// anonymous (anonHoles), as [start, end) pairs.
func anonHoleRanges(t *testing.T, fd int, size int64) [][2]int64 {
	t.Helper()
	var out [][2]int64
	e := &extents{fd: fd, size: size}
	for off := int64(0); off < size; {
		start, stop, err := e.within(off, size)
		if err != nil {
			t.Fatal(err)
		}
		if start == stop {
			start, stop = size, size
		}
		if start-off >= minAnonHole {
			out = append(out, [2]int64{off, start})
		}
		off = stop
	}
	return out
}

// readHole counts a read of a page in an anonymous hole as one the freeze
// reads from the mapping: it maps the zero page, anonymous (and is found
// all zeros, a hole in the base).
func readHole(anon map[int64]bool, op guestOp, holes [][2]int64) {
	if op.kind != "read" {
		return
	}
	for _, h := range holes {
		if op.off >= h[0] && op.off < h[1] {
			anon[op.off] = true
		}
	}
}

// checkBase checks that base holds exactly model and that its zero pages
// are holes.
func checkBase(t *testing.T, base int, model []byte) {
	t.Helper()
	size := int64(len(model))
	var st unix.Stat_t
	if err := unix.Fstat(base, &st); err != nil {
		t.Fatal(err)
	}
	if st.Size != size {
		t.Fatalf("base is %d bytes, want %d", st.Size, size)
	}
	got := readFile(t, base, size)
	for off := int64(0); off < size; off += pageSize {
		if !bytes.Equal(got[off:off+pageSize], model[off:off+pageSize]) {
			t.Fatalf("base page %#x differs from guest memory", off)
		}
	}
	data := dataPages(t, base, size)
	for off := int64(0); off < size; off += pageSize {
		if data[off] && bytes.Equal(model[off:off+pageSize], zeroPage[:]) {
			t.Errorf("zero page %#x of the base is allocated", off)
		}
	}
	if st.Blocks*512 > int64(len(data))*pageSize {
		t.Errorf("base allocates %d bytes, more than its %d data pages", st.Blocks*512, len(data))
	}
}

// cowOps are the first round of guest accesses of a restored VM.
var cowOps = []guestOp{
	{5 << 20, "write"},                 // over a hole in the file
	{1<<20 + 4096, "partial"},          // over file data: the rest stays the file's
	{8192, "zero"},                     // zeros over file data: a hole in the base
	{5<<20 + 3*4096, "zero"},           // zeros over a hole: still a hole
	{1<<20 + 5*4096, "drop"},           // written, then dropped: the file's again
	{3 << 20, "drop"},                  // the same over a hole
	{1<<20 + 8*4096, "read"},           // read only: a file page
	{5<<20 + 8*4096, "read"},           // a read hole
	{4<<20 - 2*4096, "write"},          // a run across a window boundary
	{4<<20 - 1*4096, "write"},          //
	{4 << 20, "write"},                 //
	{4<<20 + 4096, "zero"},             // and a zero page ending it
	{6<<20 - 4096, "write"},            // the last page of region 0 and
	{6 << 20, "write"},                 // the first of region 1, next in the host
	{7<<20 + 4096, "write"},            // over file data in region 1
	{cowTotal - pageSize, "partial"},   // the last page
	{zeroData, "read"},                 // the file's zero data page
	{cowTotal - 2*pageSize, "partial"}, // the page before it, a hole
}

// cowOps2 are what the VM does after its first freeze.
var cowOps2 = []guestOp{
	{5 << 20, "write"},        // over what it wrote before
	{7<<20 + 4096, "zero"},    // zeros over the first base's data
	{64 << 10, "write"},       // over a hole in both
	{1<<20 + 4096, "drop"},    // dropped: the first base's page again
	{9 << 20, "partial"},      // over a hole
	{4<<20 + 8192, "partial"}, // over the first base's data
}

func TestFreezeCopyOnWrite(t *testing.T) {
	for _, tc := range []struct {
		backing string
		opts    freezeOptions
	}{
		{"memfd", freezeOptions{}},
		{"memfd", freezeOptions{noPagemap: true}},
		{"disk file", freezeOptions{}},
		{"disk file", freezeOptions{noPagemap: true}},
		{"zero-filled memfd", freezeOptions{}},
		{"zero-filled memfd", freezeOptions{noPagemap: true}},
	} {
		t.Run(fmt.Sprintf("%s/%+v", tc.backing, tc.opts), func(t *testing.T) {
			fd, file := newBacking(t, tc.backing, cowTotal, cowFileData, zeroData)
			m, err := MapFile(fd, cowLayout, true)
			if err != nil {
				unix.Close(fd)
				t.Fatal(err)
			}
			defer m.Close()
			model := bytes.Clone(file)
			anon := map[int64]bool{}
			holes := anonHoleRanges(t, fd, cowTotal)
			for _, op := range cowOps {
				track(anon, op, apply(t, m, model, file, op, 1))
				readHole(anon, op, holes)
			}
			fileData := len(dataPages(t, fd, cowTotal))
			base, st, err := m.freeze(tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(base)
			t.Logf("first freeze: %+v", st)
			checkBase(t, base, model)
			checkStats(t, st, tc.opts, len(anon), fileData)

			// Frozen again: private over the first base, a memfd.
			model1 := bytes.Clone(model)
			anon = map[int64]bool{}
			holes = anonHoleRanges(t, base, cowTotal)
			for _, op := range cowOps2 {
				track(anon, op, apply(t, m, model, model1, op, 2))
				readHole(anon, op, holes)
			}
			fileData = len(dataPages(t, base, cowTotal))
			base2, st, err := m.freeze(tc.opts)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(base2)
			t.Logf("second freeze: %+v", st)
			checkBase(t, base2, model)
			checkStats(t, st, tc.opts, len(anon), fileData)
			if got := readFile(t, base, cowTotal); !bytes.Equal(got, model1) {
				t.Fatal("the first base changed")
			}

			// A fork of the second base sees it all.
			child, err := MapFile(base2, cowLayout, true)
			if err != nil {
				t.Fatal(err)
			}
			base2 = -1 // the child owns it
			defer child.Close()
			if !bytes.Equal(child.host, model) {
				t.Fatal("a fork of the second base reads unlike the memory frozen")
			}
			// (Last: reading holes of a shared memfd through a private
			// mapping allocates them.)
			if !bytes.Equal(m.host, model) {
				t.Fatal("the frozen memory reads unlike what it held")
			}
		})
	}
}

// checkStats checks that a freeze read from the mapping only the pages the
// guest wrote (anon of them) and from the file only its data (fileData
// pages).
func checkStats(t *testing.T, st freezeStats, opts freezeOptions, anon, fileData int) {
	t.Helper()
	if st.pagemap == opts.noPagemap {
		t.Errorf("pagemap used: %v, want %v", st.pagemap, !opts.noPagemap)
	}
	if opts.noPagemap {
		if st.scanned != cowTotal {
			t.Errorf("the full scan read %d bytes, want %d", st.scanned, cowTotal)
		}
		return
	}
	if st.scanned != int64(anon)*pageSize {
		t.Errorf("read %d bytes of the mapping, want the %d pages the guest wrote", st.scanned, anon)
	}
	if st.fileRead != int64(fileData)*pageSize {
		t.Errorf("read %d bytes of the file, want its %d pages of data", st.fileRead, fileData)
	}
}

func TestFreezeAnonymous(t *testing.T) {
	for _, opts := range []freezeOptions{{}, {noPagemap: true}} {
		t.Run(fmt.Sprintf("%+v", opts), func(t *testing.T) {
			m, err := NewAnonymous(cowLayout)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			model := make([]byte, cowTotal)
			touched := 0
			for _, op := range []guestOp{
				{0, "write"},
				{4096, "zero"},
				{4<<20 - 4096, "write"},
				{4 << 20, "partial"},
				{6<<20 - 4096, "write"},
				{6 << 20, "write"},
				{8 << 20, "read"},
				{9 << 20, "drop"},
				{cowTotal - pageSize, "partial"},
			} {
				apply(t, m, model, make([]byte, cowTotal), op, 1)
				if op.kind != "drop" {
					touched++
				}
			}
			base, st, err := m.freeze(opts)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(base)
			t.Logf("freeze: %+v", st)
			checkBase(t, base, model)
			if st.pagemap == opts.noPagemap {
				t.Errorf("pagemap used: %v, want %v", st.pagemap, !opts.noPagemap)
			}
			switch {
			case opts.noPagemap && st.scanned != cowTotal:
				t.Errorf("the full scan read %d bytes, want %d", st.scanned, cowTotal)
			case !opts.noPagemap && st.scanned > int64(touched)*pageSize:
				t.Errorf("read %d bytes of the mapping, more than the %d pages touched", st.scanned, touched)
			}
			if st.fromFile != 0 {
				t.Errorf("copied %d bytes from a file anonymous memory does not have", st.fromFile)
			}
		})
	}
}

// FuzzFreeze checks that whatever a guest does to memory restored from a
// file, freezing it twice yields bases that hold exactly what the guest saw.
// Each input byte pair is an access: the page (low 6 bits of the first) and
// what is done to it.
func FuzzFreeze(f *testing.F) {
	f.Add([]byte{0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 0xff, 0})
	f.Add([]byte{5, 0, 6, 0, 7, 0, 8, 0, 9, 3, 0x80, 0, 5, 1, 6, 4})
	f.Add([]byte{63, 2, 62, 0, 0x80, 0, 63, 3, 31, 0, 32, 0})
	kinds := []string{"write", "zero", "partial", "read", "drop"}
	layout := Layout{{0, 32 * pageSize}, {1 << 30, 32 * pageSize}}
	const size = 64 * pageSize
	f.Fuzz(func(t *testing.T, in []byte) {
		// The file holds data in every third page and zero data at page 10.
		var data [][2]int64
		for p := int64(0); p < 64; p += 3 {
			data = append(data, [2]int64{p * pageSize, (p + 1) * pageSize})
		}
		fd, file := newBacking(t, "memfd", size, data, 10*pageSize)
		m, err := MapFile(fd, layout, true)
		if err != nil {
			unix.Close(fd)
			t.Fatal(err)
		}
		defer m.Close()
		model := bytes.Clone(file)
		under := bytes.Clone(file) // what the mapping is over
		gen := byte(1)
		for i := 0; i+1 < len(in); i += 2 {
			if in[i]&0x80 != 0 {
				base, err := m.Freeze()
				if err != nil {
					t.Fatal(err)
				}
				if got := readFile(t, base, size); !bytes.Equal(got, model) {
					unix.Close(base)
					t.Fatal("the base differs from guest memory")
				}
				unix.Close(base)
				under = bytes.Clone(model)
				gen++
				continue
			}
			op := guestOp{off: int64(in[i]&63) * pageSize, kind: kinds[int(in[i+1])%len(kinds)]}
			apply(t, m, model, under, op, gen)
		}
		base, err := m.Freeze()
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(base)
		if got := readFile(t, base, size); !bytes.Equal(got, model) {
			t.Fatal("the base differs from guest memory")
		}
	})
}
