package virtio

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"

	"github.com/kilnvm/kiln/memory"
)

// MaxQueueSize is the largest split virtqueue (virtio 1.x, section 2.7).
const MaxQueueSize = 32768

// Descriptor flags (section 2.7.5).
const (
	descFNext     = 1
	descFWrite    = 2
	descFIndirect = 4
)

// Ring flags (sections 2.7.6 and 2.7.8).
const (
	availFNoInterrupt = 1
)

const descSize = 16

// ErrMalformed is wrapped by every error caused by a driver breaking the
// virtqueue rules: indices, descriptors, addresses or lengths that the spec
// forbids or that fall outside guest memory.
var ErrMalformed = errors.New("malformed virtqueue")

// ErrStale is returned by Push for a chain popped before the queue was
// reset (its buffers went back to the driver with the reset), or from
// another queue.
var ErrStale = errors.New("virtqueue chain is from before a reset")

// Queue is one split virtqueue. The transport sets the exported fields from
// the driver's register writes before the device is activated; after that
// only the device uses it, through Pop, Push and Notify, which are safe to
// call from several goroutines (a device that serves requests concurrently
// pops on one and pushes on others). Reset (by the transport) may run
// concurrently with them.
type Queue struct {
	// Size is the number of descriptors (a power of 2, at most the
	// device's maximum for this queue).
	Size uint16
	// Ready is the driver's QueueReady.
	Ready bool
	// DescAddr, DriverAddr and DeviceAddr are the guest-physical addresses
	// of the descriptor table, the available (driver) ring and the used
	// (device) ring.
	DescAddr, DriverAddr, DeviceAddr uint64

	mu        sync.Mutex
	active    bool
	gen       uint64 // bumped on every reset; chains carry it
	mem       *memory.Memory
	size      uint16
	desc      []byte // descriptor table, 16*size bytes
	avail     []byte // available ring, 6+2*size bytes
	used      []byte // used ring, 6+8*size bytes
	eventIdx  bool
	indirect  bool
	lastAvail uint16
	usedIdx   uint16
	notified  uint16 // usedIdx at the last Notify
	inFlight  []bool // heads popped and not yet pushed
	nHeld     int    // how many of inFlight are true
	paused    bool   // Pop finds nothing (the transport is paused)
	broken    error  // the first malformation; the queue serves nothing after
	interrupt func()
	onError   func(error)
	report    func(error) // onError, pending until q.mu is released
	barrier   atomic.Uint32
}

// Chain is one descriptor chain the driver made available: the buffers the
// device reads (the request), then those it writes (the response). The
// buffers alias guest memory and have been checked to lie inside it. Chain
// is also an io.Reader over the readable buffers and an io.Writer over the
// writable ones, each with its own cursor.
type Chain struct {
	Head     uint16
	Readable [][]byte
	Writable [][]byte

	q          *Queue // the queue it came from, at generation gen
	gen        uint64
	rBuf, rOff int // read cursor: buffer index, offset in it
	wBuf, wOff int // write cursor
	written    int
}

// ReadableLen returns the total length of the readable buffers.
func (c *Chain) ReadableLen() int { return totalLen(c.Readable) }

// WritableLen returns the total length of the writable buffers.
func (c *Chain) WritableLen() int { return totalLen(c.Writable) }

func totalLen(bufs [][]byte) int {
	n := 0
	for _, b := range bufs {
		n += len(b)
	}
	return n
}

// Read reads from the readable buffers, continuing where the last Read
// stopped; it returns io.EOF at their end.
func (c *Chain) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) && c.rBuf < len(c.Readable) {
		b := c.Readable[c.rBuf][c.rOff:]
		k := copy(p[n:], b)
		n += k
		c.rOff += k
		if c.rOff == len(c.Readable[c.rBuf]) {
			c.rBuf, c.rOff = c.rBuf+1, 0
		}
	}
	if n == 0 && len(p) > 0 {
		return 0, io.EOF
	}
	return n, nil
}

