package virtio

import (
	"bytes"
	"encoding/binary"
	"errors"
	"io"
	"testing"

	"github.com/kilnvm/kiln/memory"
)

// Guest-physical layout of the rings the queue tests drive.
const (
	vqDesc    = 0x1000
	vqAvail   = 0x3000
	vqUsed    = 0x4000
	vqData    = 0x10000 // buffers from here
	vqRAM     = 1 << 20 // region 0: [0, vqRAM)
	vqHigh    = 2 << 20 // region 1: [vqHigh, vqHigh+vqHighLen)
	vqHighLen = 0x10000
)

// vqRing is a test driver for one split virtqueue in plain memory.
type vqRing struct {
	t          *testing.T
	mem        *memory.Memory
	q          *Queue
	size       uint16
	availIdx   uint16
	interrupts int
	errs       []error
}

func vqMemory(t testing.TB) *memory.Memory {
	t.Helper()
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: vqRAM}, {GuestAddr: vqHigh, Size: vqHighLen}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	return mem
}

func newVQRing(t *testing.T, size uint16, features uint64) *vqRing {
	t.Helper()
	r := &vqRing{t: t, mem: vqMemory(t), size: size}
	r.q = &Queue{Size: size, Ready: true, DescAddr: vqDesc, DriverAddr: vqAvail, DeviceAddr: vqUsed}
	if err := r.q.activate(r.mem, features, func() { r.interrupts++ }, func(err error) { r.errs = append(r.errs, err) }); err != nil {
		t.Fatalf("activate: %v", err)
	}
	return r
}

func (r *vqRing) put(addr uint64, v any) {
	r.t.Helper()
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, v)
	if err := r.mem.WriteAt(b.Bytes(), addr); err != nil {
		r.t.Fatal(err)
	}
}

func (r *vqRing) u16(addr uint64) uint16 {
	var b [2]byte
	if err := r.mem.ReadAt(b[:], addr); err != nil {
		r.t.Fatal(err)
	}
	return binary.LittleEndian.Uint16(b[:])
}

func (r *vqRing) u32(addr uint64) uint32 {
	var b [4]byte
	if err := r.mem.ReadAt(b[:], addr); err != nil {
		r.t.Fatal(err)
	}
	return binary.LittleEndian.Uint32(b[:])
}

// desc writes descriptor i of the table at table.
func (r *vqRing) desc(table uint64, i uint16, addr uint64, n uint32, flags, next uint16) {
	r.put(table+16*uint64(i), struct {
		Addr  uint64
		Len   uint32
		Flags uint16
		Next  uint16
	}{addr, n, flags, next})
}

// publish makes heads available.
func (r *vqRing) publish(heads ...uint16) {
	for _, h := range heads {
		r.put(vqAvail+4+2*uint64(r.availIdx%r.size), h)
		r.availIdx++
	}
	r.put(vqAvail+2, r.availIdx)
}

func (r *vqRing) usedIdx() uint16 { return r.u16(vqUsed + 2) }

func (r *vqRing) usedElem(i uint16) (id, n uint32) {
	e := vqUsed + 4 + 8*uint64(i%r.size)
	return r.u32(e), r.u32(e + 4)
}

func (r *vqRing) setUsedEvent(v uint16)  { r.put(vqAvail+4+2*uint64(r.size), v) }
func (r *vqRing) availEvent() uint16     { return r.u16(vqUsed + 4 + 8*uint64(r.size)) }
func (r *vqRing) setAvailFlags(v uint16) { r.put(vqAvail, v) }

func (r *vqRing) mustPop() *Chain {
	r.t.Helper()
	c, ok, err := r.q.Pop()
	if err != nil || !ok {
		r.t.Fatalf("Pop = %v, %v; want a chain", ok, err)
	}
	return c
}

