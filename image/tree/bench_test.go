package tree

import (
	"fmt"
	"math/rand/v2"
	"runtime"
	"testing"

	"github.com/containerd/stargz-snapshotter/estargz"
)

// debianLike is a TOC shaped like a Debian root: about 3,000 directories,
// 30,000 files (a few of them big, in 4 MiB chunks), 3,000 symlinks and a
// few hardlinks, names as long as Debian's.
func debianLike() *estargz.JTOC {
	rng := rand.New(rand.NewPCG(1, 2))
	var es []*estargz.TOCEntry
	const chunk = 4 << 20
	for d := range 3000 {
		dir := fmt.Sprintf("usr/lib/x86_64-linux-gnu/package-%04d/share", d)
		es = append(es, dirE(dir, 0o755))
		for f := range 10 {
			name := fmt.Sprintf("%s/libsomething-%d.so.%d.%d", dir, f, d, f)
			size := rng.Int64N(200 << 10)
			if rng.IntN(500) == 0 {
				size = rng.Int64N(64 << 20)
			}
			e := regE(name, 0o644, size)
			e.ModTime3339 = "2024-05-06T07:08:09Z"
			if size > chunk {
				e.ChunkSize = chunk
			}
			es = append(es, e)
			for off := int64(chunk); off < size; off += chunk {
				es = append(es, chunkE(name, off, min(chunk, size-off)))
			}
		}
		es = append(es, symE(dir+"/current", "libsomething-0.so"))
		if d%100 == 0 {
			es = append(es, linkE(dir+"/hard", dir+"/libsomething-1.so."+fmt.Sprint(d)+".1"))
		}
	}
	return &estargz.JTOC{Version: 1, Entries: es}
}

// BenchmarkBuild reports Build's time and the tree's retained heap per
// inode (the TOC, which the caller holds anyway, not counted).
func BenchmarkBuild(b *testing.B) {
	toc := debianLike()
	layers := []Layer{{TOC: toc, Chunks: patternChunks{}}}
	var tr *Tree
	b.ResetTimer()
	for b.Loop() {
		var err error
		if tr, err = Build(layers, Options{}); err != nil {
			b.Fatal(err)
		}
	}
	b.StopTimer()
	var before, after runtime.MemStats
	tr = nil
	runtime.GC()
	runtime.ReadMemStats(&before)
	tr, _ = Build(layers, Options{})
	runtime.GC()
	runtime.ReadMemStats(&after)
	b.ReportMetric(float64(len(toc.Entries)), "entries")
	b.ReportMetric(float64(tr.Len()), "inodes")
	b.ReportMetric(float64(after.HeapAlloc-before.HeapAlloc)/float64(tr.Len()), "B/inode")
	runtime.KeepAlive(tr)
}

func BenchmarkResolve(b *testing.B) {
	tr, err := Build([]Layer{{TOC: debianLike(), Chunks: patternChunks{}}}, Options{})
	if err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := tr.Resolve("/usr/lib/x86_64-linux-gnu/package-1234/share/libsomething-7.so.1234.7"); err != nil {
			b.Fatal(err)
		}
	}
}
