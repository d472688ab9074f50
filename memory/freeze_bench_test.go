package memory

import (
	"math/rand/v2"
	"testing"

	"golang.org/x/sys/unix"
)

// BenchmarkFreeze freezes a 512 MiB guest restored from a file (a template
// snapshot's memory file on disk, or an earlier base memfd) that holds data
// in a quarter of its pages, after the guest wrote 5% of its pages.
func BenchmarkFreeze(b *testing.B) {
	const (
		size    = 512 << 20
		pages   = size / pageSize
		extent  = 64 // pages in each of the file's data extents
		written = pages / 20
	)
	layout := Layout{{0, 256 << 20}, {1 << 32, 256 << 20}}
	// Data in one 64-page extent out of every four, wherever the guest
	// left it.
	rng := rand.New(rand.NewPCG(1, 2))
	var data [][2]int64
	for p := int64(0); p < pages; p += 4 * extent {
		start := p + rng.Int64N(3*extent)
		data = append(data, [2]int64{start * pageSize, (start + extent) * pageSize})
	}
	writes := rng.Perm(pages)[:written]
	for _, bc := range []struct {
		name    string
		backing string
		opts    freezeOptions
	}{
		{"disk file/pagemap", "disk file", freezeOptions{}},
		{"disk file/full scan", "disk file", freezeOptions{noPagemap: true}},
		{"memfd/pagemap", "memfd", freezeOptions{}},
		{"memfd/full scan", "memfd", freezeOptions{noPagemap: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			var file int = -1
			defer func() {
				if file >= 0 {
					unix.Close(file)
				}
			}()
			var st freezeStats
			for range b.N {
				b.StopTimer()
				// A memfd's holes fill as a full scan reads them: make it anew.
				if file < 0 || bc.backing == "memfd" {
					if file >= 0 {
						unix.Close(file)
					}
					file, _ = newBacking(b, bc.backing, size, data)
				}
				fd, err := dup(file)
				if err != nil {
					b.Fatal(err)
				}
				m, err := MapFile(fd, layout, true)
				if err != nil {
					b.Fatal(err)
				}
				for _, p := range writes {
					m.host[p*pageSize] = 1
				}
				b.StartTimer()
				base, s, err := m.freeze(bc.opts)
				if err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				st = s
				unix.Close(base)
				m.Close()
				b.StartTimer()
			}
			b.ReportMetric(float64(st.scanned)/(1<<20), "MiB-read/op")
			b.ReportMetric(float64(st.fileRead)/(1<<20), "MiB-file-read/op")
			b.ReportMetric(float64(st.fromFile)/(1<<20), "MiB-from-file/op")
			b.ReportMetric(float64(st.fromMemory)/(1<<20), "MiB-from-memory/op")
		})
	}
}
