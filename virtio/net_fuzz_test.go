package virtio

import (
	"bytes"
	"encoding/binary"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"testing"

	"github.com/kilnvm/kiln/memory"
)

// Guest memory of the net fuzz targets: a 16-entry queue's rings at fixed
// places, the rest (and the descriptor table) whatever the fuzzer writes.
const (
	netFuzzRAM   = 0x10000
	netFuzzDesc  = 0x0
	netFuzzAvail = 0x100
	netFuzzUsed  = 0x200
	netFuzzSize  = 16
)

// netFuzzTap is a tap that records what the device writes and has nothing
// to read until it is closed.
type netFuzzTap struct {
	mu     sync.Mutex
	frames [][]byte
	closed chan struct{}
	once   sync.Once
}

func (p *netFuzzTap) Read(b []byte) (int, error) {
	<-p.closed
	return 0, os.ErrClosed
}

func (p *netFuzzTap) Write(b []byte) (int, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.frames = append(p.frames, bytes.Clone(b))
	return len(b), nil
}

func (p *netFuzzTap) Close() error {
	p.once.Do(func() { close(p.closed) })
	return nil
}

// netFuzzSetup lays ram out as guest memory, makes heads available in a
// 16-entry queue (features: INDIRECT_DESC and EVENT_IDX per bits 0 and 1
// of feat) and returns a device over a recording tap with that queue as
// both rx and tx, not started (the caller drives receive or drainTx), and
// the guest memory as the driver left it.
func netFuzzSetup(t *testing.T, ram, heads []byte, feat byte) (*Net, *netFuzzTap, *netActivation, *memory.Memory, []byte) {
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: netFuzzRAM}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	want := make([]byte, netFuzzRAM)
	copy(want, ram)
	heads = heads[:min(len(heads), netFuzzSize)]
	avail := want[netFuzzAvail:]
	clear(avail[:4+2*netFuzzSize+2])
	binary.LittleEndian.PutUint16(avail[2:], uint16(len(heads)))
	for i, h := range heads {
		binary.LittleEndian.PutUint16(avail[4+2*i:], uint16(h))
	}
	clear(want[netFuzzUsed : netFuzzUsed+6+8*netFuzzSize])
	if err := mem.WriteAt(want, 0); err != nil {
		t.Fatal(err)
	}
	features := uint64(FeatureVersion1)
	if feat&1 != 0 {
		features |= FeatureIndirectDesc
	}
	if feat&2 != 0 {
		features |= FeatureEventIdx
	}
	q := &Queue{Size: netFuzzSize, Ready: true, DescAddr: netFuzzDesc, DriverAddr: netFuzzAvail, DeviceAddr: netFuzzUsed}
	if err := q.activate(mem, features, func() {}, func(error) {}); err != nil {
		t.Fatal(err)
	}
	tap := &netFuzzTap{closed: make(chan struct{})}
	n := newNet(tap, "fuzz0", net.HardwareAddr{0x52, 0x54, 0, 1, 2, 3}, slog.New(slog.NewTextHandler(io.Discard, nil)))
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
	})
	a := &netActivation{rx: q, tx: q, rxKick: make(chan struct{}, 1), txKick: make(chan struct{}, 1), done: make(chan struct{})}
	n.mu.Lock()
	n.act = a
	n.mu.Unlock()
	return n, tap, a, mem, want
}

// netFuzzUsed returns the used ring's entries.
func netFuzzUsedElems(t *testing.T, mem *memory.Memory) (elems [][2]uint32) {
	var r [4 + 8*netFuzzSize]byte
	if err := mem.ReadAt(r[:], netFuzzUsed); err != nil {
		t.Fatal(err)
	}
	idx := binary.LittleEndian.Uint16(r[2:])
	if idx > netFuzzSize {
		t.Fatalf("used idx %d after one pass over a %d-entry queue", idx, netFuzzSize)
	}
	for i := range int(idx) {
		elems = append(elems, [2]uint32{binary.LittleEndian.Uint32(r[4+8*i:]), binary.LittleEndian.Uint32(r[8+8*i:])})
	}
	return elems
}

