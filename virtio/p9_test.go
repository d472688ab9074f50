package virtio

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"

	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hugelgupf/p9/linux"
	"github.com/hugelgupf/p9/p9"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/ninep"
	"github.com/kilnvm/kiln/rofs"
)

// p9TestFS is a small rofs.FS: / holds hello, big, slow and dir/. A read
// of slow blocks until release is closed or its ctx ends.
type p9TestFS struct {
	release chan struct{}
	started chan struct{}
}

const (
	p9InoRoot = 1 + iota
	p9InoHello
	p9InoBig
	p9InoSlow
	p9InoDir
)

const (
	p9Hello   = "hello from the tree\n"
	p9BigSize = 300000
)

func p9BigByte(off int64) byte { return byte(off*7 + off>>10) }

func newP9TestFS() *p9TestFS {
	return &p9TestFS{release: make(chan struct{}), started: make(chan struct{}, 64)}
}

var p9Names = map[string]uint64{"hello": p9InoHello, "big": p9InoBig, "slow": p9InoSlow, "dir": p9InoDir}

func (f *p9TestFS) Root() uint64 { return p9InoRoot }

func (f *p9TestFS) Getattr(ino uint64) (rofs.Attr, error) {
	a := rofs.Attr{Ino: ino, Nlink: 1, Mtime: time.Unix(1700000000, 0)}
	switch ino {
	case p9InoRoot, p9InoDir:
		a.Mode, a.Nlink = syscall.S_IFDIR|0o755, 2
	case p9InoHello:
		a.Mode, a.Size = syscall.S_IFREG|0o644, int64(len(p9Hello))
	case p9InoBig:
		a.Mode, a.Size = syscall.S_IFREG|0o644, p9BigSize
	case p9InoSlow:
		a.Mode, a.Size = syscall.S_IFREG|0o644, 10
	default:
		return rofs.Attr{}, fmt.Errorf("inode %d: %w", ino, syscall.ENOENT)
	}
	return a, nil
}

func (f *p9TestFS) Lookup(dir uint64, name string) (uint64, error) {
	if dir == p9InoDir {
		return 0, syscall.ENOENT
	}
	if dir != p9InoRoot {
		return 0, syscall.ENOTDIR
	}
	if ino, ok := p9Names[name]; ok {
		return ino, nil
	}
	return 0, syscall.ENOENT
}

func (f *p9TestFS) ReadDir(dir uint64) ([]rofs.Dirent, error) {
	switch dir {
	case p9InoRoot:
		return []rofs.Dirent{{Name: "big", Ino: p9InoBig, Mode: syscall.S_IFREG}, {Name: "dir", Ino: p9InoDir, Mode: syscall.S_IFDIR},
			{Name: "hello", Ino: p9InoHello, Mode: syscall.S_IFREG}, {Name: "slow", Ino: p9InoSlow, Mode: syscall.S_IFREG}}, nil
	case p9InoDir:
		return nil, nil
	}
	return nil, syscall.ENOTDIR
}

func (f *p9TestFS) Readlink(ino uint64) (string, error) { return "", syscall.EINVAL }

func (f *p9TestFS) ReadAt(ctx context.Context, ino uint64, p []byte, off int64) (int, error) {
	var size int64
	switch ino {
	case p9InoHello:
		if off >= int64(len(p9Hello)) {
			return 0, io.EOF
		}
		n := copy(p, p9Hello[off:])
		if n < len(p) {
			return n, io.EOF
		}
		return n, nil
	case p9InoBig:
		size = p9BigSize
	case p9InoSlow:
		f.started <- struct{}{}
		select {
		case <-f.release:
			return copy(p, "slow data!"), io.EOF
		case <-ctx.Done():
			return 0, ctx.Err()
		}
	default:
		return 0, syscall.EINVAL
	}
	n := 0
	for ; n < len(p) && off+int64(n) < size; n++ {
		p[n] = p9BigByte(off + int64(n))
	}
	if n < len(p) {
		return n, io.EOF
	}
	return n, nil
}

func (f *p9TestFS) Getxattr(ino uint64, name string) ([]byte, error) { return nil, syscall.ENODATA }
func (f *p9TestFS) Listxattr(ino uint64) ([]string, error)           { return nil, nil }
func (f *p9TestFS) StatFS() rofs.StatFS {
	return rofs.StatFS{BlockSize: 4096, Blocks: 74, Files: 5, NameLen: 255}
}

