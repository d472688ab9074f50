package memory

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestLoadFileHugeTakesMapping: where pages made through the mapping are
// huge, LoadFile writes through the mapping (populating the whole range,
// holes too) rather than sendfile's 4 KiB pages, with the same bytes.
func TestLoadFileHugeTakesMapping(t *testing.T) {
	data := bytes.Repeat([]byte("kiln"), 16<<10) // 64 KiB
	path := filepath.Join(t.TempDir(), "kernel")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, 1<<20); err != nil { // a 960 KiB hole after the data
		t.Fatal(err)
	}
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	m, err := New("test", Layout{{0, 4 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	m.huge = true
	if err := m.LoadFile(f, 0, 1<<20, 1<<20); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 1<<20)
	if err := m.ReadAt(got, 1<<20); err != nil || !bytes.Equal(got[:len(data)], data) || !bytes.Equal(got[len(data):], make([]byte, 1<<20-len(data))) {
		t.Fatalf("loaded range differs from the file (%v)", err)
	}
	// The hole's pages were made (populated through the mapping), which
	// sendfile's path leaves as a hole.
	if d, err := unix.Seek(m.FD(), 1<<20+int64(len(data)), unix.SEEK_DATA); err != nil || d != 1<<20+int64(len(data)) {
		t.Errorf("memfd data after the file's data at %d (%v): the mapping path was not taken", d, err)
	}
}
