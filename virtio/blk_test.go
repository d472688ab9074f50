package virtio

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
)

const blkTestSectors = 16

// blkPattern is the test image's initial content at byte offset off.
func blkPattern(off int) byte { return byte(off*7 + off>>9) }

// blkImage writes an image of n bytes of blkPattern and returns its path.
func blkImage(t testing.TB, name string, n int) string {
	t.Helper()
	data := make([]byte, n)
	for i := range data {
		data[i] = blkPattern(i)
	}
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func newTestBlock(t testing.TB, cfg BlockConfig) *Block {
	t.Helper()
	b, err := NewBlock(cfg)
	if err != nil {
		t.Fatalf("NewBlock: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return b
}

func blkReadFile(t testing.TB, p string) []byte {
	t.Helper()
	data, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

func TestNewBlock(t *testing.T) {
	dir := t.TempDir()
	odd := filepath.Join(dir, "odd.img")
	if err := os.WriteFile(odd, make([]byte, 1000), 0o644); err != nil {
		t.Fatal(err)
	}
	good := blkImage(t, "a-rather-long-disk-image-name.img", 4*BlockSectorSize)
	fifo := filepath.Join(dir, "fifo.img")
	if err := unix.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		cfg     BlockConfig
		wantErr string // substring of the error; "" for success
	}{
		{"read-write", BlockConfig{Path: good}, ""},
		{"read-only", BlockConfig{Path: good, ReadOnly: true}, ""},
		{"explicit ID", BlockConfig{Path: good, ID: "01234567890123456789"}, ""},
		{"no path", BlockConfig{}, "no image path"},
		{"size not whole sectors", BlockConfig{Path: odd}, odd},
		{"missing file", BlockConfig{Path: filepath.Join(dir, "none.img")}, "none.img"},
		{"directory", BlockConfig{Path: dir, ReadOnly: true}, "not a regular file"},
		// Opening a FIFO blocked until a writer came, for ever.
		{"FIFO read-only", BlockConfig{Path: fifo, ReadOnly: true}, fifo + " is a p"},
		{"FIFO read-write", BlockConfig{Path: fifo}, fifo + " is a p"},
		{"character device", BlockConfig{Path: "/dev/null", ReadOnly: true}, "/dev/null is a Dc"},
		{"ID too long", BlockConfig{Path: good, ID: "012345678901234567890"}, "at most 20"},
		{"four queues", BlockConfig{Path: good, Queues: 4}, ""},
		{"too many queues", BlockConfig{Path: good, Queues: BlockMaxQueues + 1}, "17 queues, want 1 to 16"},
		{"negative queues", BlockConfig{Path: good, Queues: -1}, "-1 queues"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := NewBlock(tt.cfg)
			if tt.wantErr != "" {
				if err == nil {
					b.Close()
					t.Fatalf("NewBlock succeeded, want an error containing %q", tt.wantErr)
				}
				if !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %q does not contain %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatalf("NewBlock: %v", err)
			}
			defer b.Close()
			if b.ID() != IDBlock || b.Capacity() != 4 {
				t.Errorf("ID %d capacity %d, want %d and 4", b.ID(), b.Capacity(), IDBlock)
			}
			want := uint64(BlockFeatureFlush | BlockFeatureSegMax | BlockFeatureBlkSize)
			if tt.cfg.ReadOnly {
				want |= BlockFeatureRO
			}
			queues := max(tt.cfg.Queues, 1)
			if queues > 1 {
				want |= BlockFeatureMQ
			}
			if n := len(b.QueueSizes()); n != queues {
				t.Errorf("%d queue sizes, want %d", n, queues)
			}
			if got := b.Features(); got != want {
				t.Errorf("features %#x, want %#x", got, want)
			}
			var cfg [64]byte
			b.ReadConfig(0, cfg[:])
			if c := binary.LittleEndian.Uint64(cfg[0:]); c != 4 {
				t.Errorf("config capacity %d, want 4", c)
			}
			if s := binary.LittleEndian.Uint32(cfg[12:]); s != BlockQueueSize-2 {
				t.Errorf("config seg_max %d, want %d", s, BlockQueueSize-2)
			}
			if s := binary.LittleEndian.Uint32(cfg[20:]); s != BlockSectorSize {
				t.Errorf("config blk_size %d, want %d", s, BlockSectorSize)
			}
			if n := binary.LittleEndian.Uint16(cfg[34:]); int(n) != queues {
				t.Errorf("config num_queues %d, want %d", n, queues)
			}
			var one [4]byte
			b.ReadConfig(20, one[:])
			if binary.LittleEndian.Uint32(one[:]) != BlockSectorSize {
				t.Errorf("blk_size read alone: % x", one)
			}
			one = [4]byte{1, 2, 3, 4}
			b.ReadConfig(1<<40, one[:])
			if one != [4]byte{} {
				t.Errorf("config read past the end gave % x, want zeros", one)
			}
			wantID := tt.cfg.ID
			if wantID == "" {
				wantID = filepath.Base(good)[:BlockIDBytes]
			}
			if got := string(b.id[:]); got != wantID {
				t.Errorf("device ID %q, want %q", got, wantID)
			}
		})
	}
}

func TestNewBlockLocksImage(t *testing.T) {
	p := blkImage(t, "disk.img", BlockSectorSize)
	newTestBlock(t, BlockConfig{Path: p})
	if b, err := NewBlock(BlockConfig{Path: p, ReadOnly: true}); err == nil {
		b.Close()
		t.Fatal("a second device opened an image another device writes")
	}
	ro := blkImage(t, "ro.img", BlockSectorSize)
	newTestBlock(t, BlockConfig{Path: ro, ReadOnly: true})
	newTestBlock(t, BlockConfig{Path: ro, ReadOnly: true}) // shared is fine
	if b, err := NewBlock(BlockConfig{Path: ro}); err == nil {
		b.Close()
		t.Fatal("a writable device opened an image other devices read")
	}
}

// blkDriver is a minimal virtio driver for one queue laid out by hand in
// anonymous memory: descriptor table, available and used rings, buffers.
type blkDriver struct {
	t      *testing.T
	mem    *memory.Memory
	q      *Queue
	dev    *Block
	irq    chan struct{}
	errs   chan error
	kick   func() // notify queue 0
	ack    func() // acknowledge an interrupt, when the transport needs it
	desc   uint16 // next free descriptor
	avail  uint16 // available index
	used   uint16 // used entries consumed
	bufTop uint64 // next free buffer address
	ring   uint64 // added to the ring addresses (a second queue's)
	bufOff uint64 // added to blkBufBase (a second queue's buffers)
}

const (
	blkDescAddr  = 0x0000
	blkAvailAddr = 0x2000
	blkUsedAddr  = 0x3000
	blkBufBase   = 0x10000
	blkMemSize   = 4 << 20
	blkQSize     = 128
)

func newBlkDriver(t *testing.T, dev *Block) *blkDriver {
	t.Helper()
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: blkMemSize}})
	if err != nil {
		t.Fatal(err)
	}
	d := &blkDriver{t: t, mem: mem, dev: dev, irq: make(chan struct{}, 1), errs: make(chan error, 4), bufTop: blkBufBase}
	d.kick = func() { dev.QueueNotify(0) }
	d.ack = func() {}
	t.Cleanup(func() {
		dev.Reset()
		mem.Close()
	})
	d.activate()
	return d
}