// p9Msg builds a T-message from uint8/uint16/uint32/uint64/string/[]byte
// fields, by the protocol's layouts.
func p9Msg(typ uint8, tag uint16, fields ...any) []byte {
	b := make([]byte, 7)
	b[4] = typ
	binary.LittleEndian.PutUint16(b[5:], tag)
	for _, f := range fields {
		switch v := f.(type) {
		case uint8:
			b = append(b, v)
		case uint16:
			b = binary.LittleEndian.AppendUint16(b, v)
		case uint32:
			b = binary.LittleEndian.AppendUint32(b, v)
		case uint64:
			b = binary.LittleEndian.AppendUint64(b, v)
		case string:
			b = binary.LittleEndian.AppendUint16(b, uint16(len(v)))
			b = append(b, v...)
		case []byte:
			b = append(b, v...)
		default:
			panic(fmt.Sprintf("p9Msg: %T", f))
		}
	}
	binary.LittleEndian.PutUint32(b, uint32(len(b)))
	return b
}

// 9P message types the tests send.
const (
	p9Tversion = 100
	p9Tattach  = 104
	p9Twalk    = 110
	p9Tlopen   = 12
	p9Tread    = 116
	p9Tgetattr = 24
	p9Tclunk   = 120
	p9Rlerror  = 7
	p9NoFid    = 0xffffffff
)

// Guest-physical layout of the 9p test driver: rings, then one buffer
// area per request slot.
const (
	p9DescAddr  = 0x1000
	p9AvailAddr = 0x2000
	p9UsedAddr  = 0x3000
	p9QSize     = 32
	p9Slots     = 8 // 4 descriptors each
	p9SlotBase  = 0x10000
	p9SlotSize  = 0x100000 // request at the start, reply buffers after 64 KiB
	p9MemSize   = p9SlotBase + p9Slots*p9SlotSize
)

// p9Driver plays the guest's 9pnet_virtio driver against a P9 device behind
// a real MMIO transport, in plain memory.
type p9Driver struct {
	t     testing.TB
	mem   *memory.Memory
	m     *MMIO
	dev   *P9
	avail uint16
	used  uint16
	// resp is each slot's writable buffers (address, length).
	resp [p9Slots][][2]uint64
}

func p9Memory(t testing.TB) *memory.Memory {
	t.Helper()
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: p9MemSize}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	return mem
}

func newP9Device(t testing.TB, tree rofs.FS, key string) *P9 {
	t.Helper()
	dev, err := NewFS(FSConfig{Tag: "kilnroot", FS: tree, Key: key, Workers: 4})
	if err != nil {
		t.Fatal(err)
	}
	return dev
}

