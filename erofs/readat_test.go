package erofs

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"strings"
	"sync"
	"syscall"
	"testing"

	goerofs "github.com/erofs/go-erofs"
)

// readFS is the tree the ReadAt tests read: files of awkward sizes, so
// that extents end mid-block and follow each other.
func readFS() *memFS {
	m := newMemFS()
	for i, size := range []int{5000, 4096, 1, 0, 12289, 4095, 3} {
		data := make([]byte, size)
		patternAt(int64(i)<<16, data)
		m.file(fmt.Sprintf("f%d", i), 0o644, data)
	}
	m.symlink("l", "f0")
	return m
}

// readImage builds readFS and materializes it as the reference bytes.
var readImage = sync.OnceValues(func() (*Image, []byte) {
	m := readFS()
	im, err := Build(context.Background(), m, Options{})
	if err != nil {
		panic(err)
	}
	ref := make([]byte, im.Size())
	for off := int64(0); off < im.Size(); off += BlockSize {
		if _, err := im.ReadAt(context.Background(), ref[off:off+BlockSize], off); err != nil {
			panic(err)
		}
	}
	return im, ref
})

// checkRead reads n bytes at off and checks them against ref, with
// io.ReaderAt's semantics.
func checkRead(im *Image, ref []byte, off int64, n int) error {
	p := make([]byte, n)
	got, err := im.ReadAt(context.Background(), p, off)
	size := int64(len(ref))
	switch {
	case off < 0:
		if err == nil || errors.Is(err, io.EOF) || got != 0 {
			return fmt.Errorf("ReadAt(%d, %d) = %d, %v: want an error", off, n, got, err)
		}
		return nil
	case off >= size:
		if got != 0 || (n > 0 && err != io.EOF) || (n == 0 && err != nil) {
			return fmt.Errorf("ReadAt(%d, %d) past the end = %d, %v", off, n, got, err)
		}
		return nil
	}
	want := min(int64(n), size-off)
	if int64(got) != want {
		return fmt.Errorf("ReadAt(%d, %d) = %d bytes, want %d (%v)", off, n, got, want, err)
	}
	if off+int64(n) > size {
		if err != io.EOF {
			return fmt.Errorf("ReadAt(%d, %d) across the end: err %v, want io.EOF", off, n, err)
		}
	} else if err != nil {
		return fmt.Errorf("ReadAt(%d, %d): %v", off, n, err)
	}
	if !bytes.Equal(p[:got], ref[off:off+want]) {
		return fmt.Errorf("ReadAt(%d, %d): bytes differ from the block-wise read", off, n)
	}
	return nil
}

func TestReadAt(t *testing.T) {
	im, ref := readImage()
	if err := checkLayout(ref, im.MetadataSize()); err != nil {
		t.Fatal(err)
	}
	compareGoErofs(t, readFS(), im)
	meta, size := im.MetadataSize(), im.Size()
	tests := []struct {
		name string
		off  int64
		n    int
	}{
		{"first byte", 0, 1},
		{"superblock", superOffset, superSize},
		{"nothing", 100, 0},
		{"whole metadata", 0, int(meta)},
		{"metadata into data", meta - 10, 20},
		{"first data block", meta, BlockSize},
		{"across all files", meta - 1, int(size - meta + 1)},
		{"whole image", 0, int(size)},
		{"unaligned middle", meta + 4000, 9000},
		{"tail of f0's last block", meta + 5000, BlockSize*2 - 5000},
		{"last byte", size - 1, 1},
		{"across the end", size - 10, 100},
		{"at the end", size, 10},
		{"at the end, nothing", size, 0},
		{"past the end", size + 1<<20, 1},
		{"far past the end", 1 << 62, 1},
		{"negative", -1, 1},
		{"very negative", -1 << 62, 10},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if err := checkRead(im, ref, tc.off, tc.n); err != nil {
				t.Fatal(err)
			}
		})
	}
	// Every byte either side of every block boundary.
	for off := int64(0); off <= size; off += BlockSize {
		for _, o := range []int64{off - 1, off} {
			if err := checkRead(im, ref, o, 2); err != nil {
				t.Fatal(err)
			}
		}
	}
	// The data region is each file's bytes, zero-padded to a block, in
	// inode order.
	m := readFS()
	img, _ := goerofs.Open(readerAt{im})
	for _, name := range []string{"f0", "f1", "f2", "f4", "f5", "f6"} {
		fi, err := img.(fs.ReadLinkFS).Lstat(name)
		if err != nil {
			t.Fatal(err)
		}
		blk, _ := rawInodeAt(t, im, fi.Sys().(*goerofs.Stat).Ino)
		ino, _ := m.Lookup(1, name)
		data := m.nodes[ino].data
		start := int64(blk) * BlockSize
		end := start + alignUp(int64(len(data)), BlockSize)
		if !bytes.Equal(ref[start:start+int64(len(data))], data) {
			t.Errorf("%s: data differs", name)
		}
		if !bytes.Equal(ref[start+int64(len(data)):end], make([]byte, end-start-int64(len(data)))) {
			t.Errorf("%s: padding not zero", name)
		}
	}
}

