package virtio

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
)

// patternSource is a BlockSource of blkPattern bytes that fails reads
// touching bad (a byte offset; -1: none) with EIO, and counts reads.
type patternSource struct {
	size   int64
	bad    int64
	reads  atomic.Int64
	closed atomic.Bool
}

func (s *patternSource) Size() int64 { return s.size }

func (s *patternSource) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	s.reads.Add(1)
	if off < 0 || off+int64(len(p)) > s.size {
		return 0, fmt.Errorf("read at %d+%d outside %d bytes: %w", off, len(p), s.size, syscall.EIO)
	}
	if s.bad >= off && s.bad < off+int64(len(p)) {
		return 0, fmt.Errorf("bad chunk at %d: %w", s.bad, syscall.EIO)
	}
	for i := range p {
		p[i] = blkPattern(int(off) + i)
	}
	return len(p), nil
}

func (s *patternSource) Close() error {
	s.closed.Store(true)
	return nil
}

func newSourceBlock(t testing.TB, src *patternSource, key string) *Block {
	t.Helper()
	b, err := NewBlockFromSource(src, key, src, BlockConfig{Path: "image test", ID: "kilnroot"})
	if err != nil {
		t.Fatalf("NewBlockFromSource: %v", err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestBlockSource covers a source-backed disk: read-only, reads of one
// sector to more than one source read's worth, a failing read giving
// IOERR, writes refused, flush a no-op, GET_ID, Close releasing the
// source, and its snapshot state keyed by what it serves.
func TestBlockSource(t *testing.T) {
	for _, tc := range []struct {
		name string
		size int64
		key  string
		want string
	}{
		{"zero size", 0, "k", "want a positive multiple"},
		{"odd size", 1000, "k", "want a positive multiple"},
		{"no key", 4096, "", "needs a key"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewBlockFromSource(&patternSource{size: tc.size, bad: -1}, tc.key, nil, BlockConfig{Path: "x"})
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
	if _, err := NewBlockFromSource(nil, "k", nil, BlockConfig{}); err == nil {
		t.Fatal("a nil source was taken")
	}

	const size = 4 << 20
	src := &patternSource{size: size, bad: 3<<20 + 5}
	dev := newSourceBlock(t, src, "sha256:aa")
	if dev.Features()&BlockFeatureRO == 0 {
		t.Error("a source-backed disk does not offer VIRTIO_BLK_F_RO")
	}
	if dev.Capacity() != size/BlockSectorSize {
		t.Errorf("capacity %d sectors, want %d", dev.Capacity(), size/BlockSectorSize)
	}
	oneBuffer := false
	run := func(typ uint32, sector uint64, dataIn int, payload []byte) (byte, []byte, uint32) {
		c := &Chain{Readable: [][]byte{append(blkHeader(typ, sector), payload...)}}
		// The data in page-sized buffers and an odd one (or in one
		// buffer), then the status.
		if oneBuffer && dataIn > 0 {
			c.Writable = append(c.Writable, make([]byte, dataIn))
		}
		for left := dataIn; left > 0 && !oneBuffer; {
			n := min(left, 4096)
			if left == dataIn && n > 512 {
				n = 512
			}
			c.Writable = append(c.Writable, make([]byte, n))
			left -= n
		}
		c.Writable = append(c.Writable, []byte{0xee})
		n, _, _ := dev.process(context.Background(), c, nil, nil)
		var w []byte
		for _, b := range c.Writable {
			w = append(w, b...)
		}
		return w[len(w)-1], w[:len(w)-1], n
	}
	for _, tc := range []struct {
		name   string
		sector uint64
		n      int
		one    bool // the data in one buffer: read straight into it
	}{
		{"one sector", 0, 512, false},
		{"a page", 8, 4096, false},
		{"more than one source read", 16, maxSourceRead + 3*4096, false},
		{"the last sector", size/BlockSectorSize - 1, 512, false},
		{"a page in one buffer", 8, 4096, true},
		{"over a source read in one buffer", 16, maxSourceRead + 3*4096, true},
		{"the last sector in one buffer", size/BlockSectorSize - 1, 512, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			oneBuffer = tc.one
			defer func() { oneBuffer = false }()
			st, data, used := run(BlockTypeIn, tc.sector, tc.n, nil)
			if st != BlockStatusOK || used != uint32(tc.n+1) {
				t.Fatalf("status %d, used %d; want OK, %d", st, used, tc.n+1)
			}
			if !bytes.Equal(data, blkExpected(int(tc.sector), tc.n)) {
				t.Fatal("wrong data")
			}
		})
	}
	if st, _, _ := run(BlockTypeIn, size/BlockSectorSize, 512, nil); st != BlockStatusIOErr {
		t.Errorf("read past the end: status %d, want IOERR", st)
	}
	if st, _, _ := run(BlockTypeIn, (3<<20)/BlockSectorSize, 4096, nil); st != BlockStatusIOErr {
		t.Errorf("read of a bad chunk: status %d, want IOERR", st)
	}
	oneBuffer = true
	if st, _, used := run(BlockTypeIn, (3<<20)/BlockSectorSize, 4096, nil); st != BlockStatusIOErr || used != 1 {
		t.Errorf("read of a bad chunk into one buffer: status %d, %d bytes used; want IOERR, 1", st, used)
	}
	if st, _, _ := run(BlockTypeIn, size/BlockSectorSize, 512, nil); st != BlockStatusIOErr {
		t.Errorf("read past the end into one buffer: status %d, want IOERR", st)
	}
	oneBuffer = false
	if st, _, _ := run(BlockTypeOut, 0, 0, make([]byte, 512)); st != BlockStatusIOErr {
		t.Errorf("write: status %d, want IOERR", st)
	}
	if st, _, _ := run(BlockTypeFlush, 0, 0, nil); st != BlockStatusOK {
		t.Errorf("flush: status %d, want OK", st)
	}
	if st, id, _ := run(BlockTypeGetID, 0, BlockIDBytes, nil); st != BlockStatusOK || string(bytes.TrimRight(id, "\x00")) != "kilnroot" {
		t.Errorf("GET_ID: status %d, %q", st, id)
	}

	// Snapshot state: a restore against another source is refused.
	state, err := dev.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	if err := newSourceBlock(t, &patternSource{size: size, bad: -1}, "sha256:aa").RestoreState(state); err != nil {
		t.Errorf("restore against the same key: %v", err)
	}
	err = newSourceBlock(t, &patternSource{size: size, bad: -1}, "sha256:bb").RestoreState(state)
	if err == nil || !strings.Contains(err.Error(), "sha256:bb") {
		t.Errorf("restore against another key: %v", err)
	}
	var st BlockState
	json.Unmarshal(state, &st)
	st.Key = ""
	plain, _ := json.Marshal(st)
	if err := newSourceBlock(t, &patternSource{size: size, bad: -1}, "sha256:aa").RestoreState(plain); err == nil {
		t.Error("a file disk's state restored onto a source-backed disk")
	}

	if err := dev.Close(); err != nil {
		t.Fatal(err)
	}
	if !src.closed.Load() {
		t.Error("Close did not release the source")
	}
}

// FuzzBlockSourceRequest sends any request a guest can build to a
// source-backed disk: it must never panic, always write a status, never
// claim more than the writable bytes, and return the source's bytes for
// a successful read.
func FuzzBlockSourceRequest(f *testing.F) {
	seed := func(typ uint32, sector uint64, shape []byte, payload []byte) {
		f.Add(append(blkHeader(typ, sector), payload...), shape)
	}
	seed(BlockTypeIn, 1, []byte{4, 0x0e, 0x09}, nil)
	seed(BlockTypeIn, blkTestSectors-1, []byte{4, 0x0f, 0x09}, nil)
	seed(BlockTypeIn, 5, []byte{4, 0x0f, 0x09}, nil) // the bad sector
	seed(BlockTypeOut, 2, []byte{4, 6, 0x09}, bytes.Repeat([]byte{0x5a}, 512))
	seed(BlockTypeFlush, 0, []byte{4, 0x09}, nil)
	seed(BlockTypeGetID, 0, []byte{4, 0x0c, 0x09}, nil)
	seed(99, 0, []byte{4, 0x09}, nil)
	seed(BlockTypeIn, 1<<62, []byte{3, 0x0e}, nil)
	f.Fuzz(func(t *testing.T, data, shape []byte) {
		src := &patternSource{size: blkTestSectors * BlockSectorSize, bad: 5*BlockSectorSize + 7}
		dev, err := NewBlockFromSource(src, "k", nil, BlockConfig{Path: "fuzz", ID: "fuzz"})
		if err != nil {
			t.Fatal(err)
		}
		defer dev.Close()
		c := blkChain(shape, data)
		wl := c.WritableLen()
		n, _, _ := dev.process(context.Background(), c, nil, nil)
		if uint64(n) > uint64(wl) || (wl > 0 && n == 0) {
			t.Fatalf("used length %d for %d writable bytes", n, wl)
		}
		if wl == 0 {
			return
		}
		var w []byte
		for _, b := range c.Writable {
			w = append(w, b...)
		}
		status := w[len(w)-1]
		var hdr [blockHeaderSize]byte
		short := blkGather(hdr[:], c.Readable) < blockHeaderSize
		typ := binary.LittleEndian.Uint32(hdr[:])
		sector := binary.LittleEndian.Uint64(hdr[8:])
		switch {
		case status > BlockStatusUnsupp:
			t.Fatalf("status %d", status)
		case typ == BlockTypeOut && status == BlockStatusOK:
			t.Fatal("a write to a read-only source succeeded")
		case !short && typ == BlockTypeIn && status == BlockStatusOK:
			if !bytes.Equal(w[:len(w)-1], blkExpected(int(sector), len(w)-1)) {
				t.Fatal("a successful read returned the wrong data")
			}
			if lo, hi := int64(sector)*BlockSectorSize, int64(sector)*BlockSectorSize+int64(len(w)-1); src.bad >= lo && src.bad < hi {
				t.Fatal("a read over the bad byte succeeded")
			}
		}
	})
}