// newP9Driver initializes the transport as Linux does and mounts: Tversion
// (msize 65536) and Tattach of fid 1.
func newP9Driver(t testing.TB, dev *P9) *p9Driver {
	t.Helper()
	d := &p9Driver{t: t, mem: p9Memory(t), dev: dev}
	d.m = NewMMIO(dev, d.mem, func(bool) {})
	t.Cleanup(d.m.Reset)
	w := d.write
	w(regStatus, 0)
	w(regStatus, StatusAcknowledge)
	w(regStatus, StatusAcknowledge|StatusDriver)
	w(regDeviceFeatSel, 0)
	if f := d.read(regDeviceFeatures); f&Feature9PMountTag == 0 {
		t.Fatalf("device features %#x lack MOUNT_TAG", f)
	}
	w(regDriverFeatSel, 0)
	w(regDriverFeatures, Feature9PMountTag)
	w(regDriverFeatSel, 1)
	w(regDriverFeatures, uint32(FeatureVersion1>>32))
	w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
	w(regQueueSel, 0)
	if max := d.read(regQueueNumMax); max != P9QueueSize {
		t.Fatalf("QueueNumMax %d", max)
	}
	w(regQueueNum, p9QSize)
	w(regQueueDescLow, p9DescAddr)
	w(regQueueDriverLow, p9AvailAddr)
	w(regQueueDeviceLow, p9UsedAddr)
	w(regQueueReady, 1)
	w(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
	if r := d.rpc(p9Msg(p9Tversion, 0xffff, uint32(65536), "9P2000.L")); r[4] != p9Tversion+1 {
		t.Fatalf("Tversion: % x", r)
	}
	if r := d.rpc(p9Msg(p9Tattach, 1, uint32(1), uint32(p9NoFid), "root", "", uint32(0))); r[4] != p9Tattach+1 {
		t.Fatalf("Tattach: % x", r)
	}
	return d
}

func (d *p9Driver) read(off uint64) uint32 {
	var b [4]byte
	d.m.Read(off, b[:])
	return binary.LittleEndian.Uint32(b[:])
}

func (d *p9Driver) write(off uint64, v uint32) {
	d.m.Write(off, binary.LittleEndian.AppendUint32(nil, v))
}

func (d *p9Driver) put(addr uint64, b []byte) {
	if err := d.mem.WriteAt(b, addr); err != nil {
		d.t.Fatal(err)
	}
}

func (d *p9Driver) get(addr, n uint64) []byte {
	b := make([]byte, n)
	if err := d.mem.ReadAt(b, addr); err != nil {
		d.t.Fatal(err)
	}
	return b
}

// submit lays out req in slot's readable buffer and writable buffers of
// the given sizes (65536 when none), makes the chain available and
// notifies. The chain's head is 4*slot.
func (d *p9Driver) submit(slot int, req []byte, respSizes ...int) {
	d.t.Helper()
	if len(respSizes) == 0 {
		respSizes = []int{65536}
	}
	d.submitBufs(slot, [][]byte{req}, respSizes)
}

// submitBufs is submit with the request split over readable buffers: at
// most 4 buffers in all.
func (d *p9Driver) submitBufs(slot int, reqs [][]byte, respSizes []int) {
	d.t.Helper()
	if len(reqs)+len(respSizes) > 4 {
		d.t.Fatal("at most 4 buffers")
	}
	base := uint64(p9SlotBase + slot*p9SlotSize)
	head := uint16(4 * slot)
	i := head
	last := head + uint16(len(reqs)+len(respSizes)) - 1
	desc := func(addr uint64, n int, flags uint16) {
		if i < last {
			flags |= descFNext
		}
		e := make([]byte, 16)
		binary.LittleEndian.PutUint64(e, addr)
		binary.LittleEndian.PutUint32(e[8:], uint32(n))
		binary.LittleEndian.PutUint16(e[12:], flags)
		binary.LittleEndian.PutUint16(e[14:], i+1)
		d.put(p9DescAddr+16*uint64(i), e)
		i++
	}
	addr := base
	for _, req := range reqs {
		d.put(addr, req)
		desc(addr, len(req), 0)
		addr += uint64(len(req)+15) &^ 15
	}
	d.resp[slot] = nil
	addr = base + 0x10000
	for _, n := range respSizes {
		d.put(addr, bytes.Repeat([]byte{0xee}, n))
		desc(addr, n, descFWrite)
		d.resp[slot] = append(d.resp[slot], [2]uint64{addr, uint64(n)})
		addr += uint64(n+4095) &^ 4095
	}
	ring := make([]byte, 2)
	binary.LittleEndian.PutUint16(ring, head)
	d.put(p9AvailAddr+4+2*uint64(d.avail%p9QSize), ring)
	d.avail++
	binary.LittleEndian.PutUint16(ring, d.avail)
	d.put(p9AvailAddr+2, ring)
	d.write(regQueueNotify, 0)
}

// wait returns the next used chain's slot and length.
func (d *p9Driver) wait() (slot int, n uint32) {
	d.t.Helper()
	start := time.Now()
	for binary.LittleEndian.Uint16(d.get(p9UsedAddr+2, 2)) == d.used {
		switch waited := time.Since(start); {
		case waited > 5*time.Second:
			d.t.Fatal("no reply within 5 s")
		case waited > time.Millisecond:
			time.Sleep(100 * time.Microsecond)
		default:
			runtime.Gosched()
		}
	}
	e := d.get(p9UsedAddr+4+8*uint64(d.used%p9QSize), 8)
	d.used++
	return int(binary.LittleEndian.Uint32(e)) / 4, binary.LittleEndian.Uint32(e[4:])
}

// reply returns the first n bytes of slot's writable buffers.
func (d *p9Driver) reply(slot int, n uint32) []byte {
	var b []byte
	for _, r := range d.resp[slot] {
		b = append(b, d.get(r[0], r[1])...)
	}
	if int(n) > len(b) {
		d.t.Fatalf("used length %d over %d writable bytes", n, len(b))
	}
	return b[:n]
}

// rpc runs one request in slot 0 and returns its reply.
func (d *p9Driver) rpc(req []byte, respSizes ...int) []byte {
	d.t.Helper()
	d.submit(0, req, respSizes...)
	slot, n := d.wait()
	if slot != 0 {
		d.t.Fatalf("reply in slot %d", slot)
	}
	r := d.reply(0, n)
	if len(r) < 7 || int(binary.LittleEndian.Uint32(r)) != len(r) {
		d.t.Fatalf("reply % x: size field and used length disagree", r)
	}
	return r
}

// walkOpen walks fid 1 to name into fid and opens it.
func (d *p9Driver) walkOpen(fid uint32, name string) {
	d.t.Helper()
	if r := d.rpc(p9Msg(p9Twalk, 2, uint32(1), fid, uint16(1), name)); r[4] != p9Twalk+1 {
		d.t.Fatalf("walk to %s: % x", name, r)
	}
	if r := d.rpc(p9Msg(p9Tlopen, 3, fid, uint32(0))); r[4] != p9Tlopen+1 {
		d.t.Fatalf("open %s: % x", name, r)
	}
}

func p9Errno(r []byte) syscall.Errno {
	if len(r) != 11 || r[4] != p9Rlerror {
		return 0
	}
	return syscall.Errno(binary.LittleEndian.Uint32(r[7:]))
}

func TestNewFS(t *testing.T) {
	tree := newP9TestFS()
	tests := []struct {
		name    string
		cfg     FSConfig
		wantErr string
	}{
		{"plain", FSConfig{Tag: "kilnroot", FS: tree}, ""},
		{"longest tag", FSConfig{Tag: strings.Repeat("t", P9MaxTagLen), FS: tree}, ""},
		{"workers", FSConfig{Tag: "t", FS: tree, Workers: 128}, ""},
		{"empty tag", FSConfig{FS: tree}, "want 1 to 64"},
		{"long tag", FSConfig{Tag: strings.Repeat("t", P9MaxTagLen+1), FS: tree}, "65 bytes"},
		{"space in tag", FSConfig{Tag: "kiln root", FS: tree}, "byte 0x20"},
		{"NUL in tag", FSConfig{Tag: "kiln\x00", FS: tree}, "byte 0x0"},
		{"no tree", FSConfig{Tag: "t"}, "no tree"},
		{"too many workers", FSConfig{Tag: "t", FS: tree, Workers: 129}, "129 workers"},
		{"negative workers", FSConfig{Tag: "t", FS: tree, Workers: -1}, "-1 workers"},
		{"msize too small", FSConfig{Tag: "t", FS: tree, MaxMsize: 100}, "msize 100"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dev, err := NewFS(tt.cfg)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("NewFS: %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if dev.ID() != ID9P || dev.Features() != Feature9PMountTag || len(dev.QueueSizes()) != 1 || dev.QueueSizes()[0] != P9QueueSize {
				t.Errorf("ID %d features %#x queues %v", dev.ID(), dev.Features(), dev.QueueSizes())
			}
			cfg := make([]byte, 2+len(tt.cfg.Tag)+4)
			for i := range cfg {
				cfg[i] = 0xaa
			}
			dev.ReadConfig(0, cfg)
			want := append(binary.LittleEndian.AppendUint16(nil, uint16(len(tt.cfg.Tag))), tt.cfg.Tag...)
			want = append(want, 0, 0, 0, 0)
			if !bytes.Equal(cfg, want) {
				t.Errorf("config space % x, want % x", cfg, want)
			}
			one := []byte{0xaa}
			dev.ReadConfig(2, one)
			if one[0] != tt.cfg.Tag[0] {
				t.Errorf("config byte 2 is %#x", one[0])
			}
			dev.ReadConfig(1<<40, one)
			if one[0] != 0 {
				t.Errorf("config past the end reads %#x", one[0])
			}
		})
	}
}