// TestReadAtConcurrent reads random ranges from many goroutines at once
// (run it with -race).
func TestReadAtConcurrent(t *testing.T) {
	im, ref := readImage()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for range 500 {
				off := rng.Int64N(int64(len(ref)) + 100)
				if err := checkRead(im, ref, off, rng.IntN(3*BlockSize)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// TestReadAtEIO: a failed read of the tree, or a file shorter than its
// size said, comes back as an error wrapping EIO that names the inode and
// offsets; the bytes before it are returned.
func TestReadAtEIO(t *testing.T) {
	m := newMemFS()
	good := m.file("a-good", 0o644, bytes.Repeat([]byte("g"), 100))
	bad := m.file("b-bad", 0o644, bytes.Repeat([]byte("b"), 3*BlockSize))
	short := m.file("c-short", 0o644, bytes.Repeat([]byte("s"), 2*BlockSize))
	short.short = BlockSize + 10
	im, err := Build(context.Background(), m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	m.failIno.Store(bad.attr.Ino)
	meta := im.MetadataSize()
	badStart := meta + BlockSize // after a-good's one block
	shortStart := badStart + 3*BlockSize
	tests := []struct {
		name    string
		off     int64
		n       int
		wantN   int
		wantMsg []string
	}{
		{"the failing file", badStart + 5, 10, 0, []string{fmt.Sprintf("inode %d", bad.attr.Ino), "file offset 5", fmt.Sprintf("image offset %d", badStart+5), "failed its check"}},
		{"into the failing file", meta, 2 * BlockSize, BlockSize, []string{fmt.Sprintf("inode %d", bad.attr.Ino), "file offset 0"}},
		{"a file shorter than its size", shortStart, 2 * BlockSize, BlockSize + 10, []string{fmt.Sprintf("inode %d", short.attr.Ino), fmt.Sprintf("file ends at %d", BlockSize+10)}},
		{"past a short file's end", shortStart + BlockSize + 20, 5, 0, []string{fmt.Sprintf("inode %d", short.attr.Ino)}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p := make([]byte, tc.n)
			n, err := im.ReadAt(context.Background(), p, tc.off)
			if err == nil {
				t.Fatalf("ReadAt = %d, nil: want an error", n)
			}
			if !errors.Is(err, syscall.EIO) {
				t.Errorf("error %q does not wrap EIO", err)
			}
			if n != tc.wantN {
				t.Errorf("n = %d, want %d", n, tc.wantN)
			}
			for _, w := range tc.wantMsg {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
		})
	}
	// A canceled context reaches the tree, and comes back as EIO too.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = im.ReadAt(ctx, make([]byte, 10), meta)
	if !errors.Is(err, syscall.EIO) || !errors.Is(err, context.Canceled) {
		t.Errorf("canceled read: %v", err)
	}
	// The good file still reads.
	p := make([]byte, 100)
	if _, err := im.ReadAt(context.Background(), p, meta); err != nil || !bytes.Equal(p, good.data) {
		t.Errorf("good file: %v", err)
	}
}

// FuzzReadAt reads any range of a fixed image: the bytes must be those of
// the block-wise read, errors must be io.ReaderAt's, never a panic.
func FuzzReadAt(f *testing.F) {
	im, ref := readImage()
	size, meta := im.Size(), im.MetadataSize()
	for _, seed := range []struct {
		off int64
		n   uint32
	}{
		{0, 0}, {0, 1}, {1023, 200}, {meta - 1, 2}, {meta, BlockSize}, {meta + 4999, 5000},
		{size - 1, 1}, {size - 1, 2}, {size, 1}, {size + 1, 0}, {-1, 1}, {-1 << 63, 1}, {1<<63 - 1, 1},
		{0, uint32(size)}, {0, uint32(size) + 1},
	} {
		f.Add(seed.off, seed.n)
	}
	f.Fuzz(func(t *testing.T, off int64, n uint32) {
		n %= uint32(size) + 2*BlockSize
		if err := checkRead(im, ref, off, int(n)); err != nil {
			t.Fatal(err)
		}
	})
}