// activate (re)configures the queue and activates the device.
func (d *blkDriver) activate() {
	d.t.Helper()
	d.q = &Queue{Size: blkQSize, Ready: true, DescAddr: blkDescAddr, DriverAddr: blkAvailAddr, DeviceAddr: blkUsedAddr}
	clear(d.slice(0, blkBufBase))
	d.desc, d.avail, d.used = 0, 0, 0
	features := uint64(FeatureVersion1) | d.dev.Features()
	irq := func() {
		select {
		case d.irq <- struct{}{}:
		default:
		}
	}
	if err := d.q.activate(d.mem, features, irq, func(err error) { d.errs <- err }); err != nil {
		d.t.Fatalf("queue activate: %v", err)
	}
	if err := d.dev.Activate(d.mem, features, []*Queue{d.q}); err != nil {
		d.t.Fatalf("device Activate: %v", err)
	}
}

func (d *blkDriver) slice(addr, n uint64) []byte {
	s, err := d.mem.Slice(addr, n)
	if err != nil {
		d.t.Fatal(err)
	}
	return s
}

// blkSeg is one buffer of a chain: readable with data, or writable of n bytes.
type blkSeg struct {
	data  []byte
	n     int
	write bool
	addr  uint64 // guest address, set by add; an explicit one when raw
	raw   bool   // use addr and n as given (possibly outside memory)
}

func blkOut(data []byte) blkSeg { return blkSeg{data: data} }
func blkIn(n int) blkSeg        { return blkSeg{n: n, write: true} }

// add puts a chain in the descriptor table and the available ring, without
// notifying. It returns the chain's segments with their addresses.
func (d *blkDriver) add(segs ...blkSeg) []blkSeg {
	d.t.Helper()
	head := d.desc
	for i := range segs {
		s := &segs[i]
		n := s.n
		if !s.write {
			n = len(s.data)
		}
		if !s.raw {
			s.addr = d.bufTop
			d.bufTop += uint64(n+15) &^ 15
			if d.bufTop > blkMemSize {
				d.t.Fatal("test driver out of buffer memory")
			}
			if s.write {
				fill := d.slice(s.addr, uint64(n))
				for j := range fill {
					fill[j] = 0xee // not a status, not image data
				}
			} else {
				copy(d.slice(s.addr, uint64(n)), s.data)
			}
		}
		var flags uint16
		if s.write {
			flags |= descFWrite
		}
		next := (d.desc + 1) % blkQSize
		if i < len(segs)-1 {
			flags |= descFNext
		}
		e := d.slice(d.ring+blkDescAddr+descSize*uint64(d.desc), descSize)
		binary.LittleEndian.PutUint64(e, s.addr)
		binary.LittleEndian.PutUint32(e[8:], uint32(n))
		binary.LittleEndian.PutUint16(e[12:], flags)
		binary.LittleEndian.PutUint16(e[14:], next)
		d.desc = next
	}
	ring := d.slice(d.ring+blkAvailAddr, 4+2*blkQSize)
	binary.LittleEndian.PutUint16(ring[4+2*(d.avail%blkQSize):], head)
	d.avail++
	binary.LittleEndian.PutUint16(ring[2:], d.avail)
	return segs
}