// TestP9RoundTrip mounts through the queue and reads, with the reply laid
// out as Linux lays out zero-copy reads: an 11-byte header buffer, then
// data pages.
func TestP9RoundTrip(t *testing.T) {
	tree := newP9TestFS()
	dev := newP9Device(t, tree, "sha256:one")
	d := newP9Driver(t, dev)
	if dev.Server().Msize() != 65536 {
		t.Fatalf("msize %d", dev.Server().Msize())
	}
	r := d.rpc(p9Msg(p9Twalk, 5, uint32(1), uint32(2), uint16(1), "hello"))
	if r[4] != p9Twalk+1 || binary.LittleEndian.Uint16(r[7:]) != 1 || binary.LittleEndian.Uint64(r[9+5:]) != p9InoHello {
		t.Fatalf("walk: % x", r)
	}
	r = d.rpc(p9Msg(p9Tgetattr, 6, uint32(2), uint64(0x7ff)))
	if r[4] != p9Tgetattr+1 || binary.LittleEndian.Uint64(r[7+8+13+4+4+4+8+8:]) != uint64(len(p9Hello)) {
		t.Fatalf("getattr: % x", r)
	}
	d.walkOpen(3, "hello")
	r = d.rpc(p9Msg(p9Tread, 7, uint32(3), uint64(6), uint32(100)))
	if r[4] != p9Tread+1 || string(r[11:]) != p9Hello[6:] {
		t.Fatalf("read: %q", r)
	}

	d.walkOpen(4, "big")
	for _, tt := range []struct {
		off   int64
		count uint32
		bufs  []int
	}{
		{0, 8192, []int{11, 4096, 4096}},
		{1000, 60000, []int{11, 40000, 25536}},
		{p9BigSize - 100, 8192, []int{11, 8192}},
		{0, 1 << 20, []int{11, 65536}}, // clamped to msize
		{0, 4096, []int{7, 4, 4096}},   // a header split at odd places
	} {
		r := d.rpc(p9Msg(p9Tread, 8, uint32(4), uint64(tt.off), tt.count), tt.bufs...)
		if r[4] != p9Tread+1 {
			t.Fatalf("read %d+%d: % x", tt.off, tt.count, r[:min(len(r), 16)])
		}
		n := int(binary.LittleEndian.Uint32(r[7:]))
		want := int(min(int64(tt.count), p9BigSize-tt.off, 65536-11))
		if total := 0; true {
			for _, b := range tt.bufs {
				total += b
			}
			want = min(want, total-11)
		}
		if n != want || len(r) != 11+n {
			t.Fatalf("read %d+%d into %v: %d bytes, want %d", tt.off, tt.count, tt.bufs, n, want)
		}
		for i := range n {
			if r[11+i] != p9BigByte(tt.off+int64(i)) {
				t.Fatalf("read %d+%d: byte %d wrong", tt.off, tt.count, i)
			}
		}
	}
	// A chain with no room for a reply is completed empty.
	d.submit(0, p9Msg(p9Tclunk, 9, uint32(3)), 8)
	if _, n := d.wait(); n != 0 {
		t.Errorf("chain with 8 writable bytes: used length %d", n)
	}
	if st := dev.Stats(); st.Requests < 10 || st.BytesRead == 0 || st.Dropped != 1 {
		t.Errorf("stats %+v", st)
	}
	if s := dev.Diagnose(); !strings.Contains(s, "tag=kilnroot") || !strings.Contains(s, "msize=65536") {
		t.Errorf("Diagnose: %s", s)
	}
}