// netFuzzChanged returns the guest memory bytes, outside the used ring, that
// differ from what the driver left.
func netFuzzChanged(t *testing.T, mem *memory.Memory, want []byte) []int {
	got := make([]byte, netFuzzRAM)
	if err := mem.ReadAt(got, 0); err != nil {
		t.Fatal(err)
	}
	var diff []int
	for a := range got {
		inUsed := a >= netFuzzUsed && a < netFuzzUsed+6+8*netFuzzSize
		if got[a] != want[a] && !inUsed {
			diff = append(diff, a)
		}
	}
	return diff
}

// FuzzNetTxQueue: the guest's transmit queue (descriptor table, buffers
// and the heads it makes available, all fuzzed) drained by the device.
// Every chain comes back used with length 0; the tap gets one frame per
// good chain, each with a zeroed virtio-net header and a length within
// [header+Ethernet header, header+NetMaxFrame], holding the chain's
// readable bytes after the guest's header; the counters add up; the device
// writes nothing in guest memory but the used ring.
func FuzzNetTxQueue(f *testing.F) {
	ram := make([]byte, 0x400)
	binary.LittleEndian.PutUint64(ram[0:], 0x1000) // desc 0: 12+60 readable bytes
	binary.LittleEndian.PutUint32(ram[8:], netHdrLen+60)
	binary.LittleEndian.PutUint64(ram[16:], 0x2000) // desc 1 -> 2: split frame
	binary.LittleEndian.PutUint32(ram[24:], 20)
	binary.LittleEndian.PutUint16(ram[28:], descFNext)
	binary.LittleEndian.PutUint16(ram[30:], 2)
	binary.LittleEndian.PutUint64(ram[32:], 0x3000)
	binary.LittleEndian.PutUint32(ram[40:], 100)
	f.Add(ram, []byte{0, 1, 2}, byte(0))
	f.Add(ram, []byte{1, 1, 15, 16}, byte(3))
	f.Add([]byte{}, []byte{}, byte(0))
	f.Fuzz(func(t *testing.T, ram, heads []byte, feat byte) {
		n, tap, a, mem, want := netFuzzSetup(t, ram, heads, feat)
		buf := make([]byte, netHdrLen+NetMaxFrame)
		err := n.drainTx(a, buf)
		used := netFuzzUsedElems(t, mem)
		if err == nil && len(used) != min(len(heads), netFuzzSize) {
			t.Fatalf("%d chains used of %d made available, and no error", len(used), len(heads))
		}
		for _, u := range used {
			if u[1] != 0 {
				t.Fatalf("tx chain %d used with length %d", u[0], u[1])
			}
		}
		st := n.Stats()
		if st.TxPackets != uint64(len(tap.frames)) || st.TxPackets+st.TxDropped != uint64(len(used)) {
			t.Fatalf("stats %+v: %d frames, %d chains used", st, len(tap.frames), len(used))
		}
		var bytesOut uint64
		for _, fr := range tap.frames {
			if len(fr) < netHdrLen+ethHdrLen || len(fr) > netHdrLen+NetMaxFrame {
				t.Fatalf("a %d-byte frame reached the tap", len(fr))
			}
			if !bytes.Equal(fr[:netHdrLen], make([]byte, netHdrLen)) {
				t.Fatalf("the guest's header reached the tap: % x", fr[:netHdrLen])
			}
			bytesOut += uint64(len(fr) - netHdrLen)
		}
		if st.TxBytes != bytesOut {
			t.Fatalf("TxBytes %d, frames hold %d", st.TxBytes, bytesOut)
		}
		if d := netFuzzChanged(t, mem, want); len(d) > 0 {
			t.Fatalf("transmit wrote guest memory at %#x (and %d more bytes)", d[0], len(d)-1)
		}
	})
}