// wait returns the next used element, failing after a timeout.
func (d *blkDriver) wait() (id, length uint32) {
	d.t.Helper()
	ring := d.slice(d.ring+blkUsedAddr, 4+8*blkQSize)
	deadline := time.After(5 * time.Second)
	for binary.LittleEndian.Uint16(ring[2:]) == d.used {
		select {
		case <-d.irq:
			d.ack()
		case err := <-d.errs:
			d.t.Fatalf("queue broken: %v", err)
		case <-deadline:
			d.t.Fatal("request not completed within 5 s")
		}
	}
	e := ring[4+8*(d.used%blkQSize):]
	d.used++
	return binary.LittleEndian.Uint32(e), binary.LittleEndian.Uint32(e[4:])
}

// bytes returns the current content of a segment's buffer.
func (d *blkDriver) bytes(s blkSeg) []byte {
	n := s.n
	if !s.write {
		n = len(s.data)
	}
	return append([]byte(nil), d.slice(s.addr, uint64(n))...)
}

// do runs one chain to completion and returns the used length and the
// writable segments' contents, concatenated.
func (d *blkDriver) do(segs ...blkSeg) (uint32, []byte) {
	d.t.Helper()
	d.bufTop = blkBufBase + d.bufOff
	segs = d.add(segs...)
	d.kick()
	_, n := d.wait()
	var w []byte
	for _, s := range segs {
		if s.write {
			w = append(w, d.bytes(s)...)
		}
	}
	return n, w
}

func blkHeader(typ uint32, sector uint64) []byte {
	h := make([]byte, blockHeaderSize)
	binary.LittleEndian.PutUint32(h, typ)
	binary.LittleEndian.PutUint32(h[4:], 0xdeadbeef) // reserved: ignored
	binary.LittleEndian.PutUint64(h[8:], sector)
	return h
}

func blkExpected(sector, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = blkPattern(sector*BlockSectorSize + i)
	}
	return b
}

// TestBlockRequests runs requests through a real queue and checks the
// status, the used length, the data and the image.
func TestBlockRequests(t *testing.T) {
	p := blkImage(t, "disk.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p, ID: "kiln-disk"})
	d := newBlkDriver(t, dev)
	written := bytes.Repeat([]byte("kiln"), 256) // 1024 bytes
	id := make([]byte, BlockIDBytes)
	copy(id, "kiln-disk")
	hdr := blkHeader

	tests := []struct {
		name    string
		segs    []blkSeg
		wantLen uint32
		wantW   []byte // the writable bytes after completion, status last
	}{
		{"read two sectors in two buffers", []blkSeg{blkOut(hdr(BlockTypeIn, 2)), blkIn(100), blkIn(924), blkIn(1)}, 1025,
			append(blkExpected(2, 1024), BlockStatusOK)},
		{"read with status in the data buffer", []blkSeg{blkOut(hdr(BlockTypeIn, 0)), blkIn(513)}, 513,
			append(blkExpected(0, 512), BlockStatusOK)},
		{"read header split over buffers", []blkSeg{blkOut(hdr(BlockTypeIn, 3)[:5]), blkOut(hdr(BlockTypeIn, 3)[5:]), blkIn(512), blkIn(1)}, 513,
			append(blkExpected(3, 512), BlockStatusOK)},
		{"read last sector", []blkSeg{blkOut(hdr(BlockTypeIn, blkTestSectors-1)), blkIn(512), blkIn(1)}, 513,
			append(blkExpected(blkTestSectors-1, 512), BlockStatusOK)},
		{"read nothing at the end", []blkSeg{blkOut(hdr(BlockTypeIn, blkTestSectors)), blkIn(1)}, 1, []byte{BlockStatusOK}},
		{"write two sectors", []blkSeg{blkOut(hdr(BlockTypeOut, 5)), blkOut(written[:300]), blkOut(written[300:]), blkIn(1)}, 1, []byte{BlockStatusOK}},
		{"read back the write", []blkSeg{blkOut(hdr(BlockTypeIn, 5)), blkIn(1024), blkIn(1)}, 1025, append(bytes.Clone(written), BlockStatusOK)},
		{"flush", []blkSeg{blkOut(hdr(BlockTypeFlush, 0)), blkIn(1)}, 1, []byte{BlockStatusOK}},
		{"flush ignores the sector", []blkSeg{blkOut(hdr(BlockTypeFlush, 1<<60)), blkIn(1)}, 1, []byte{BlockStatusOK}},
		{"get ID", []blkSeg{blkOut(hdr(BlockTypeGetID, 0)), blkIn(BlockIDBytes), blkIn(1)}, BlockIDBytes + 1, append(bytes.Clone(id), BlockStatusOK)},
		{"get ID, short buffer", []blkSeg{blkOut(hdr(BlockTypeGetID, 0)), blkIn(4), blkIn(1)}, 5, append([]byte("kiln"), BlockStatusOK)},
		{"get ID, long buffer", []blkSeg{blkOut(hdr(BlockTypeGetID, 0)), blkIn(32), blkIn(1)}, BlockIDBytes + 1,
			append(append(bytes.Clone(id), bytes.Repeat([]byte{0xee}, 12)...), BlockStatusOK)},
		{"unsupported type", []blkSeg{blkOut(hdr(11, 0)), blkIn(1)}, 1, []byte{BlockStatusUnsupp}},
		{"read past the end", []blkSeg{blkOut(hdr(BlockTypeIn, blkTestSectors-1)), blkIn(1024), blkIn(1)}, 1,
			append(bytes.Repeat([]byte{0xee}, 1024), BlockStatusIOErr)},
		{"read from a sector past the end", []blkSeg{blkOut(hdr(BlockTypeIn, blkTestSectors+1)), blkIn(1)}, 1, []byte{BlockStatusIOErr}},
		{"write past the end", []blkSeg{blkOut(hdr(BlockTypeOut, blkTestSectors)), blkOut(written[:512]), blkIn(1)}, 1, []byte{BlockStatusIOErr}},
		{"offset overflows", []blkSeg{blkOut(hdr(BlockTypeIn, 1<<63)), blkIn(512), blkIn(1)}, 1,
			append(bytes.Repeat([]byte{0xee}, 512), BlockStatusIOErr)},
		{"sector overflows", []blkSeg{blkOut(hdr(BlockTypeIn, ^uint64(0))), blkIn(512), blkIn(1)}, 1,
			append(bytes.Repeat([]byte{0xee}, 512), BlockStatusIOErr)},
		{"read of part of a sector", []blkSeg{blkOut(hdr(BlockTypeIn, 0)), blkIn(100), blkIn(1)}, 1,
			append(bytes.Repeat([]byte{0xee}, 100), BlockStatusIOErr)},
		{"write of part of a sector", []blkSeg{blkOut(hdr(BlockTypeOut, 7)), blkOut(written[:511]), blkIn(1)}, 1, []byte{BlockStatusIOErr}},
		{"short header", []blkSeg{blkOut(hdr(BlockTypeIn, 0)[:15]), blkIn(1)}, 1, []byte{BlockStatusIOErr}},
		{"no header", []blkSeg{blkIn(513)}, 1, append(bytes.Repeat([]byte{0xee}, 512), BlockStatusIOErr)},
		{"no status byte", []blkSeg{blkOut(hdr(BlockTypeOut, 8)), blkOut(written[:512])}, 0, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d.t = t
			n, w := d.do(tt.segs...)
			if n != tt.wantLen {
				t.Errorf("used length %d, want %d", n, tt.wantLen)
			}
			if !bytes.Equal(w, tt.wantW) {
				t.Errorf("writable bytes\n got % x\nwant % x", w, tt.wantW)
			}
		})
	}
	d.t = t

	// The image holds the pattern except for the one successful write;
	// the refused writes and the chain without a status byte left it alone.
	want := blkExpected(0, blkTestSectors*BlockSectorSize)
	copy(want[5*BlockSectorSize:], written)
	if got := blkReadFile(t, p); !bytes.Equal(got, want) {
		t.Error("image content differs from what the requests should have left")
	}
}

