package erofs

import (
	"context"
	"fmt"
	"syscall"
	"testing"
)

// benchFS is a tree shaped like a big image's root: dirs directories of
// files/dirs files each (names like a distribution's), sizes from 0 to
// 64 KiB, a symlink and an xattr here and there. File contents are made
// on demand (Build must not ask for them).
func benchFS(dirs, files int) *memFS {
	m := newMemFS()
	for d := range dirs {
		dir := fmt.Sprintf("usr/share/pkg%02d/module-%05d", d%50, d)
		for f := range files / dirs {
			p := fmt.Sprintf("%s/file-%05d.so.%d", dir, f, f%7)
			switch {
			case f%50 == 0:
				m.symlink(p, fmt.Sprintf("file-%05d.so.0", f))
			default:
				n := m.newIno(syscall.S_IFREG | 0o644)
				n.attr.Size = int64(f*977) % (64 << 10)
				n.gen = patternAt
				m.link(p, n)
				if f%100 == 1 {
					n.setxattr("security.capability", make([]byte, 20))
				}
			}
		}
	}
	return m
}

// BenchmarkBuild lays out 100,000 files in 5,000 directories, reporting
// the metadata region's bytes per inode and the extent table's bytes per
// file (what an image costs in memory once built).
func BenchmarkBuild(b *testing.B) {
	m := benchFS(5000, 100000)
	b.ReportAllocs()
	var im *Image
	for b.Loop() {
		var err error
		im, err = Build(context.Background(), m, Options{})
		if err != nil {
			b.Fatal(err)
		}
	}
	if m.readCalls.Load() != 0 {
		b.Fatal("Build read file data")
	}
	b.ReportMetric(float64(im.MetadataSize())/float64(im.Inodes()), "meta-B/inode")
	b.ReportMetric(float64(im.Inodes()), "inodes")
	b.ReportMetric(float64(im.extentBytes())/float64(len(im.starts)), "extent-B/file")
}

// extentBytes is the memory the extent table holds.
func (im *Image) extentBytes() int {
	return cap(im.starts)*4 + cap(im.inos)*8 + cap(im.sizes)*8
}