func TestQueuePopPush(t *testing.T) {
	r := newVQRing(t, 8, FeatureVersion1)
	r.put(vqData, []byte("hello, "))
	r.put(vqData+0x100, []byte("world"))
	r.desc(vqDesc, 3, vqData, 7, descFNext, 5)
	r.desc(vqDesc, 5, vqData+0x100, 5, descFNext, 0)
	r.desc(vqDesc, 0, vqData+0x200, 4, descFWrite|descFNext, 1)
	r.desc(vqDesc, 1, vqHigh, 8, descFWrite, 0)

	if _, ok, err := r.q.Pop(); ok || err != nil {
		t.Fatalf("Pop on an empty ring = %v, %v", ok, err)
	}
	r.publish(3)
	c := r.mustPop()
	if c.Head != 3 || len(c.Readable) != 2 || len(c.Writable) != 2 {
		t.Fatalf("chain = head %d, %d readable, %d writable", c.Head, len(c.Readable), len(c.Writable))
	}
	if c.ReadableLen() != 12 || c.WritableLen() != 12 {
		t.Fatalf("lengths = %d, %d; want 12, 12", c.ReadableLen(), c.WritableLen())
	}
	got, err := io.ReadAll(c.Reader())
	if err != nil || string(got) != "hello, world" {
		t.Fatalf("Reader = %q, %v", got, err)
	}
	w := c.Writer()
	if n, err := w.Write([]byte("0123456789")); n != 10 || err != nil {
		t.Fatalf("Write = %d, %v", n, err)
	}
	if n, err := w.Write([]byte("abcd")); n != 2 || !errors.Is(err, io.ErrShortWrite) {
		t.Fatalf("Write past the end = %d, %v; want 2, ErrShortWrite", n, err)
	}
	if c.Written() != 12 {
		t.Fatalf("Written = %d", c.Written())
	}
	var low [4]byte
	var high [8]byte
	r.mem.ReadAt(low[:], vqData+0x200)
	r.mem.ReadAt(high[:], vqHigh)
	if string(low[:])+string(high[:]) != "0123456789ab" {
		t.Fatalf("guest buffers hold %q %q", low, high)
	}
	if _, ok, err := r.q.Pop(); ok || err != nil {
		t.Fatalf("second Pop = %v, %v", ok, err)
	}
	if err := r.q.Push(c, c.Written()); err != nil {
		t.Fatal(err)
	}
	if r.usedIdx() != 1 {
		t.Fatalf("used idx = %d", r.usedIdx())
	}
	if id, n := r.usedElem(0); id != 3 || n != 12 {
		t.Fatalf("used elem = %d, %d; want 3, 12", id, n)
	}
	r.q.Notify()
	r.q.Notify() // nothing new: no second interrupt
	if r.interrupts != 1 {
		t.Fatalf("%d interrupts, want 1", r.interrupts)
	}
	if err := r.q.Push(c, 0); err == nil {
		t.Fatal("pushing a chain twice succeeded")
	}
	if len(r.errs) != 0 {
		t.Fatalf("queue errors: %v", r.errs)
	}
}

func TestQueueIndirect(t *testing.T) {
	r := newVQRing(t, 4, FeatureVersion1|FeatureIndirectDesc)
	const table = vqData + 0x1000
	r.desc(table, 0, vqData, 16, descFNext, 2)
	r.desc(table, 2, vqData+0x100, 32, descFWrite|descFNext, 1)
	r.desc(table, 1, vqData+0x200, 64, descFWrite, 0)
	r.desc(vqDesc, 2, table, 3*16, descFIndirect|descFWrite, 0) // WRITE ignored here
	r.publish(2)
	c := r.mustPop()
	if c.Head != 2 || c.ReadableLen() != 16 || c.WritableLen() != 96 || len(c.Writable) != 2 {
		t.Fatalf("chain = head %d, %d/%d bytes", c.Head, c.ReadableLen(), c.WritableLen())
	}
	if err := r.q.Push(c, 96); err != nil {
		t.Fatal(err)
	}
	if err := r.q.Push(&Chain{Head: 2}, 0); err == nil {
		t.Fatal("push of a chain not held succeeded")
	}
}