// TestBlockBatch makes several requests available before one notification
// and checks they all complete (in any order: they run concurrently), with
// one interrupt or more.
func TestBlockBatch(t *testing.T) {
	p := blkImage(t, "disk.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p})
	d := newBlkDriver(t, dev)
	var reqs [][]blkSeg
	for s := range 4 {
		reqs = append(reqs, d.add(blkOut(blkHeader(BlockTypeIn, uint64(s))), blkIn(512), blkIn(1)))
	}
	dev.QueueNotify(0)
	seen := map[uint32]bool{}
	for range reqs {
		id, n := d.wait()
		if id%3 != 0 || id/3 >= uint32(len(reqs)) || seen[id] || n != 513 {
			t.Errorf("completion: head %d length %d, want one of 0, 3, 6, 9 once, and 513", id, n)
		}
		seen[id] = true
	}
	for i, segs := range reqs {
		if got := d.bytes(segs[1]); !bytes.Equal(got, blkExpected(i, 512)) {
			t.Errorf("request %d read the wrong data", i)
		}
		if st := d.bytes(segs[2]); st[0] != BlockStatusOK {
			t.Errorf("request %d status %d", i, st[0])
		}
	}
}

func TestBlockReadOnly(t *testing.T) {
	p := blkImage(t, "ro.img", blkTestSectors*BlockSectorSize)
	before := blkReadFile(t, p)
	dev := newTestBlock(t, BlockConfig{Path: p, ReadOnly: true})
	d := newBlkDriver(t, dev)
	tests := []struct {
		name   string
		segs   []blkSeg
		status byte
	}{
		{"write refused", []blkSeg{blkOut(blkHeader(BlockTypeOut, 0)), blkOut(make([]byte, 512)), blkIn(1)}, BlockStatusIOErr},
		{"empty write refused", []blkSeg{blkOut(blkHeader(BlockTypeOut, 0)), blkIn(1)}, BlockStatusIOErr},
		{"read allowed", []blkSeg{blkOut(blkHeader(BlockTypeIn, 1)), blkIn(512), blkIn(1)}, BlockStatusOK},
		{"flush allowed", []blkSeg{blkOut(blkHeader(BlockTypeFlush, 0)), blkIn(1)}, BlockStatusOK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d.t = t
			_, w := d.do(tt.segs...)
			if got := w[len(w)-1]; got != tt.status {
				t.Errorf("status %d, want %d", got, tt.status)
			}
		})
	}
	d.t = t
	if !bytes.Equal(blkReadFile(t, p), before) {
		t.Error("a read-only image changed")
	}
}

