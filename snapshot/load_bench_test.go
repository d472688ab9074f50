package snapshot

import (
	"context"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/vmm"
)

// BenchmarkOpen measures the part of a restore before KVM (Load without
// vmm.Restore) for a snapshot of 256 MiB of guest memory holding 64 MiB
// of data: "file" maps the memory file as format 2 did (no digest, no
// copy), "sealed" checks the memory's digest while copying it into a
// sealed memfd (each restore), "cached" is a restore whose sealed copy a
// Cache already has (every clone after the first).
func BenchmarkOpen(b *testing.B) {
	const memMiB, dataMiB = 256, 64
	mem, err := memory.New("bench", memory.Layout{{GuestAddr: 0, Size: memMiB << 20}})
	if err != nil {
		b.Fatal(err)
	}
	defer mem.Close()
	host := mem.Host(0)
	for i := 0; i < dataMiB<<20; i += 8 {
		host[i] = byte(i>>12) | 1 // every page of the first 64 MiB has data
	}
	st := testState()
	st.MemoryMiB = memMiB
	st.Memory = []vmm.MemoryRegion{{GuestAddr: 0, Size: memMiB << 20}}
	dir := filepath.Join(b.TempDir(), "snap")
	if err := quietSaver(WithKey(testKey)).write(context.Background(), dir, st, mem); err != nil {
		b.Fatal(err)
	}
	cfg := testConfig()
	b.Run("file", func(b *testing.B) {
		for b.Loop() {
			d, err := openDir(dir)
			if err != nil {
				b.Fatal(err)
			}
			m, _, err := newConfig([]Option{WithKey(testKey)}).readManifest(d, true)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := readState(d, m); err != nil {
				b.Fatal(err)
			}
			f, err := openMemory(d, m)
			if err != nil {
				b.Fatal(err)
			}
			fd, _ := unix.Dup(int(f.Fd()))
			f.Close()
			d.Close()
			g, err := memory.MapFile(fd, st.Layout(), true)
			if err != nil {
				b.Fatal(err)
			}
			g.Close()
		}
	})
	for _, cached := range []bool{false, true} {
		name := "sealed"
		var opts []Option
		if cached {
			name = "cached"
			c := NewCache(0)
			defer c.Close()
			opts = append(opts, WithCache(c))
			_, g, err := openTest(dir, &cfg, opts...) // the first clone's copy
			if err != nil {
				b.Fatal(err)
			}
			g.Close()
		}
		b.Run(name, func(b *testing.B) {
			for b.Loop() {
				_, g, err := openTest(dir, &cfg, opts...)
				if err != nil {
					b.Fatal(err)
				}
				g.Close()
			}
			b.ReportMetric(float64(dataMiB), "MiB-data")
		})
	}
}