// Write writes to the writable buffers, continuing where the last Write
// stopped. Past their end it writes what fits and returns io.ErrShortWrite.
func (c *Chain) Write(p []byte) (int, error) {
	n := 0
	for n < len(p) && c.wBuf < len(c.Writable) {
		b := c.Writable[c.wBuf][c.wOff:]
		k := copy(b, p[n:])
		n += k
		c.wOff += k
		if c.wOff == len(c.Writable[c.wBuf]) {
			c.wBuf, c.wOff = c.wBuf+1, 0
		}
	}
	c.written += n
	if n < len(p) {
		return n, io.ErrShortWrite
	}
	return n, nil
}

// Reader returns the chain as an io.Reader over its readable buffers.
func (c *Chain) Reader() io.Reader { return readerOnly{c} }

// Writer returns the chain as an io.Writer over its writable buffers.
func (c *Chain) Writer() io.Writer { return writerOnly{c} }

// Written returns how many bytes Write has stored so far: the length to
// give Push when the device wrote its response through the Writer.
func (c *Chain) Written() uint32 { return uint32(c.written) }

type readerOnly struct{ c *Chain }

func (r readerOnly) Read(p []byte) (int, error) { return r.c.Read(p) }

type writerOnly struct{ c *Chain }

func (w writerOnly) Write(p []byte) (int, error) { return w.c.Write(p) }

// fence orders the guest-memory accesses before it against those after it,
// for the CPU and the compiler: an atomic read-modify-write is a full
// barrier (a locked instruction on x86).
func (q *Queue) fence() { q.barrier.Add(1) }

// activate checks the driver's queue configuration and maps the rings. It
// is called by the transport when the driver sets DRIVER_OK, for a queue
// the driver made ready. interrupt is called when the device should raise
// a used-buffer interrupt; onError when the driver broke the queue.
func (q *Queue) activate(mem *memory.Memory, features uint64, interrupt func(), onError func(error)) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	size := q.Size
	if size == 0 || size > MaxQueueSize || size&(size-1) != 0 {
		return fmt.Errorf("queue size %d is not a power of 2 up to %d: %w", size, MaxQueueSize, ErrMalformed)
	}
	if q.DescAddr%16 != 0 || q.DriverAddr%2 != 0 || q.DeviceAddr%4 != 0 {
		return fmt.Errorf("queue rings at %#x/%#x/%#x are misaligned: %w", q.DescAddr, q.DriverAddr, q.DeviceAddr, ErrMalformed)
	}
	n := uint64(size)
	desc, err := mem.Slice(q.DescAddr, descSize*n)
	if err != nil {
		return fmt.Errorf("descriptor table: %w: %w", ErrMalformed, err)
	}
	avail, err := mem.Slice(q.DriverAddr, 6+2*n)
	if err != nil {
		return fmt.Errorf("available ring: %w: %w", ErrMalformed, err)
	}
	used, err := mem.Slice(q.DeviceAddr, 6+8*n)
	if err != nil {
		return fmt.Errorf("used ring: %w: %w", ErrMalformed, err)
	}
	q.mem, q.size, q.desc, q.avail, q.used = mem, size, desc, avail, used
	q.eventIdx = features&FeatureEventIdx != 0
	q.indirect = features&FeatureIndirectDesc != 0
	q.lastAvail, q.usedIdx, q.notified = 0, 0, 0
	q.inFlight = make([]bool, size)
	q.nHeld = 0
	q.broken = nil
	q.interrupt, q.onError = interrupt, onError
	q.active = true
	return nil
}

// Reset returns the queue to its state before the driver configured it:
// the device stops being served, and chains popped before it can no longer
// be pushed (Push returns ErrStale).
func (q *Queue) Reset() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.Size, q.Ready = 0, false
	q.DescAddr, q.DriverAddr, q.DeviceAddr = 0, 0, 0
	q.active = false
	q.gen++
	q.mem, q.size, q.desc, q.avail, q.used = nil, 0, nil, nil, nil
	q.lastAvail, q.usedIdx, q.notified = 0, 0, 0
	q.inFlight = nil
	q.nHeld = 0
	q.broken = nil
	q.interrupt, q.onError = nil, nil
}