// TestBlockReset checks that Reset stops the serving goroutine (a notify
// afterwards completes nothing), that the device can be activated again,
// and that Close after Reset works.
func TestBlockReset(t *testing.T) {
	p := blkImage(t, "disk.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p})
	d := newBlkDriver(t, dev)
	if _, w := d.do(blkOut(blkHeader(BlockTypeFlush, 0)), blkIn(1)); w[0] != BlockStatusOK {
		t.Fatalf("flush status %d", w[0])
	}
	if err := dev.Activate(d.mem, 0, []*Queue{d.q}); err == nil {
		t.Error("second Activate without Reset succeeded")
	}
	dev.Reset()
	d.q.Reset()
	d.add(blkOut(blkHeader(BlockTypeFlush, 0)), blkIn(1))
	dev.QueueNotify(0)
	time.Sleep(50 * time.Millisecond)
	if idx := binary.LittleEndian.Uint16(d.slice(blkUsedAddr+2, 2)); idx != 1 {
		t.Fatalf("used index %d after a notify following Reset, want 1 (no completion)", idx)
	}
	dev.Reset() // twice is fine

	d.activate()
	if n, w := d.do(blkOut(blkHeader(BlockTypeGetID, 0)), blkIn(BlockIDBytes), blkIn(1)); n != BlockIDBytes+1 || string(w[:8]) != "disk.img" {
		t.Errorf("get ID after re-activation: length %d, %q", n, w)
	}
	if err := dev.Activate(d.mem, 0, nil); err == nil {
		t.Error("Activate with no queues succeeded")
	}
}

// TestBlockBrokenQueue checks that a chain the queue rejects stops the
// device (the transport is told through the queue), and that Reset still
// returns.
func TestBlockBrokenQueue(t *testing.T) {
	p := blkImage(t, "disk.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p})
	d := newBlkDriver(t, dev)
	d.add(blkOut(blkHeader(BlockTypeIn, 0)), blkSeg{raw: true, addr: blkMemSize - 100, n: 512, write: true}, blkIn(1))
	dev.QueueNotify(0)
	select {
	case err := <-d.errs:
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("queue error %v does not wrap ErrMalformed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a buffer outside guest memory was not reported")
	}
	dev.QueueNotify(0)
	dev.Reset()
}

// blkChain builds a chain for process from a fuzzer's shape: each shape
// byte adds one buffer, readable or writable, of a length from a list that
// hits the interesting boundaries; readable bytes come from data.
func blkChain(shape, data []byte) *Chain {
	lengths := [8]int{0, 1, 8, 15, 16, 511, 512, 1024}
	c := &Chain{}
	for _, s := range shape[:min(len(shape), 16)] {
		n := lengths[s&7]
		if s&0x40 != 0 {
			n += int(s >> 7) // 0 or 1 extra: unaligned lengths
		}
		buf := make([]byte, n)
		if s&8 != 0 {
			for i := range buf {
				buf[i] = 0xee
			}
			c.Writable = append(c.Writable, buf)
			continue
		}
		k := copy(buf, data)
		data = data[k:]
		c.Readable = append(c.Readable, buf)
	}
	return c
}

func FuzzBlockRequest(f *testing.F) {
	seed := func(typ uint32, sector uint64, shape []byte, payload []byte) {
		f.Add(append(blkHeader(typ, sector), payload...), shape, false)
	}
	seed(BlockTypeIn, 1, []byte{4, 0x0e, 0x09}, nil)
	seed(BlockTypeIn, blkTestSectors-1, []byte{4, 0x0f, 0x09}, nil)
	seed(BlockTypeOut, 2, []byte{4, 6, 0x09}, bytes.Repeat([]byte{0x5a}, 512))
	seed(BlockTypeOut, 2, []byte{2, 2, 6, 0x09}, bytes.Repeat([]byte{0x5a}, 512))
	seed(BlockTypeFlush, 0, []byte{4, 0x09}, nil)
	seed(BlockTypeGetID, 0, []byte{4, 0x0c, 0x09}, nil)
	seed(99, 0, []byte{4, 0x09}, nil)
	seed(BlockTypeIn, 1<<62, []byte{3, 0x0e}, nil)
	f.Add([]byte{}, []byte{0x08}, true)

	f.Fuzz(func(t *testing.T, data, shape []byte, readOnly bool) {
		p := blkImage(t, "disk.img", 8*BlockSectorSize)
		before := blkReadFile(t, p)
		dev := newTestBlock(t, BlockConfig{Path: p, ReadOnly: readOnly, ID: "fuzz"})
		c := blkChain(shape, data)
		wl := c.WritableLen()
		n, _, _ := dev.process(context.Background(), c, nil, nil)
		if uint64(n) > uint64(wl) || (wl > 0 && n == 0) {
			t.Fatalf("used length %d for %d writable bytes", n, wl)
		}
		if wl == 0 {
			if !bytes.Equal(blkReadFile(t, p), before) {
				t.Fatal("a request without a status byte changed the image")
			}
			return
		}
		var w []byte
		for _, b := range c.Writable {
			w = append(w, b...)
		}
		status := w[len(w)-1]
		if status > BlockStatusUnsupp {
			t.Fatalf("status %d", status)
		}
		var hdr [blockHeaderSize]byte
		short := blkGather(hdr[:], c.Readable) < blockHeaderSize
		typ := binary.LittleEndian.Uint32(hdr[:])
		sector := binary.LittleEndian.Uint64(hdr[8:])
		if short && status != BlockStatusIOErr {
			t.Fatalf("short header gave status %d", status)
		}
		if (readOnly || short || typ != BlockTypeOut || status != BlockStatusOK) && !bytes.Equal(blkReadFile(t, p), before) {
			t.Fatal("the image changed without a successful write")
		}
		if !short && typ == BlockTypeIn && status == BlockStatusOK {
			if !bytes.Equal(w[:len(w)-1], blkExpected(int(sector), len(w)-1)) {
				t.Fatal("a successful read returned the wrong data")
			}
		}
		if !short && typ == BlockTypeOut && status == BlockStatusOK {
			var payload []byte
			for _, b := range c.Readable {
				payload = append(payload, b...)
			}
			payload = payload[blockHeaderSize:]
			got := blkReadFile(t, p)[sector*BlockSectorSize:]
			if !bytes.Equal(got[:len(payload)], payload) {
				t.Fatal("a successful write did not reach the image")
			}
		}
	})
}

// TestBlockMMIO drives the device through a virtio-mmio transport as a
// driver does: config space, feature negotiation, queue setup, requests
// notified through QueueNotify, a queue the driver breaks (NEEDS_RESET),
// and a reset through Status.
func TestBlockMMIO(t *testing.T) {
	p := blkImage(t, "disk.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p, ReadOnly: true, ID: "mmio-disk"})
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: blkMemSize}})
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	d := &blkDriver{t: t, mem: mem, dev: dev, irq: make(chan struct{}, 1), errs: make(chan error), bufTop: blkBufBase}
	m := NewMMIO(dev, mem, func(level bool) {
		if level {
			select {
			case d.irq <- struct{}{}:
			default:
			}
		}
	})
	defer m.Reset()
	w := func(off uint64, v uint32) { m.Write(off, binary.LittleEndian.AppendUint32(nil, v)) }
	r := func(off uint64) uint32 {
		var b [4]byte
		m.Read(off, b[:])
		return binary.LittleEndian.Uint32(b[:])
	}
	d.kick = func() { w(regQueueNotify, 0) }
	d.ack = func() { w(regInterruptACK, r(regInterruptStatus)) }

	if r(regMagic) != mmioMagic || r(regDeviceID) != IDBlock {
		t.Fatalf("magic %#x device %d", r(regMagic), r(regDeviceID))
	}
	var capacity [8]byte
	m.Read(MMIOConfigOffset+0, capacity[:])
	if c := binary.LittleEndian.Uint64(capacity[:]); c != blkTestSectors {
		t.Errorf("capacity through the transport %d, want %d", c, blkTestSectors)
	}
	if bs := r(MMIOConfigOffset + 20); bs != BlockSectorSize {
		t.Errorf("blk_size through the transport %d", bs)
	}

	setup := func() {
		w(regStatus, StatusAcknowledge)
		w(regStatus, StatusAcknowledge|StatusDriver)
		w(regDeviceFeatSel, 0)
		lo := r(regDeviceFeatures)
		w(regDeviceFeatSel, 1)
		hi := r(regDeviceFeatures)
		offered := uint64(hi)<<32 | uint64(lo)
		want := uint64(BlockFeatureFlush | BlockFeatureSegMax | BlockFeatureBlkSize | BlockFeatureRO | FeatureVersion1)
		if offered&want != want {
			t.Fatalf("offered features %#x lack %#x", offered, want&^offered)
		}
		w(regDriverFeatSel, 0)
		w(regDriverFeatures, uint32(want))
		w(regDriverFeatSel, 1)
		w(regDriverFeatures, uint32(want>>32))
		w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
		if r(regStatus)&StatusFeaturesOK == 0 {
			t.Fatal("FEATURES_OK refused")
		}
		w(regQueueSel, 0)
		if n := r(regQueueNumMax); n != BlockQueueSize {
			t.Errorf("QueueNumMax %d, want %d", n, BlockQueueSize)
		}
		w(regQueueNum, blkQSize)
		w(regQueueDescLow, blkDescAddr)
		w(regQueueDriverLow, blkAvailAddr)
		w(regQueueDeviceLow, blkUsedAddr)
		w(regQueueReady, 1)
		clear(d.slice(0, blkBufBase))
		d.desc, d.avail, d.used = 0, 0, 0
		w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
		if st := r(regStatus); st&(StatusNeedsReset|StatusFailed) != 0 || st&StatusDriverOK == 0 {
			t.Fatalf("status %#x after DRIVER_OK", st)
		}
	}
	setup()

	if n, got := d.do(blkOut(blkHeader(BlockTypeIn, 4)), blkIn(1024), blkIn(1)); n != 1025 || !bytes.Equal(got, append(blkExpected(4, 1024), BlockStatusOK)) {
		t.Errorf("read through the transport: length %d, status %d, data ok %v", n, got[len(got)-1], bytes.Equal(got[:1024], blkExpected(4, 1024)))
	}
	if _, got := d.do(blkOut(blkHeader(BlockTypeOut, 4)), blkOut(make([]byte, 512)), blkIn(1)); got[0] != BlockStatusIOErr {
		t.Errorf("write to a read-only disk: status %d, want %d", got[0], BlockStatusIOErr)
	}
	if _, got := d.do(blkOut(blkHeader(BlockTypeGetID, 0)), blkIn(BlockIDBytes), blkIn(1)); string(got[:9]) != "mmio-disk" || got[9] != 0 {
		t.Errorf("get ID through the transport: %q", got)
	}

	// A chain whose buffer lies outside guest memory breaks the queue: the
	// device stops and the transport asks for a reset.
	d.add(blkOut(blkHeader(BlockTypeIn, 0)), blkSeg{raw: true, addr: 1 << 40, n: 512, write: true}, blkIn(1))
	d.kick()
	deadline := time.Now().Add(5 * time.Second)
	for r(regStatus)&StatusNeedsReset == 0 {
		if time.Now().After(deadline) {
			t.Fatal("a broken queue did not set NEEDS_RESET")
		}
		time.Sleep(time.Millisecond)
	}
	if err := m.Err(); !errors.Is(err, ErrMalformed) {
		t.Errorf("transport error %v does not wrap ErrMalformed", err)
	}

	// Reset through Status, then the device works again.
	w(regStatus, 0)
	if st := r(regStatus); st != 0 {
		t.Fatalf("status %#x after reset", st)
	}
	setup()
	if _, got := d.do(blkOut(blkHeader(BlockTypeFlush, 0)), blkIn(1)); got[0] != BlockStatusOK {
		t.Errorf("flush after reset: status %d", got[0])
	}
}