// TestQueueWrap runs the indices through 65535 and back to 0, with more
// chains in flight than fit before the ring wraps.
func TestQueueWrap(t *testing.T) {
	r := newVQRing(t, 4, FeatureVersion1)
	for i := uint16(0); i < 4; i++ {
		r.desc(vqDesc, i, vqData+uint64(i)*0x100, 8, descFWrite, 0)
	}
	for round := 0; round < 65536/4+3; round++ {
		r.publish(0, 1, 2, 3)
		var cs []*Chain
		for range 4 {
			cs = append(cs, r.mustPop())
		}
		if _, ok, err := r.q.Pop(); ok || err != nil {
			t.Fatalf("round %d: fifth Pop = %v, %v", round, ok, err)
		}
		for _, c := range cs {
			if err := r.q.Push(c, 8); err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
		}
	}
	if want := uint16(4 * 3); r.usedIdx() != want { // 4*(65536/4+3) mod 65536
		t.Fatalf("used idx %d, want %d", r.usedIdx(), want)
	}
}

func TestQueueMalformed(t *testing.T) {
	const table = vqData + 0x1000
	tests := []struct {
		name     string
		features uint64
		setup    func(r *vqRing)
	}{
		{"avail idx too far ahead", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqData, 8, 0, 0)
			r.put(vqAvail+2, uint16(9))
		}},
		{"avail idx far behind", 0, func(r *vqRing) {
			r.put(vqAvail+2, uint16(0xffff))
		}},
		{"head out of range", 0, func(r *vqRing) { r.publish(8) }},
		{"head huge", 0, func(r *vqRing) { r.publish(0xffff) }},
		{"loop", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqData, 8, descFNext, 1)
			r.desc(vqDesc, 1, vqData, 8, descFNext, 0)
			r.publish(0)
		}},
		{"self loop", 0, func(r *vqRing) {
			r.desc(vqDesc, 5, vqData, 8, descFNext, 5)
			r.publish(5)
		}},
		{"next out of range", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqData, 8, descFNext, 8)
			r.publish(0)
		}},
		{"readable after writable", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqData, 8, descFWrite|descFNext, 1)
			r.desc(vqDesc, 1, vqData, 8, 0, 0)
			r.publish(0)
		}},
		{"buffer outside RAM", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqRAM, 8, 0, 0)
			r.publish(0)
		}},
		{"buffer crossing the end of RAM", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqRAM-4, 8, 0, 0)
			r.publish(0)
		}},
		{"buffer crossing into a hole", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqHigh+vqHighLen-1, 2, descFWrite, 0)
			r.publish(0)
		}},
		{"buffer address overflow", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, ^uint64(0)-3, 8, 0, 0)
			r.publish(0)
		}},
		{"huge buffer", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, 0, 0xffffffff, descFWrite, 0)
			r.publish(0)
		}},
		{"indirect not negotiated", 0, func(r *vqRing) {
			r.desc(table, 0, vqData, 8, 0, 0)
			r.desc(vqDesc, 0, table, 16, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect with next", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(table, 0, vqData, 8, 0, 0)
			r.desc(vqDesc, 0, table, 16, descFIndirect|descFNext, 1)
			r.desc(vqDesc, 1, vqData, 8, 0, 0)
			r.publish(0)
		}},
		{"nested indirect", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(table, 0, table+0x100, 16, descFIndirect, 0)
			r.desc(table+0x100, 0, vqData, 8, 0, 0)
			r.desc(vqDesc, 0, table, 16, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect table empty", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(vqDesc, 0, table, 0, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect table length not a multiple of 16", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(table, 0, vqData, 8, 0, 0)
			r.desc(vqDesc, 0, table, 24, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect table longer than the queue", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(vqDesc, 0, table, 9*16, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect table outside RAM", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(vqDesc, 0, vqRAM-16, 32, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect loop", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(table, 0, vqData, 8, descFNext, 1)
			r.desc(table, 1, vqData, 8, descFNext, 0)
			r.desc(vqDesc, 0, table, 32, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect next outside the table", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(table, 0, vqData, 8, descFNext, 2)
			r.desc(vqDesc, 0, table, 32, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect buffer outside RAM", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(table, 0, vqRAM+0x1000, 8, 0, 0)
			r.desc(vqDesc, 0, table, 16, descFIndirect, 0)
			r.publish(0)
		}},
		{"indirect after direct readable after writable", FeatureIndirectDesc, func(r *vqRing) {
			r.desc(table, 0, vqData, 8, 0, 0)
			r.desc(vqDesc, 0, vqData, 8, descFWrite|descFNext, 1)
			r.desc(vqDesc, 1, table, 16, descFIndirect, 0)
			r.publish(0)
		}},
		{"head made available twice", 0, func(r *vqRing) {
			r.desc(vqDesc, 0, vqData, 8, 0, 0)
			r.publish(0)
			r.mustPop()
			r.publish(0)
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			r := newVQRing(t, 8, FeatureVersion1|tc.features)
			tc.setup(r)
			c, ok, err := r.q.Pop()
			if !errors.Is(err, ErrMalformed) || ok || c != nil {
				t.Fatalf("Pop = %v, %v, %v; want an ErrMalformed", c, ok, err)
			}
			if len(r.errs) != 1 || !errors.Is(r.errs[0], ErrMalformed) {
				t.Fatalf("transport told %v; want the error once", r.errs)
			}
			// The queue stays broken and does not report again.
			if _, ok, err2 := r.q.Pop(); ok || !errors.Is(err2, ErrMalformed) {
				t.Fatalf("Pop after the error = %v, %v", ok, err2)
			}
			if len(r.errs) != 1 {
				t.Fatalf("transport told %d times", len(r.errs))
			}
			r.q.Notify()
			if r.interrupts != 0 {
				t.Fatal("a broken queue interrupted")
			}
		})
	}
}

// TestQueueLongChain accepts a chain exactly as long as the queue.
func TestQueueLongChain(t *testing.T) {
	r := newVQRing(t, 8, FeatureVersion1|FeatureIndirectDesc)
	for i := uint16(0); i < 8; i++ {
		r.desc(vqDesc, i, vqData+uint64(i), 1, descFNext, i+1)
	}
	r.desc(vqDesc, 7, vqData, 1, 0, 0)
	r.publish(0)
	c := r.mustPop()
	if len(c.Readable) != 8 {
		t.Fatalf("%d buffers, want 8", len(c.Readable))
	}
	if err := r.q.Push(c, 0); err != nil {
		t.Fatal(err)
	}
	// A full-size indirect table, after one direct buffer.
	const table = vqData + 0x1000
	for i := uint16(0); i < 8; i++ {
		r.desc(table, i, vqData, 2, descFWrite|descFNext, i+1)
	}
	r.desc(table, 7, vqData, 2, descFWrite, 0)
	r.desc(vqDesc, 0, vqData, 4, descFNext, 1)
	r.desc(vqDesc, 1, table, 8*16, descFIndirect, 0)
	r.publish(0)
	c = r.mustPop()
	if len(c.Readable) != 1 || len(c.Writable) != 8 || c.WritableLen() != 16 {
		t.Fatalf("chain: %d readable, %d writable of %d bytes", len(c.Readable), len(c.Writable), c.WritableLen())
	}
}

func TestQueueActivateErrors(t *testing.T) {
	tests := []struct {
		name              string
		size              uint16
		desc, avail, used uint64
	}{
		{"size 0", 0, vqDesc, vqAvail, vqUsed},
		{"size not a power of 2", 6, vqDesc, vqAvail, vqUsed},
		{"descriptor table misaligned", 8, vqDesc + 8, vqAvail, vqUsed},
		{"avail ring misaligned", 8, vqDesc, vqAvail + 1, vqUsed},
		{"used ring misaligned", 8, vqDesc, vqAvail, vqUsed + 2},
		{"descriptor table outside RAM", 8, vqRAM, vqAvail, vqUsed},
		{"descriptor table crossing the end of RAM", 8, vqRAM - 64, vqAvail, vqUsed},
		{"avail ring outside RAM", 8, vqDesc, vqRAM + 2, vqUsed},
		{"used ring crossing the end of RAM", 8, vqDesc, vqAvail, vqHigh + vqHighLen - 64},
		{"address overflow", 8, vqDesc, vqAvail, ^uint64(0) - 3},
	}
	mem := vqMemory(t)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := &Queue{Size: tc.size, Ready: true, DescAddr: tc.desc, DriverAddr: tc.avail, DeviceAddr: tc.used}
			if err := q.activate(mem, FeatureVersion1, nil, nil); !errors.Is(err, ErrMalformed) {
				t.Fatalf("activate = %v, want ErrMalformed", err)
			}
			if _, ok, err := q.Pop(); ok || err != nil {
				t.Fatalf("Pop on an inactive queue = %v, %v", ok, err)
			}
		})
	}
}

