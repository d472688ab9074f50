package memory

import (
	"bytes"
	"errors"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

func randomFile(t testing.TB, n int) (*os.File, []byte) {
	t.Helper()
	b := make([]byte, n)
	r := rand.New(rand.NewPCG(1, 2))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	p := filepath.Join(t.TempDir(), "image")
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f, b
}

// TestLoadFile: on the memfd's shared mapping (sendfile), on the mapping
// path, and on copy-on-write memory, the guest range holds the file's
// bytes, seen through the mapping and (where shared) the memfd, at an
// unaligned offset in the second region; the bytes around it stay zero.
// A short file or a range outside RAM is an error, not a panic.
func TestLoadFile(t *testing.T) {
	f, data := randomFile(t, 1<<20+123)
	const addr, off, n = 4<<20 + 4096 + 7, 99, 1<<20 + 5
	want := data[off : off+n]
	check := func(t *testing.T, m *Memory) {
		got, err := m.Slice(4<<20, 2<<20)
		if err != nil {
			t.Fatal(err)
		}
		lo := addr - 4<<20
		if !bytes.Equal(got[lo:lo+n], want) {
			t.Error("guest range differs from the file")
		}
		if bytes.ContainsFunc(got[:lo], func(r rune) bool { return r != 0 }) || bytes.ContainsFunc(got[lo+n:], func(r rune) bool { return r != 0 }) {
			t.Error("bytes around the range were written")
		}
	}
	for _, send := range []bool{true, false} {
		m, err := New("test", testLayout())
		if err != nil {
			t.Fatal(err)
		}
		if err := m.loadFile(f, off, addr, n, send); err != nil {
			t.Fatalf("send=%v: %v", send, err)
		}
		check(t, m)
		// The memfd holds it too (a snapshot reads the file).
		b := make([]byte, n)
		if _, err := unix.Pread(m.FD(), b, int64(1<<20+addr-4<<20)); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(b, want) {
			t.Errorf("send=%v: the memfd differs from the file", send)
		}
		m.Close()
	}
	t.Run("copy-on-write", func(t *testing.T) {
		base, err := New("test", testLayout())
		if err != nil {
			t.Fatal(err)
		}
		defer base.Close()
		fd, err := dup(base.FD())
		if err != nil {
			t.Fatal(err)
		}
		m, err := MapFile(fd, testLayout(), true)
		if err != nil {
			t.Fatal(err)
		}
		defer m.Close()
		if err := m.LoadFile(f, off, addr, n); err != nil {
			t.Fatal(err)
		}
		check(t, m)
		if got, _ := base.Slice(addr, 16); !bytes.Equal(got, make([]byte, 16)) {
			t.Error("a copy-on-write load reached the file")
		}
	})
	m, err := New("test", testLayout())
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	for _, send := range []bool{true, false} {
		if err := m.loadFile(f, int64(len(data)-10), 0, 4096, send); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Errorf("send=%v: a short file: %v, want ErrUnexpectedEOF", send, err)
		}
	}
	if err := m.LoadFile(f, 0, 1<<20-8, 16); !errors.Is(err, ErrOutOfRange) {
		t.Errorf("a range across a region's end: %v", err)
	}
	if err := m.LoadFile(f, -1, 0, 16); err == nil {
		t.Error("a negative file offset loaded")
	}
}

// BenchmarkLoadFile loads 32 MiB into fresh memory each time: sendfile
// into the memfd against populate-then-read into the mapping, from a
// dense file and from a sparse one (every other MiB a hole, as a
// vmlinux's .bss is).
func BenchmarkLoadFile(b *testing.B) {
	const n = 32 << 20
	dense, data := randomFile(b, n)
	p := filepath.Join(b.TempDir(), "sparse")
	w, err := os.Create(p)
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < n; i += 2 << 20 {
		if _, err := w.WriteAt(data[i:i+1<<20], int64(i)); err != nil {
			b.Fatal(err)
		}
	}
	if err := w.Truncate(n); err != nil {
		b.Fatal(err)
	}
	w.Close()
	sparse, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer sparse.Close()
	for _, tc := range []struct {
		name string
		f    *os.File
		send bool
	}{{"dense/sendfile", dense, true}, {"dense/populate-read", dense, false}, {"sparse/sendfile", sparse, true}, {"sparse/populate-read", sparse, false}} {
		b.Run(tc.name, func(b *testing.B) {
			b.SetBytes(n)
			for b.Loop() {
				m, err := New("bench", Layout{{0, n}})
				if err != nil {
					b.Fatal(err)
				}
				if err := m.loadFile(tc.f, 0, 0, n, tc.send); err != nil {
					b.Fatal(err)
				}
				m.Close()
			}
		})
	}
}

// TestLoadFileHoles: a sparse file's holes (in the middle, and at its end
// before the size) arrive as zeros, over memory that held other bytes,
// and the memfd allocates no page for a whole-page hole. A file that ends
// inside the range is still an error.
func TestLoadFileHoles(t *testing.T) {
	const page = 4096
	p := filepath.Join(t.TempDir(), "sparse")
	w, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	want := make([]byte, 64*page)
	r := rand.New(rand.NewPCG(3, 4))
	for _, ext := range [][2]int{{0, 3*page + 100}, {40 * page, 41*page + 9}} {
		for i := ext[0]; i < ext[1]; i++ {
			want[i] = byte(r.Uint32() | 1)
		}
		if _, err := w.WriteAt(want[ext[0]:ext[1]], int64(ext[0])); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Truncate(int64(len(want))); err != nil {
		t.Fatal(err)
	}
	w.Close()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if d, err := unix.Seek(int(f.Fd()), 8*page, unix.SEEK_DATA); err != nil || d != 40*page {
		t.Skipf("this file system reports no holes (SEEK_DATA from 8 pages: %d, %v)", d, err)
	}
	for _, send := range []bool{true, false} {
		m, err := New("test", Layout{{0, 1 << 20}})
		if err != nil {
			t.Fatal(err)
		}
		dst, _ := m.Slice(0, 1<<20)
		for i := range dst {
			dst[i] = 0xAA // what an earlier user left
		}
		if err := m.loadFile(f, 0, page, uint64(len(want)), send); err != nil {
			t.Fatalf("send=%v: %v", send, err)
		}
		if !bytes.Equal(dst[page:page+len(want)], want) {
			t.Errorf("send=%v: guest range differs from the sparse file", send)
		}
		if dst[page-1] != 0xAA || dst[page+len(want)] != 0xAA {
			t.Errorf("send=%v: bytes around the range were written", send)
		}
		m.Close()
	}
	// Allocation: a fresh memfd in 4 KiB pages gets pages for the data
	// only (in huge pages, where the host gives them, the mapping path
	// fills whole 2 MiB pages instead).
	m, err := New("test", Layout{{0, 1 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	m.huge = false
	if err := m.LoadFile(f, 0, 0, uint64(len(want))); err != nil {
		t.Fatal(err)
	}
	if d, err := unix.Seek(m.FD(), 4*page, unix.SEEK_DATA); err != nil || d != 40*page {
		t.Errorf("the memfd's next data after 4 pages is at %d (%v), want %d: a hole was allocated", d, err, 40*page)
	}
	if err := m.LoadFile(f, 60*page, 0, 8*page); !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Errorf("a range past the sparse file's end: %v, want ErrUnexpectedEOF", err)
	}
}
