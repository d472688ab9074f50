package memory

import (
	"bytes"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPrivateMappingHoles: a copy-on-write mapping of a sparse file reads
// as the file (data and zeros), and the guest's writes into the file's
// holes allocate nothing in the file (they go to anonymous memory), where
// they would otherwise bring a page of the file in for each page written;
// the holes' count is bounded; a freeze of such memory reads the same.
func TestPrivateMappingHoles(t *testing.T) {
	const size = 8 << 20
	tests := []struct {
		name  string
		data  []int64 // offsets of the file's 4-KiB pages of data
		holes int     // the holes mapped anonymous
	}{
		{"empty file", nil, 1},
		{"data at both ends", []int64{0, size - 4096}, 1},
		{"scattered", []int64{0, 1 << 20, 1<<20 + 8192, 5 << 20}, 2}, // those below 1 MiB and between its two pages are too small
		{"dense", func() (o []int64) {
			for p := int64(0); p < size; p += 4096 {
				o = append(o, p)
			}
			return o
		}(), 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			fd, err := unix.MemfdCreate("holes", unix.MFD_CLOEXEC)
			if err != nil {
				t.Fatal(err)
			}
			if err := unix.Ftruncate(fd, size); err != nil {
				t.Fatal(err)
			}
			want := make([]byte, size)
			for i, off := range tc.data {
				page := bytes.Repeat([]byte{byte(i%250 + 1)}, 4096)
				if _, err := unix.Pwrite(fd, page, off); err != nil {
					t.Fatal(err)
				}
				copy(want[off:], page)
			}
			keep, err := dup(fd)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(keep)
			m, err := MapFile(fd, Layout{{0, size}}, true)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if n, err := (&Memory{host: m.host, fd: keep}).anonHoles(); err != nil || n != tc.holes {
				t.Errorf("anonHoles = %d, %v; want %d", n, err, tc.holes)
			}
			got := make([]byte, size)
			if err := m.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				t.Fatal("the mapping does not read as the file")
			}
			var before unix.Stat_t
			unix.Fstat(keep, &before)
			// Write every page: the file keeps its blocks, no more.
			for off := int64(0); off < size; off += 4096 {
				want[off+7] = 0xee
				if err := m.WriteAt([]byte{0xee}, uint64(off+7)); err != nil {
					t.Fatal(err)
				}
			}
			var after unix.Stat_t
			unix.Fstat(keep, &after)
			if after.Blocks != before.Blocks {
				t.Errorf("the file's blocks: %d before the writes, %d after: the writes brought its holes in", before.Blocks, after.Blocks)
			}
			base, err := m.Freeze()
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(base)
			frozen := make([]byte, size)
			if _, err := unix.Pread(base, frozen, 0); err != nil {
				t.Fatal(err)
			}
			if err := m.ReadAt(got, 0); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(frozen, want) || !bytes.Equal(got, want) {
				t.Error("after a freeze, the base or the mapping does not hold what was written")
			}
		})
	}
}

// TestAnonHolesBounded: a file of more small-enough holes than
// maxAnonHoles gets at most that many mappings.
func TestAnonHolesBounded(t *testing.T) {
	const stride = minAnonHole + 4096
	size := int64(maxAnonHoles+8) * stride
	fd, err := unix.MemfdCreate("many-holes", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	for off := int64(minAnonHole); off < size; off += stride {
		if _, err := unix.Pwrite(fd, []byte{1}, off); err != nil {
			t.Fatal(err)
		}
	}
	m, err := MapFile(fd, Layout{{0, uint64(size)}}, true)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if n, err := m.anonHoles(); err != nil || n != maxAnonHoles {
		t.Errorf("anonHoles = %d, %v; want %d", n, err, maxAnonHoles)
	}
	b := make([]byte, 1)
	if err := m.ReadAt(b, uint64(size-stride+minAnonHole)); err != nil || b[0] != 1 {
		t.Errorf("last data page reads %v, %v; want 1", b, err)
	}
}