// fail records a malformation; the caller reports it with report once it
// has released q.mu.
func (q *Queue) fail(err error) error {
	if q.broken == nil {
		q.broken = err
		q.report = q.onError
	}
	return err
}

// halt stops the queue serving, as after a malformation, without telling the
// transport (which called it).
func (q *Queue) halt(err error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.active && q.broken == nil {
		q.broken = err
	}
}

func (q *Queue) availIdx() uint16 { return binary.LittleEndian.Uint16(q.avail[2:]) }

// Pop returns the next chain the driver made available, or false when there
// is none (or the queue is not active). An error wraps ErrMalformed: the
// driver broke the queue, which then serves nothing until reset.
func (q *Queue) Pop() (*Chain, bool, error) {
	q.mu.Lock()
	c, ok, err := q.pop()
	report := q.report
	q.report = nil
	q.mu.Unlock()
	if report != nil {
		report(err)
	}
	return c, ok, err
}

func (q *Queue) pop() (*Chain, bool, error) {
	if !q.active || q.paused {
		return nil, false, nil
	}
	if q.broken != nil {
		return nil, false, q.broken
	}
	idx := q.availIdx()
	if idx == q.lastAvail {
		if !q.eventIdx {
			return nil, false, nil
		}
		// Ask to be notified of the next buffer, then look again: the
		// driver may have added one before it saw the new avail_event.
		binary.LittleEndian.PutUint16(q.used[4+8*int(q.size):], q.lastAvail)
		q.fence()
		if idx = q.availIdx(); idx == q.lastAvail {
			return nil, false, nil
		}
	}
	if pending := idx - q.lastAvail; pending > q.size {
		return nil, false, q.fail(fmt.Errorf("available index %d is %d entries past %d in a queue of %d: %w", idx, pending, q.lastAvail, q.size, ErrMalformed))
	}
	q.fence() // read the ring entry only after the index that published it
	head := binary.LittleEndian.Uint16(q.avail[4+2*int(q.lastAvail%q.size):])
	c, err := q.walk(head)
	if err != nil {
		return nil, false, q.fail(err)
	}
	q.inFlight[head] = true
	q.nHeld++
	q.lastAvail++
	if q.eventIdx {
		binary.LittleEndian.PutUint16(q.used[4+8*int(q.size):], q.lastAvail)
	}
	return c, true, nil
}

type descriptor struct {
	addr  uint64
	len   uint32
	flags uint16
	next  uint16
}

func readDesc(table []byte, i uint16) descriptor {
	b := table[descSize*int(i):]
	return descriptor{
		addr:  binary.LittleEndian.Uint64(b),
		len:   binary.LittleEndian.Uint32(b[8:]),
		flags: binary.LittleEndian.Uint16(b[12:]),
		next:  binary.LittleEndian.Uint16(b[14:]),
	}
}