func TestQueueEventIdx(t *testing.T) {
	r := newVQRing(t, 8, FeatureVersion1|FeatureEventIdx)
	for i := uint16(0); i < 8; i++ {
		r.desc(vqDesc, i, vqData, 8, descFWrite, 0)
	}
	if _, ok, _ := r.q.Pop(); ok {
		t.Fatal("Pop on an empty ring")
	}
	if r.availEvent() != 0 {
		t.Fatalf("avail_event = %d, want 0", r.availEvent())
	}
	r.publish(0, 1, 2)
	var cs []*Chain
	for range 3 {
		cs = append(cs, r.mustPop())
	}
	if r.availEvent() != 3 {
		t.Fatalf("avail_event = %d, want 3", r.availEvent())
	}
	// used_event 0: interrupt when the used index passes 0.
	r.setUsedEvent(0)
	r.q.Push(cs[0], 1)
	r.q.Notify()
	if r.interrupts != 1 {
		t.Fatalf("%d interrupts, want 1", r.interrupts)
	}
	// The driver has not moved used_event: no interrupt for the next one.
	r.q.Push(cs[1], 1)
	r.q.Notify()
	if r.interrupts != 1 {
		t.Fatalf("%d interrupts, want still 1", r.interrupts)
	}
	// used_event 2: the third push (used idx 2 -> 3) crosses it.
	r.setUsedEvent(2)
	r.q.Push(cs[2], 1)
	r.q.Notify()
	if r.interrupts != 2 {
		t.Fatalf("%d interrupts, want 2", r.interrupts)
	}
	// NO_INTERRUPT is ignored with EVENT_IDX.
	r.setAvailFlags(availFNoInterrupt)
	r.publish(3)
	c := r.mustPop()
	r.setUsedEvent(3)
	r.q.Push(c, 0)
	r.q.Notify()
	if r.interrupts != 3 {
		t.Fatalf("%d interrupts, want 3", r.interrupts)
	}
}