// TestP9Concurrent blocks one read on a fetch and checks that others
// complete meanwhile, then flushes it: the read's reply is in the used ring
// before Rflush.
func TestP9Concurrent(t *testing.T) {
	tree := newP9TestFS()
	dev := newP9Device(t, tree, "k")
	d := newP9Driver(t, dev)
	d.walkOpen(2, "slow")
	d.walkOpen(3, "hello")
	d.submit(1, p9Msg(p9Tread, 100, uint32(2), uint64(0), uint32(10)))
	<-tree.started
	for i := range 6 {
		slot := 2 + i%5
		d.submit(slot, p9Msg(p9Tread, uint16(200+i), uint32(3), uint64(0), uint32(5)))
		got, n := d.wait()
		r := d.reply(got, n)
		if got != slot || string(r[11:]) != p9Hello[:5] || binary.LittleEndian.Uint16(r[5:]) != uint16(200+i) {
			t.Fatalf("read %d while another blocks: slot %d % x", i, got, r)
		}
	}
	d.submit(2, p9Msg(108, 300, uint16(100))) // Tflush of tag 100
	first, n1 := d.wait()
	second, n2 := d.wait()
	if first != 1 || second != 2 {
		t.Fatalf("used order: slots %d then %d, want the flushed read (1) then Rflush (2)", first, second)
	}
	if e := p9Errno(d.reply(1, n1)); e != syscall.EINTR {
		t.Errorf("flushed read: errno %v", e)
	}
	if r := d.reply(2, n2); r[4] != 109 || binary.LittleEndian.Uint16(r[5:]) != 300 {
		t.Errorf("Rflush: % x", r)
	}
}