// FuzzNetRx: a frame from the tap (any bytes, any claimed size) delivered
// into the guest's receive chain (fuzzed descriptor table and buffers). The
// frame is refused or lands whole: the used length is 0 or the frame's
// length, the header the guest sees is zero but num_buffers=1, the
// counters follow, and the device writes guest memory only inside the
// chain's writable buffers and the used ring.
func FuzzNetRx(f *testing.F) {
	ram := make([]byte, 0x400)
	binary.LittleEndian.PutUint64(ram[0:], 0x1000) // desc 0: 2000 writable bytes
	binary.LittleEndian.PutUint32(ram[8:], 2000)
	binary.LittleEndian.PutUint16(ram[12:], descFWrite)
	binary.LittleEndian.PutUint64(ram[16:], 0x2000) // desc 1 -> 2: two small buffers
	binary.LittleEndian.PutUint32(ram[24:], 30)
	binary.LittleEndian.PutUint16(ram[28:], descFWrite|descFNext)
	binary.LittleEndian.PutUint16(ram[30:], 2)
	binary.LittleEndian.PutUint64(ram[32:], 0x3000)
	binary.LittleEndian.PutUint32(ram[40:], 40)
	binary.LittleEndian.PutUint16(ram[44:], descFWrite)
	frame := append(netTestHdr(0, 0), netTestFrame(60)...)
	f.Add(ram, byte(0), frame, uint32(len(frame)), byte(0))
	f.Add(ram, byte(1), frame[:50], uint32(50), byte(1))
	f.Add(ram, byte(1), frame, uint32(100000), byte(0))
	f.Add(ram, byte(0), append(netTestHdr(0, 4), netTestFrame(60)...), uint32(72), byte(2))
	f.Fuzz(func(t *testing.T, ram []byte, head byte, frame []byte, size uint32, feat byte) {
		if len(frame) > netHdrLen+NetMaxFrame {
			return // the tap's read buffer is no bigger
		}
		n, _, _, mem, want := netFuzzSetup(t, ram, []byte{head}, feat)
		// What writable buffers the chain at head may have: every writable
		// descriptor in the table or an indirect one.
		allowed := make([]bool, netFuzzRAM)
		var table func(base, n uint64, depth int)
		table = func(base, n uint64, depth int) {
			for i := uint64(0); i < n; i++ {
				var e [descSize]byte
				if mem.ReadAt(e[:], base+descSize*i) != nil {
					return
				}
				addr := binary.LittleEndian.Uint64(e[:])
				l := uint64(binary.LittleEndian.Uint32(e[8:]))
				flags := binary.LittleEndian.Uint16(e[12:])
				if flags&descFIndirect != 0 && depth == 0 {
					table(addr, l/descSize, 1)
				} else if flags&descFWrite != 0 {
					for a := addr; a < addr+l && a < netFuzzRAM && a >= addr; a++ {
						allowed[a] = true
					}
				}
			}
		}
		table(netFuzzDesc, netFuzzSize, 0)
		in := bytes.Clone(frame)
		err := n.receive(in, int(size))
		used := netFuzzUsedElems(t, mem)
		st := n.Stats()
		if err == nil {
			if len(used) != 1 || used[0][1] != uint32(len(frame)) {
				t.Fatalf("frame of %d bytes delivered, used ring %v", len(frame), used)
			}
			if st.RxPackets != 1 || st.RxBytes != uint64(len(frame)-netHdrLen) {
				t.Fatalf("stats %+v after one %d-byte frame", st, len(frame))
			}
			hdr := make([]byte, netHdrLen)
			binary.LittleEndian.PutUint16(hdr[netHdrNumBuffers:], 1)
			if !bytes.Equal(in[:netHdrLen], hdr) || !bytes.Equal(in[netHdrLen:], frame[netHdrLen:]) {
				t.Fatalf("delivered % x for % x", in[:min(len(in), 32)], frame[:min(len(frame), 32)])
			}
		} else {
			if st.RxPackets != 0 {
				t.Fatalf("stats %+v after a refused frame (%v)", st, err)
			}
			for _, u := range used {
				if u[1] != 0 {
					t.Fatalf("refused frame (%v) but used length %d", err, u[1])
				}
			}
		}
		for _, a := range netFuzzChanged(t, mem, want) {
			if !allowed[a] {
				t.Fatalf("receive wrote guest memory at %#x, outside every writable buffer", a)
			}
		}
	})
}