func TestQueueNoInterrupt(t *testing.T) {
	r := newVQRing(t, 4, FeatureVersion1)
	r.desc(vqDesc, 0, vqData, 8, descFWrite, 0)
	r.setAvailFlags(availFNoInterrupt)
	r.publish(0)
	r.q.Push(r.mustPop(), 0)
	r.q.Notify()
	if r.interrupts != 0 {
		t.Fatal("interrupted despite VIRTQ_AVAIL_F_NO_INTERRUPT")
	}
	r.setAvailFlags(0)
	r.publish(0)
	r.q.Push(r.mustPop(), 0)
	r.q.Notify()
	if r.interrupts != 1 {
		t.Fatalf("%d interrupts, want 1", r.interrupts)
	}
}

func TestQueuePushErrors(t *testing.T) {
	r := newVQRing(t, 4, FeatureVersion1)
	r.desc(vqDesc, 0, vqData, 8, descFWrite, 0)
	r.publish(0)
	c := r.mustPop()
	if err := r.q.Push(c, 9); err == nil {
		t.Fatal("push of 9 bytes written into 8 succeeded")
	}
	if err := r.q.Push(&Chain{Head: 7}, 0); err == nil {
		t.Fatal("push of an out-of-range head succeeded")
	}
	r.q.Reset()
	if err := r.q.Push(c, 0); !errors.Is(err, ErrStale) {
		t.Fatalf("push after reset = %v, want ErrStale", err)
	}
	if _, ok, err := r.q.Pop(); ok || err != nil {
		t.Fatalf("Pop after reset = %v, %v", ok, err)
	}
	r.q.Notify()
	if r.q.Size != 0 || r.q.Ready || r.q.DescAddr != 0 {
		t.Fatal("Reset kept the driver's configuration")
	}
	// Reactivated, the queue starts from index 0 again.
	*r = *newVQRing(t, 4, FeatureVersion1)
	if err := r.q.Push(c, 0); !errors.Is(err, ErrStale) {
		t.Fatalf("push into a new queue = %v, want ErrStale", err)
	}
}

