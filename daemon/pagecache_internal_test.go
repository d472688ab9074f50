package daemon

import (
	"context"
	"os"
	"path/filepath"
	"testing"
)

// TestChargePageCache: the data of a sparse file is read, all of it (its
// holes are not, where the file system tells them apart), with or without
// dropping the cache first; a missing file and a
// cancelled context are errors.
func TestChargePageCache(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		name string
		size int64
		data []int64 // offsets of 64-KiB runs of data
		drop bool
	}{
		{"empty", 0, nil, false},
		{"all holes", 4 << 20, nil, true},
		{"sparse", 8 << 20, []int64{0, 3 << 20, 8<<20 - 64<<10}, false},
		{"sparse, dropped first", 8 << 20, []int64{1 << 20, 5 << 20}, true},
		{"dense, longer than a read", 3<<20 + 4096, []int64{}, true},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := filepath.Join(dir, "f"+string(rune('a'+i)))
			f, err := os.Create(p)
			if err != nil {
				t.Fatal(err)
			}
			run := make([]byte, 64<<10)
			for j := range run {
				run[j] = byte(j%251 + 1)
			}
			var want int64
			if tc.data == nil {
				f.Truncate(tc.size)
			} else if len(tc.data) == 0 { // dense
				for off := int64(0); off < tc.size; off += int64(len(run)) {
					n, _ := f.WriteAt(run[:min(int64(len(run)), tc.size-off)], off)
					want += int64(n)
				}
			} else {
				f.Truncate(tc.size)
				for _, off := range tc.data {
					f.WriteAt(run, off)
					want += int64(len(run))
				}
			}
			f.Sync()
			f.Close()
			got, err := chargePageCache(context.Background(), p, tc.drop)
			if err != nil {
				t.Fatal(err)
			}
			// A file system that cannot tell holes reads them all.
			if got != want && got != tc.size {
				t.Errorf("read %d bytes, want the %d of data (or all %d)", got, want, tc.size)
			}
		})
	}
	if _, err := chargePageCache(context.Background(), filepath.Join(dir, "missing"), false); !os.IsNotExist(err) {
		t.Errorf("missing file: %v, want not-exist", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	p := filepath.Join(dir, "c")
	os.WriteFile(p, make([]byte, 2<<20), 0o600)
	if _, err := chargePageCache(ctx, p, false); err != context.Canceled {
		t.Errorf("cancelled: %v, want context.Canceled", err)
	}
}