// TestP9PauseAndState pauses with a read in flight (Pause waits for it),
// saves, restores into a new device over a copy of memory and reads on
// with the old fids.
func TestP9PauseAndState(t *testing.T) {
	tree := newP9TestFS()
	dev := newP9Device(t, tree, "sha256:tree")
	d := newP9Driver(t, dev)
	d.walkOpen(2, "slow")
	d.walkOpen(3, "big")
	d.submit(1, p9Msg(p9Tread, 100, uint32(2), uint64(0), uint32(10)))
	<-tree.started
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := d.m.Pause(ctx); err == nil || !strings.Contains(err.Error(), "1 chains still held") {
		t.Fatalf("Pause with a read blocked: %v", err)
	}
	paused := make(chan error, 1)
	go func() { paused <- d.m.Pause(context.Background()) }()
	time.Sleep(10 * time.Millisecond)
	close(tree.release) // the fetch completes
	if err := <-paused; err != nil {
		t.Fatal(err)
	}
	if slot, n := d.wait(); slot != 1 || string(d.reply(1, n)[11:]) != "slow data!" {
		t.Fatalf("the read that Pause waited for: slot %d", slot)
	}
	st, err := d.m.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	var saved MMIOState
	if err := json.Unmarshal(b, &saved); err != nil {
		t.Fatal(err)
	}
	var dst P9State
	if err := json.Unmarshal(saved.Device, &dst); err != nil || dst.Tag != "kilnroot" || dst.Key != "sha256:tree" || dst.Version != P9StateVersion {
		t.Fatalf("device state %s: %v", saved.Device, err)
	}

	// Another tree or another tag is refused, naming both.
	for _, tt := range []struct {
		cfg  FSConfig
		want string
	}{
		{FSConfig{Tag: "kilnroot", FS: tree, Key: "sha256:other"}, `serves tree "sha256:other", the snapshot's device served "sha256:tree"`},
		{FSConfig{Tag: "other", FS: tree, Key: "sha256:tree"}, `mount tag "other", the snapshot's device had "kilnroot"`},
	} {
		other, err := NewFS(tt.cfg)
		if err != nil {
			t.Fatal(err)
		}
		m := NewMMIO(other, copyP9Memory(t, d.mem), func(bool) {})
		if err := m.RestoreState(saved); err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("restore into %+v: %v, want %q", tt.cfg, err, tt.want)
		}
	}

	// The same tree, built again, in a new device over a copy of memory.
	dev2 := newP9Device(t, newP9TestFS(), "sha256:tree")
	d2 := &p9Driver{t: t, mem: copyP9Memory(t, d.mem), dev: dev2, avail: d.avail, used: d.used, resp: d.resp}
	d2.m = NewMMIO(dev2, d2.mem, func(bool) {})
	t.Cleanup(d2.m.Reset)
	if err := d2.m.RestoreState(saved); err != nil {
		t.Fatalf("RestoreState: %v", err)
	}
	if dev2.Server().Msize() != 65536 || dev2.Server().Fids() != dev.Server().Fids() {
		t.Fatalf("restored session: msize %d, %d fids", dev2.Server().Msize(), dev2.Server().Fids())
	}
	r := d2.rpc(p9Msg(p9Tread, 9, uint32(3), uint64(5000), uint32(100)))
	if r[4] != p9Tread+1 || len(r) != 111 || r[11] != p9BigByte(5000) {
		t.Fatalf("read with an old fid after restore: % x", r[:min(len(r), 16)])
	}
	// The original, resumed, serves on too.
	d.m.Resume()
	if r := d.rpc(p9Msg(p9Tread, 9, uint32(3), uint64(5000), uint32(100))); !bytes.Equal(r, d2.rpc(p9Msg(p9Tread, 9, uint32(3), uint64(5000), uint32(100)))) {
		t.Error("the original and the restored device answer differently")
	}
}