// TestBlockConcurrentRequests makes many reads and writes available at once,
// each spread over several buffers, and checks every one completes once with
// the right data: the workers run them concurrently and push in any order.
func TestBlockConcurrentRequests(t *testing.T) {
	p := blkImage(t, "disk.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p})
	d := newBlkDriver(t, dev)
	const n = blkTestSectors // reads of the first half of the disk, writes of the second
	type req struct {
		segs  []blkSeg
		write bool
		data  []byte
	}
	reqs := map[uint32]req{}
	for i := range n {
		var r req
		head := uint32(d.desc)
		if i < n/2 {
			r.segs = d.add(blkOut(blkHeader(BlockTypeIn, uint64(i))), blkIn(100), blkIn(412), blkIn(1))
		} else {
			r.write = true
			r.data = bytes.Repeat([]byte{byte(i)}, BlockSectorSize)
			r.segs = d.add(blkOut(blkHeader(BlockTypeOut, uint64(i))), blkOut(r.data[:300]), blkOut(r.data[300:]), blkIn(1))
		}
		reqs[head] = r
	}
	dev.QueueNotify(0)
	for range n {
		id, length := d.wait()
		r, ok := reqs[id]
		if !ok {
			t.Fatalf("completion of head %d: not an outstanding request", id)
		}
		delete(reqs, id)
		want := uint32(513)
		if r.write {
			want = 1
		}
		if length != want {
			t.Errorf("head %d: used length %d, want %d", id, length, want)
		}
		if st := d.bytes(r.segs[len(r.segs)-1]); st[0] != BlockStatusOK {
			t.Errorf("head %d: status %d", id, st[0])
		}
		if !r.write {
			got := append(d.bytes(r.segs[1]), d.bytes(r.segs[2])...)
			sector := int(binary.LittleEndian.Uint64(d.bytes(r.segs[0])[8:]))
			if !bytes.Equal(got, blkExpected(sector, 512)) {
				t.Errorf("head %d: read of sector %d returned the wrong data", id, sector)
			}
		}
	}
	img := blkReadFile(t, p)
	for i := n / 2; i < n; i++ {
		if got := img[i*BlockSectorSize : (i+1)*BlockSectorSize]; !bytes.Equal(got, bytes.Repeat([]byte{byte(i)}, BlockSectorSize)) {
			t.Errorf("sector %d not written", i)
		}
	}
}

// TestBlkVectored checks the loop around preadv/pwritev: short transfers
// and EINTR go on where they stopped, more than IOV_MAX buffers are split,
// a transfer that ends early is an error.
func TestBlkVectored(t *testing.T) {
	src := make([]byte, 5000)
	for i := range src {
		src[i] = byte(i * 13)
	}
	tests := []struct {
		name    string
		bufs    []int // buffer lengths
		chunk   int   // most bytes one call moves
		eintr   bool  // the first call fails with EINTR
		limit   int   // bytes available from the offset on
		want    int
		wantErr bool
	}{
		{name: "one call", bufs: []int{100, 200, 300}, chunk: 1 << 20, limit: 5000, want: 600},
		{name: "short transfers", bufs: []int{100, 0, 200, 300}, chunk: 7, limit: 5000, want: 600},
		{name: "EINTR first", bufs: []int{512}, chunk: 1 << 20, eintr: true, limit: 5000, want: 512},
		{name: "more than IOV_MAX", bufs: slices.Repeat([]int{2}, 2000), chunk: 1 << 20, limit: 5000, want: 4000},
		{name: "past the end", bufs: []int{300, 300}, chunk: 1 << 20, limit: 450, want: 450, wantErr: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var iov [][]byte
			for _, l := range tt.bufs {
				iov = append(iov, make([]byte, l))
			}
			orig := slices.Clone(iov)
			calls, eintr := 0, tt.eintr
			op := func(fd int, v [][]byte, off int64) (int, error) {
				calls++
				if len(v) > blkMaxIov {
					t.Fatalf("a call with %d buffers", len(v))
				}
				if eintr {
					eintr = false
					return 0, unix.EINTR
				}
				k := 0
				for _, b := range v {
					for i := range b {
						if k == tt.chunk || int(off)+k >= tt.limit {
							return k, nil
						}
						b[i] = src[int(off)+k]
						k++
					}
				}
				return k, nil
			}
			n, err := blkVectored(op, -1, iov, 0)
			if n != tt.want || (err != nil) != tt.wantErr {
				t.Fatalf("got %d, %v; want %d, error %v", n, err, tt.want, tt.wantErr)
			}
			var got []byte
			for _, b := range orig {
				got = append(got, b...)
			}
			if !bytes.Equal(got[:n], src[:n]) {
				t.Error("the bytes moved are not the source's, in order")
			}
		})
	}
}

