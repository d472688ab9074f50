package virtio

import (
	"bytes"
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func newTestSlot(t *testing.T, id string) *Block {
	t.Helper()
	b, err := NewBlockSlot(BlockConfig{ID: id})
	if err != nil {
		t.Fatalf("NewBlockSlot: %v", err)
	}
	t.Cleanup(func() {
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return b
}

func openImage(t *testing.T, p string, flag int) *os.File {
	t.Helper()
	f, err := os.OpenFile(p, flag, 0)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func blkConfigCapacity(b *Block) uint64 {
	var c [8]byte
	b.ReadConfig(blockCfgCapacity, c[:])
	return binary.LittleEndian.Uint64(c[:])
}

// TestBlockSlotInsert fills an empty slot while its queue is served: the
// empty slot refuses reads, the filled one serves the image, and a second
// insert is refused.
func TestBlockSlotInsert(t *testing.T) {
	p := blkImage(t, "vol.img", blkTestSectors*BlockSectorSize)
	dev := newTestSlot(t, "vol0")
	if dev.Features()&BlockFeatureRO != 0 {
		t.Error("an empty slot offers VIRTIO_BLK_F_RO")
	}
	if slot, filled := dev.Slot(); !slot || filled {
		t.Errorf("Slot() = %v, %v; want true, false", slot, filled)
	}
	if c := blkConfigCapacity(dev); c != 0 || dev.Capacity() != 0 {
		t.Errorf("empty slot capacity %d (config %d), want 0", dev.Capacity(), c)
	}
	d := newBlkDriver(t, dev)
	if _, w := d.do(blkOut(blkHeader(BlockTypeIn, 0)), blkIn(512), blkIn(1)); w[len(w)-1] != BlockStatusIOErr {
		t.Errorf("read of an empty slot: status %d, want IOERR", w[len(w)-1])
	}
	if _, w := d.do(blkOut(blkHeader(BlockTypeGetID, 0)), blkIn(BlockIDBytes), blkIn(1)); !bytes.HasPrefix(w, []byte("vol0\x00")) {
		t.Errorf("GET_ID of an empty slot: %q", w)
	}

	if err := dev.Insert(openImage(t, p, os.O_RDWR), false, p); err != nil {
		t.Fatalf("Insert: %v", err)
	}
	if slot, filled := dev.Slot(); !slot || !filled {
		t.Errorf("Slot() = %v, %v; want true, true", slot, filled)
	}
	if c := blkConfigCapacity(dev); c != blkTestSectors || dev.Capacity() != blkTestSectors {
		t.Errorf("filled slot capacity %d (config %d), want %d", dev.Capacity(), c, blkTestSectors)
	}
	if _, w := d.do(blkOut(blkHeader(BlockTypeIn, 2)), blkIn(512), blkIn(1)); w[512] != BlockStatusOK || !bytes.Equal(w[:512], blkExpected(2, 512)) {
		t.Errorf("read after insert: status %d, data ok %v", w[512], bytes.Equal(w[:512], blkExpected(2, 512)))
	}
	data := bytes.Repeat([]byte{0x5a}, 512)
	if _, w := d.do(blkOut(blkHeader(BlockTypeOut, 3)), blkOut(data), blkIn(1)); w[0] != BlockStatusOK {
		t.Errorf("write after insert: status %d", w[0])
	}
	if _, w := d.do(blkOut(blkHeader(BlockTypeFlush, 0)), blkIn(1)); w[0] != BlockStatusOK {
		t.Errorf("flush after insert: status %d", w[0])
	}
	if got := blkReadFile(t, p)[3*512 : 4*512]; !bytes.Equal(got, data) {
		t.Error("the write did not reach the image")
	}

	q := blkImage(t, "other.img", 4*BlockSectorSize)
	f := openImage(t, q, os.O_RDWR)
	defer f.Close()
	if err := dev.Insert(f, false, q); err == nil || !strings.Contains(err.Error(), "already holds") {
		t.Errorf("second Insert: %v, want an error saying the slot is filled", err)
	}
}

// TestBlockSlotInsertRefused checks what Insert refuses; the caller keeps
// the file then.
func TestBlockSlotInsertRefused(t *testing.T) {
	dir := t.TempDir()
	good := blkImage(t, "good.img", 4*BlockSectorSize)
	odd := filepath.Join(dir, "odd.img")
	empty := filepath.Join(dir, "empty.img")
	for p, n := range map[string]int{odd: 1000, empty: 0} {
		if err := os.WriteFile(p, make([]byte, n), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name     string
		dev      func(t *testing.T) *Block
		path     string
		flag     int
		readOnly bool
		wantErr  string
	}{
		{"not a slot", func(t *testing.T) *Block { return newTestBlock(t, BlockConfig{Path: blkImage(t, "d.img", 512)}) }, good, os.O_RDWR, false, "not a volume slot"},
		{"read-only file, read-write volume", func(t *testing.T) *Block { return newTestSlot(t, "vol0") }, good, os.O_RDONLY, false, "open read-only"},
		{"odd size", func(t *testing.T) *Block { return newTestSlot(t, "vol0") }, odd, os.O_RDWR, false, "positive multiple"},
		{"empty image", func(t *testing.T) *Block { return newTestSlot(t, "vol0") }, empty, os.O_RDWR, false, "positive multiple"},
		{"closed slot", func(t *testing.T) *Block {
			b, err := NewBlockSlot(BlockConfig{ID: "vol0"})
			if err != nil {
				t.Fatal(err)
			}
			b.Close()
			return b
		}, good, os.O_RDWR, false, "closed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dev := tt.dev(t)
			f := openImage(t, tt.path, tt.flag)
			defer f.Close()
			err := dev.Insert(f, tt.readOnly, tt.path)
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("Insert: %v, want an error with %q", err, tt.wantErr)
			}
			if _, err := f.Stat(); err != nil {
				t.Errorf("a refused Insert closed the file: %v", err)
			}
		})
	}
	if _, err := NewBlockSlot(BlockConfig{}); err == nil {
		t.Error("NewBlockSlot without an ID: no error")
	}
}

// TestBlockSlotReadOnly checks that a read-only volume answers writes and
// flushes with IOERR, serves reads, and is never offered as read-only.
func TestBlockSlotReadOnly(t *testing.T) {
	p := blkImage(t, "ro.img", blkTestSectors*BlockSectorSize)
	before := blkReadFile(t, p)
	dev := newTestSlot(t, "vol1")
	d := newBlkDriver(t, dev)
	if err := dev.Insert(openImage(t, p, os.O_RDONLY), true, p); err != nil {
		t.Fatalf("Insert: %v", err)
	}
	if dev.Features()&BlockFeatureRO != 0 {
		t.Error("a slot offers VIRTIO_BLK_F_RO")
	}
	tests := []struct {
		name   string
		segs   []blkSeg
		status byte
	}{
		{"write refused", []blkSeg{blkOut(blkHeader(BlockTypeOut, 0)), blkOut(make([]byte, 512)), blkIn(1)}, BlockStatusIOErr},
		{"flush refused", []blkSeg{blkOut(blkHeader(BlockTypeFlush, 0)), blkIn(1)}, BlockStatusIOErr},
		{"read allowed", []blkSeg{blkOut(blkHeader(BlockTypeIn, 1)), blkIn(512), blkIn(1)}, BlockStatusOK},
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
		t.Error("a read-only volume's image changed")
	}
}

// TestBlockSlotState round-trips the state of an empty and a filled slot,
// and refuses a restore into the wrong disk.
func TestBlockSlotState(t *testing.T) {
	p := blkImage(t, "vol.img", blkTestSectors*BlockSectorSize)
	small := blkImage(t, "small.img", 4*BlockSectorSize)

	empty := newTestSlot(t, "vol0")
	emptySt, err := empty.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	filled := newTestSlot(t, "vol0")
	if err := filled.Insert(openImage(t, p, os.O_RDONLY), true, p); err != nil {
		t.Fatal(err)
	}
	filledSt, err := filled.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	reopen := func(path string, slot bool) func(t *testing.T) *Block {
		return func(t *testing.T) *Block {
			return newTestBlock(t, BlockConfig{Path: path, ID: "vol0", ReadOnly: true, Slot: slot})
		}
	}
	tests := []struct {
		name    string
		state   []byte
		dev     func(t *testing.T) *Block
		wantErr string
	}{
		{"empty into empty", emptySt, func(t *testing.T) *Block { return newTestSlot(t, "vol0") }, ""},
		{"empty into filled", emptySt, reopen(p, true), "sectors"},
		{"empty into other serial", emptySt, func(t *testing.T) *Block { return newTestSlot(t, "vol1") }, "ID"},
		{"filled into same image", filledSt, reopen(p, true), ""},
		{"filled into empty", filledSt, func(t *testing.T) *Block { return newTestSlot(t, "vol0") }, "sectors"},
		{"filled into smaller image", filledSt, reopen(small, true), "sectors"},
		{"filled into a disk that is no slot", filledSt, reopen(p, false), "volume slot"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.dev(t).RestoreState(tt.state)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatalf("RestoreState: %v", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("RestoreState: %v, want an error with %q", err, tt.wantErr)
			}
		})
	}
}

// TestOpenSlot opens empty and filled slots from specs.
func TestOpenSlot(t *testing.T) {
	p := blkImage(t, "vol.img", blkTestSectors*BlockSectorSize)
	tests := []struct {
		name     string
		spec     BlockSpec
		capacity uint64
	}{
		{"empty", BlockSpec{Slot: true, Serial: "vol0"}, 0},
		{"filled read-only", BlockSpec{Slot: true, Serial: "vol0", Path: p, ReadOnly: true}, blkTestSectors},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := DeviceSpec{ID: "vol0", Kind: KindBlock, Block: &tt.spec}
			dev, err := Open(s, nil)
			if err != nil {
				t.Fatalf("Open: %v", err)
			}
			defer dev.(*Block).Close()
			b := dev.(*Block)
			if slot, filled := b.Slot(); !slot || filled != (tt.capacity > 0) {
				t.Errorf("Slot() = %v, %v", slot, filled)
			}
			if b.Capacity() != tt.capacity || b.Features()&BlockFeatureRO != 0 {
				t.Errorf("capacity %d features %#x", b.Capacity(), b.Features())
			}
		})
	}
	if err := (DeviceSpec{ID: "d", Kind: KindBlock, Block: &BlockSpec{}}).Validate(); err == nil {
		t.Error("a disk that is no slot and has no image: valid")
	}
}