func copyP9Memory(t *testing.T, src *memory.Memory) *memory.Memory {
	t.Helper()
	dst := p9Memory(t)
	for i := range src.Regions() {
		copy(dst.Host(i), src.Host(i))
	}
	return dst
}

// TestP9Reset resets the device with a read blocked on a fetch: the read
// is cancelled and Reset returns.
func TestP9Reset(t *testing.T) {
	tree := newP9TestFS()
	dev := newP9Device(t, tree, "k")
	d := newP9Driver(t, dev)
	d.walkOpen(2, "slow")
	d.submit(1, p9Msg(p9Tread, 100, uint32(2), uint64(0), uint32(10)))
	<-tree.started
	done := make(chan struct{})
	go func() {
		d.m.Reset()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("Reset did not return with a read blocked")
	}
	if dev.Server().InFlight() != 0 {
		t.Errorf("%d requests in flight after Reset", dev.Server().InFlight())
	}
	// The device comes back after the driver sets it up again.
	d.avail, d.used = 0, 0
	d2 := newP9Driver(t, dev)
	if r := d2.rpc(p9Msg(p9Tclunk, 1, uint32(1))); r[4] != p9Tclunk+1 {
		t.Errorf("clunk after reset: % x", r)
	}
	if err := dev.Close(); err != nil {
		t.Error(err)
	}
}

func TestP9RestoreStateBad(t *testing.T) {
	dev := newP9Device(t, newP9TestFS(), "k")
	srv, _ := ninep.NewServer(newP9TestFS(), ninep.Options{}).SaveState()
	good := func(f func(*P9State)) json.RawMessage {
		st := P9State{Version: P9StateVersion, Tag: "kilnroot", Key: "k", Server: srv}
		f(&st)
		b, _ := json.Marshal(st)
		return b
	}
	tests := []struct {
		name  string
		state json.RawMessage
		want  string
	}{
		{"empty", nil, "no device state"},
		{"unknown field", json.RawMessage(`{"version":1,"tag":"kilnroot","key":"k","server":{},"x":1}`), "unknown field"},
		{"version", good(func(s *P9State) { s.Version = 9 }), "version 9"},
		{"bad server state", good(func(s *P9State) {
			s.Server = json.RawMessage(`{"version":1,"msize":4096,"fids":[{"fid":1,"path":[77]}]}`)
		}), "fid 1"},
		{"good", good(func(*P9State) {}), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := dev.RestoreState(tt.state)
			if tt.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("RestoreState: %v, want %q", err, tt.want)
			}
		})
	}
}

// TestP9ConcurrentLoad runs many reads at once from several slots, with
// the race detector watching the device's goroutines.
func TestP9ConcurrentLoad(t *testing.T) {
	tree := newP9TestFS()
	dev := newP9Device(t, tree, "k")
	d := newP9Driver(t, dev)
	d.walkOpen(3, "big")
	for round := range 20 {
		for slot := range p9Slots {
			d.submit(slot, p9Msg(p9Tread, uint16(slot), uint32(3), uint64(round*1000+slot), uint32(2000)))
		}
		seen := map[int]bool{}
		for range p9Slots {
			slot, n := d.wait()
			r := d.reply(slot, n)
			if seen[slot] || r[4] != p9Tread+1 || len(r) != 2011 || r[11] != p9BigByte(int64(round*1000+slot)) {
				t.Fatalf("round %d slot %d: % x", round, slot, r[:min(len(r), 16)])
			}
			seen[slot] = true
		}
	}
	if errs := dev.Stats().Errors; errs != 0 {
		t.Errorf("%d errors", errs)
	}
}

// BenchmarkP9Read measures Treads of 64 KiB through the queue, the reply
// laid out as Linux's zero-copy reads lay it out.
func BenchmarkP9Read(b *testing.B) {
	dev := newP9Device(b, newP9TestFS(), "k")
	d := newP9Driver(b, dev)
	d.walkOpen(3, "big")
	const count = 65536 - 11
	b.SetBytes(count)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		d.submit(0, p9Msg(p9Tread, 1, uint32(3), uint64(i%4)*count, uint32(count)), 11, count)
		if _, n := d.wait(); n != 65536 {
			b.Fatalf("Rread of %d bytes", n)
		}
	}
}