// TestBlockMultiQueue: a device of three queues serves a read on each
// queue the driver made ready, each completion on its own used ring, after
// a kick of that queue alone; without MQ negotiated only queue 0 is
// served; a Reset stops them all.
func TestBlockMultiQueue(t *testing.T) {
	p := blkImage(t, "mq.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p, ReadOnly: true, Queues: 3})
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: blkMemSize}})
	if err != nil {
		t.Fatal(err)
	}
	defer mem.Close()
	defer dev.Reset()
	start := func(features uint64, ready int) []*blkDriver {
		var ds []*blkDriver
		var qs []*Queue
		for i := range 3 {
			d := &blkDriver{t: t, mem: mem, dev: dev, irq: make(chan struct{}, 1), errs: make(chan error, 4),
				ring: uint64(i) * 0x4000, bufOff: uint64(i) << 20}
			d.bufTop = blkBufBase + d.bufOff
			d.kick = func() { dev.QueueNotify(i) }
			d.ack = func() {}
			clear(d.slice(d.ring, 0x4000))
			d.q = &Queue{Size: blkQSize, Ready: i < ready, DescAddr: d.ring + blkDescAddr, DriverAddr: d.ring + blkAvailAddr, DeviceAddr: d.ring + blkUsedAddr}
			if d.q.Ready {
				irq := func() {
					select {
					case d.irq <- struct{}{}:
					default:
					}
				}
				if err := d.q.activate(mem, features, irq, func(err error) { d.errs <- err }); err != nil {
					t.Fatal(err)
				}
			}
			ds, qs = append(ds, d), append(qs, d.q)
		}
		if err := dev.Activate(mem, features, qs); err != nil {
			t.Fatal(err)
		}
		return ds
	}
	features := uint64(FeatureVersion1) | dev.Features()
	ds := start(features, 3)
	for i := 2; i >= 0; i-- {
		sector := 3 * i
		n, w := ds[i].do(blkOut(blkHeader(BlockTypeIn, uint64(sector))), blkIn(2*BlockSectorSize), blkIn(1))
		if n != 2*BlockSectorSize+1 || w[len(w)-1] != BlockStatusOK || !bytes.Equal(w[:2*BlockSectorSize], blkExpected(sector, 2*BlockSectorSize)) {
			t.Errorf("queue %d: read of sector %d: length %d status %d", i, sector, n, w[len(w)-1])
		}
	}
	if err := dev.Activate(mem, features, nil); err == nil {
		t.Error("activated twice, or with no queues")
	}
	dev.Reset()
	// Without MQ only queue 0 is served: a request on queue 1 waits.
	ds = start(features&^BlockFeatureMQ, 3)
	ds[1].add(blkOut(blkHeader(BlockTypeIn, 0)), blkIn(BlockSectorSize), blkIn(1))
	ds[1].kick()
	if n, _ := ds[0].do(blkOut(blkHeader(BlockTypeIn, 0)), blkIn(BlockSectorSize), blkIn(1)); n != BlockSectorSize+1 {
		t.Errorf("queue 0 without MQ: length %d", n)
	}
	if idx := binary.LittleEndian.Uint16(ds[1].slice(ds[1].ring+blkUsedAddr+2, 2)); idx != 0 {
		t.Errorf("queue 1 served without MQ: used index %d", idx)
	}
	dev.Reset()
	// A driver that readied two of three queues: both served.
	ds = start(features, 2)
	if n, _ := ds[1].do(blkOut(blkHeader(BlockTypeIn, 0)), blkIn(BlockSectorSize), blkIn(1)); n != BlockSectorSize+1 {
		t.Errorf("queue 1 of 2 ready: length %d", n)
	}
	dev.QueueNotify(2)  // not ready: ignored
	dev.QueueNotify(7)  // no such queue: ignored
	dev.QueueNotify(-1) // likewise
}

// TestBlockIdleWorkers checks that a disk's workers end once no request
// waits: an idle disk keeps its dispatcher only, and a later request
// starts a worker again.
func TestBlockIdleWorkers(t *testing.T) {
	p := blkImage(t, "disk.img", blkTestSectors*BlockSectorSize)
	dev := newTestBlock(t, BlockConfig{Path: p})
	d := newBlkDriver(t, dev)
	workers := func() int {
		var b strings.Builder
		pprof.Lookup("goroutine").WriteTo(&b, 1)
		return strings.Count(b.String(), "virtio.(*Block).work")
	}
	settle := func() int {
		deadline := time.Now().Add(10 * time.Second)
		for workers() > 0 && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		return workers()
	}
	for round := range 2 {
		for s := range 4 {
			d.add(blkOut(blkHeader(BlockTypeIn, uint64(s))), blkIn(512), blkIn(1))
		}
		dev.QueueNotify(0)
		for range 4 {
			if _, n := d.wait(); n != 513 {
				t.Fatalf("round %d: a read completed with %d bytes, want 513", round, n)
			}
		}
		if n := settle(); n != 0 {
			t.Fatalf("round %d: %d workers left on an idle disk", round, n)
		}
	}
}