// walk follows the chain at head, checking every rule of section 2.7.5.
func (q *Queue) walk(head uint16) (*Chain, error) {
	if head >= q.size {
		return nil, fmt.Errorf("chain head %d in a queue of %d: %w", head, q.size, ErrMalformed)
	}
	if q.inFlight[head] {
		return nil, fmt.Errorf("chain head %d made available again while the device holds it: %w", head, ErrMalformed)
	}
	c := &Chain{Head: head, q: q, gen: q.gen}
	table, count := q.desc, q.size // the table being walked and its length
	indirect := false
	i := head
	for n := 0; ; n++ {
		if n >= int(count) {
			return nil, fmt.Errorf("chain at head %d is longer than its %d-entry table (a loop?): %w", head, count, ErrMalformed)
		}
		d := readDesc(table, i)
		if d.flags&descFIndirect != 0 {
			if indirect {
				return nil, fmt.Errorf("chain at head %d: indirect descriptor inside an indirect table: %w", head, ErrMalformed)
			}
			if !q.indirect {
				return nil, fmt.Errorf("chain at head %d: indirect descriptor without VIRTIO_F_INDIRECT_DESC: %w", head, ErrMalformed)
			}
			if d.flags&descFNext != 0 {
				return nil, fmt.Errorf("chain at head %d: indirect descriptor with NEXT set: %w", head, ErrMalformed)
			}
			if d.len == 0 || d.len%descSize != 0 || d.len/descSize > uint32(q.size) {
				return nil, fmt.Errorf("chain at head %d: indirect table of %d bytes (want a non-zero multiple of 16, at most %d entries): %w", head, d.len, q.size, ErrMalformed)
			}
			t, err := q.mem.Slice(d.addr, uint64(d.len))
			if err != nil {
				return nil, fmt.Errorf("chain at head %d: indirect table %#x+%#x: %w: %w", head, d.addr, d.len, ErrMalformed, err)
			}
			table, count, indirect, i, n = t, uint16(d.len/descSize), true, 0, -1
			continue
		}
		buf, err := q.mem.Slice(d.addr, uint64(d.len))
		if err != nil {
			return nil, fmt.Errorf("chain at head %d: buffer %#x+%#x: %w: %w", head, d.addr, d.len, ErrMalformed, err)
		}
		if d.flags&descFWrite != 0 {
			c.Writable = append(c.Writable, buf)
		} else {
			if len(c.Writable) > 0 {
				return nil, fmt.Errorf("chain at head %d: device-readable buffer after a device-writable one: %w", head, ErrMalformed)
			}
			c.Readable = append(c.Readable, buf)
		}
		if d.flags&descFNext == 0 {
			return c, nil
		}
		if d.next >= count {
			return nil, fmt.Errorf("chain at head %d: next descriptor %d in a table of %d: %w", head, d.next, count, ErrMalformed)
		}
		i = d.next
	}
}

// Push returns a chain to the driver through the used ring, with written
// the number of bytes the device wrote into its writable buffers. It does
// not interrupt the driver: call Notify after a batch.
func (q *Queue) Push(c *Chain, written uint32) error {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.active || c.q != q || c.gen != q.gen {
		return ErrStale
	}
	if q.broken != nil {
		return q.broken
	}
	if c.Head >= q.size || !q.inFlight[c.Head] {
		return fmt.Errorf("push of chain %d that the device does not hold", c.Head)
	}
	if uint64(written) > uint64(c.WritableLen()) {
		return fmt.Errorf("push of chain %d: %d bytes written into %d writable", c.Head, written, c.WritableLen())
	}
	q.inFlight[c.Head] = false
	q.nHeld--
	e := q.used[4+8*int(q.usedIdx%q.size):]
	binary.LittleEndian.PutUint32(e, uint32(c.Head))
	binary.LittleEndian.PutUint32(e[4:], written)
	q.fence() // the entry before the index that publishes it
	q.usedIdx++
	binary.LittleEndian.PutUint16(q.used[2:], q.usedIdx)
	return nil
}

// Notify interrupts the driver if buffers were pushed since the last Notify
// and the driver has not suppressed the interrupt (VIRTQ_AVAIL_F_NO_INTERRUPT,
// or used_event with VIRTIO_F_EVENT_IDX).
func (q *Queue) Notify() {
	q.mu.Lock()
	if !q.active || q.broken != nil || q.usedIdx == q.notified {
		q.mu.Unlock()
		return
	}
	q.fence() // the used index before reading the driver's suppression
	old, now := q.notified, q.usedIdx
	q.notified = now
	var need bool
	if q.eventIdx {
		event := binary.LittleEndian.Uint16(q.avail[4+2*int(q.size):])
		need = now-event-1 < now-old // vring_need_event
	} else {
		need = binary.LittleEndian.Uint16(q.avail)&availFNoInterrupt == 0
	}
	interrupt := q.interrupt
	q.mu.Unlock()
	if need && interrupt != nil {
		interrupt()
	}
}