// p9Transport carries a 9P byte stream over the test driver's queue, as
// 9pnet_virtio does: each T-message is a chain in a free slot, each reply
// is written back as its chain completes.
func p9Transport(t *testing.T, d *p9Driver, conn net.Conn) {
	free := make(chan int, p9Slots)
	for i := 1; i < p9Slots; i++ { // slot 0 is the driver's own rpc slot
		free <- i
	}
	var mu sync.Mutex // the driver's rings
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { // requests
		defer wg.Done()
		for {
			var hdr [4]byte
			if _, err := io.ReadFull(conn, hdr[:]); err != nil {
				return
			}
			req := make([]byte, binary.LittleEndian.Uint32(hdr[:]))
			if len(req) < 7 || len(req) > 65536 {
				t.Errorf("client sent a %d-byte message", len(req))
				return
			}
			copy(req, hdr[:])
			if _, err := io.ReadFull(conn, req[4:]); err != nil {
				return
			}
			var slot int
			select {
			case slot = <-free:
			case <-done:
				return
			}
			mu.Lock()
			d.submit(slot, req)
			mu.Unlock()
		}
	}()
	go func() { // replies
		defer wg.Done()
		for {
			mu.Lock()
			busy := binary.LittleEndian.Uint16(d.get(p9UsedAddr+2, 2)) != d.used
			var slot int
			var r []byte
			if busy {
				var n uint32
				slot, n = d.wait()
				r = d.reply(slot, n)
			}
			mu.Unlock()
			if !busy {
				select {
				case <-done:
					return
				case <-time.After(50 * time.Microsecond):
				}
				continue
			}
			free <- slot
			if _, err := conn.Write(r); err != nil {
				return
			}
		}
	}()
	t.Cleanup(func() {
		close(done)
		conn.Close()
		wg.Wait()
	})
}

// TestP9ClientThroughQueue runs hugelgupf/p9's client against the device
// through the virtqueue: the acceptance path of a guest's mount, without
// a guest.
func TestP9ClientThroughQueue(t *testing.T) {
	dev := newP9Device(t, newP9TestFS(), "k")
	d := newP9Driver(t, dev)
	cc, sc := net.Pipe()
	p9Transport(t, d, sc)
	c, err := p9.NewClient(cc, p9.WithMessageSize(65536))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	root, err := c.Attach("")
	if err != nil {
		t.Fatal(err)
	}
	ents := func() []string {
		_, dir, err := root.Walk(nil)
		if err != nil {
			t.Fatal(err)
		}
		defer dir.Close()
		if _, _, err := dir.Open(p9.ReadOnly); err != nil {
			t.Fatal(err)
		}
		var names []string
		for off := uint64(0); ; {
			es, err := dir.Readdir(off, 100)
			if err != nil {
				t.Fatal(err)
			}
			if len(es) == 0 {
				return names
			}
			for _, e := range es {
				names = append(names, e.Name)
				off = e.Offset
			}
		}
	}()
	if fmt.Sprint(ents) != "[. .. big dir hello slow]" {
		t.Errorf("root entries %v", ents)
	}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, f, err := root.Walk([]string{"big"})
			if err != nil {
				t.Error(err)
				return
			}
			defer f.Close()
			if _, _, err := f.Open(p9.ReadOnly); err != nil {
				t.Error(err)
				return
			}
			_, _, attr, err := f.GetAttr(p9.AttrMaskAll)
			if err != nil || attr.Size != p9BigSize {
				t.Errorf("getattr: %v %v", attr, err)
				return
			}
			buf := make([]byte, p9BigSize)
			n, err := f.ReadAt(buf, 0)
			if err != nil || n != p9BigSize {
				t.Errorf("reader %d: %d bytes, %v", g, n, err)
				return
			}
			for i := range buf {
				if buf[i] != p9BigByte(int64(i)) {
					t.Errorf("reader %d: byte %d wrong", g, i)
					return
				}
			}
		}()
	}
	wg.Wait()
	_, _, err = root.Walk([]string{"nothere"})
	var errno linux.Errno
	if !errors.As(err, &errno) || errno != linux.ENOENT {
		t.Errorf("walk to a missing name: %v", err)
	}
	_, _, _, err = root.Create("x", p9.ReadWrite, 0o644, 0, 0)
	if !errors.As(err, &errno) || errno != linux.EROFS {
		t.Errorf("create: %v", err)
	}
}