func TestChainReader(t *testing.T) {
	c := &Chain{Readable: [][]byte{[]byte("ab"), {}, []byte("cde")}}
	var got []byte
	buf := make([]byte, 2)
	for {
		n, err := c.Read(buf)
		got = append(got, buf[:n]...)
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	if string(got) != "abcde" {
		t.Fatalf("read %q", got)
	}
	if n, err := c.Read(nil); n != 0 || err != nil {
		t.Fatalf("Read(nil) = %d, %v", n, err)
	}
	empty := &Chain{}
	if _, err := empty.Write([]byte{1}); !errors.Is(err, io.ErrShortWrite) {
		t.Fatalf("write into no buffers = %v", err)
	}
}

// FuzzQueuePop lays the fuzz input over guest memory (descriptor table,
// rings, indirect tables all at once) and checks that Pop neither panics
// nor loops, and that every buffer it returns lies inside guest memory.
func FuzzQueuePop(f *testing.F) {
	seed := make([]byte, 0x80)
	seed[0], seed[1] = 3, 0xff
	f.Add(seed)
	chain := []byte{2, 0xff}
	chain = binary.LittleEndian.AppendUint64(chain, 0x800)
	chain = binary.LittleEndian.AppendUint32(chain, 64)
	chain = binary.LittleEndian.AppendUint16(chain, descFNext|descFIndirect)
	chain = binary.LittleEndian.AppendUint16(chain, 1)
	f.Add(chain)
	// Small RAM: 8 KiB, then 4 KiB after a hole, so that fuzzed addresses
	// hit the edges often. One mapping serves every input (cleared each
	// time): a mapping per input makes the fuzzer crawl.
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: 0x2000}, {GuestAddr: 0x3000, Size: 0x1000}})
	if err != nil {
		f.Fatal(err)
	}
	defer mem.Close()
	f.Fuzz(func(t *testing.T, data []byte) { vqFuzzPop(t, mem, data) })
}

func vqFuzzPop(t *testing.T, mem *memory.Memory, data []byte) {
	if len(data) < 2 {
		return
	}
	size := uint16(1) << (data[0] % 6) // 1..32
	features := uint64(FeatureVersion1)
	if data[1]&1 != 0 {
		features |= FeatureIndirectDesc
	}
	if data[1]&2 != 0 {
		features |= FeatureEventIdx
	}
	clear(mem.Host(0))
	clear(mem.Host(1))
	copy(mem.Host(0), data[2:])
	if len(data) > 2+0x2000 {
		copy(mem.Host(1), data[2+0x2000:])
	}
	// Descriptors at 0 (up to 512 bytes), avail at 0x200, used at 0x300.
	q := &Queue{Size: size, Ready: true, DescAddr: 0, DriverAddr: 0x200, DeviceAddr: 0x300}
	if err := q.activate(mem, features, func() {}, func(error) {}); err != nil {
		t.Fatalf("activate: %v", err)
	}
	for i := 0; i < 2*int(size)+2; i++ {
		c, ok, err := q.Pop()
		if err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("Pop error %v does not wrap ErrMalformed", err)
			}
			return
		}
		if !ok {
			return
		}
		for _, bufs := range [][][]byte{c.Readable, c.Writable} {
			for _, b := range bufs {
				vqCheckInRAM(t, mem, b)
			}
		}
		c.Write(bytes.Repeat([]byte{0xaa}, 100))
		if err := q.Push(c, c.Written()); err != nil {
			t.Fatalf("Push: %v", err)
		}
		q.Notify()
	}
}
