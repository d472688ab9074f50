package virtio

import (
	"encoding/binary"
	"io"
	"log/slog"
	"os"
	"sync"
	"testing"

	"github.com/kilnvm/kiln/memory"
)

// transportFuzzRAM is the guest memory of the end-to-end targets: small, so
// that the fuzzer's bytes lay out whole rings, tables and buffers in it.
const transportFuzzRAM = 0x10000

// transportFuzzSeeds are driver sessions for fuzzTransport: set up queue 0
// at size 8 (descriptors at 0x1000, avail at 0x2000, used at 0x3000), put
// chains at heads 0 and 2 and notify.
func transportFuzzSeeds(f *testing.F) {
	ram := make([]byte, 0x4000)
	put := func(i int, addr uint64, n uint32, flags, next uint16) {
		e := ram[0x1000+16*i:]
		binary.LittleEndian.PutUint64(e, addr)
		binary.LittleEndian.PutUint32(e[8:], n)
		binary.LittleEndian.PutUint16(e[12:], flags)
		binary.LittleEndian.PutUint16(e[14:], next)
	}
	// A blk read of sector 1 (header, data, status), and a writable pair.
	binary.LittleEndian.PutUint32(ram[0x400:], BlockTypeIn)
	binary.LittleEndian.PutUint64(ram[0x408:], 1)
	put(0, 0x400, 16, descFNext, 1)
	put(1, 0x500, 512, descFWrite|descFNext, 4)
	put(4, 0x800, 1, descFWrite, 0)
	put(2, 0x900, 64, descFWrite|descFNext, 3)
	put(3, 0xa00, 0x100, descFWrite, 0)
	session := []byte{
		0, 0x01, 8, 0x10, 0x20, 0x30, // init: VERSION_1, size 8, rings
		1, 0, 1, 2, // publish heads 0 and 2
		2, 0, // notify queue 0
		6,                // ack the interrupt
		1, 7, 2, 0, 6, 7, // a bad head, notify, ack, reset
		0, 0x07, 8, 0x10, 0x20, 0x30, 1, 2, 2, 0, // again with indirect and event idx
	}
	f.Add(session, ram)
	f.Add([]byte{0, 0x03, 4, 0x10, 0x20, 0x30, 5, 0x10, 0x0c, descFIndirect, 1, 0, 2, 0}, ram)
	f.Add([]byte{3, regQueueNum, 0, 1, 3, regStatus, 0xff, 0, 4, regInterruptStatus, 2, 9}, []byte{})
}

// fuzzTransport is the end-to-end target: one byte string is a driver's
// session with a virtio-mmio transport in front of a real device, whose
// virtqueue lives in plain guest memory that ram fills. ops is a sequence
// of driver steps, each an opcode byte (mod 8) and its operands:
//
//	0 feat size desc avail used: the full initialization of queue 0 with
//	  feature bits (VERSION_1, INDIRECT_DESC, EVENT_IDX from feat's bits
//	  0-2), queue size, and ring addresses (each operand <<8)
//	1 head: make head available in queue 0's avail ring
//	2 q: notify queue q
//	3 reg lo hi: write a 32-bit register
//	4 reg: read a register
//	5 lo hi v: the driver writes byte v to guest memory at lo|hi<<8
//	6: read InterruptStatus and acknowledge what it says
//	7: reset (Status 0)
//
// The transport and the device must never panic; after every step the
// interrupt line follows InterruptStatus; after the session, a reset drops
// the line, and the device has written guest memory only inside buffers
// the driver marked writable (direct or through an indirect table) and
// inside the used rings of queues it set up.
func fuzzTransport(t *testing.T, dev Device, ops, ram []byte) {
	s := newTransportSession(t, dev, ram)
	defer s.close()
	for len(ops) > 0 {
		op := ops[0] % transportOps
		ops = ops[1:]
		s.step(op, func() byte {
			if len(ops) == 0 {
				return 0
			}
			b := ops[0]
			ops = ops[1:]
			return b
		})
		s.checkLine()
	}
	s.finish()
}

// transportOps is how many opcodes transportSession.step knows.
const transportOps = 8

// transportSession is the driver's side of the end-to-end targets: a
// transport in front of a device over a small guest memory, with what the
// driver wrote (want) and where the device may write (allowed). Targets
// for one device kind (FuzzTransportVsock) drive it with step's generic
// operations and their own.
type transportSession struct {
	t       *testing.T
	mem     *memory.Memory
	m       *MMIO
	want    []byte // guest memory as the driver left it
	allowed []bool // where the device may write

	lineMu sync.Mutex
	line   bool

	availIdx, qsize uint16
	availAddr       uint64
}

// newTransportSession puts dev behind a transport over a guest memory that
// ram fills.
func newTransportSession(t *testing.T, dev Device, ram []byte) *transportSession {
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: transportFuzzRAM}})
	if err != nil {
		t.Fatal(err)
	}
	s := &transportSession{t: t, mem: mem, want: make([]byte, transportFuzzRAM), allowed: make([]bool, transportFuzzRAM)}
	copy(s.want, ram)
	if err := mem.WriteAt(s.want, 0); err != nil {
		mem.Close()
		t.Fatal(err)
	}
	// The line, driven from the transport's lock: a device worker (blk's)
	// raises it while the driver's steps run.
	s.m = NewMMIO(dev, mem, func(l bool) {
		s.lineMu.Lock()
		defer s.lineMu.Unlock()
		if l == s.line {
			t.Errorf("irq(%v) twice", l)
		}
		s.line = l
	})
	s.m.SetLogger(slog.New(slog.NewTextHandler(io.Discard, nil)))
	s.noteAllowed()
	return s
}

// close resets the transport and unmaps the memory.
func (s *transportSession) close() {
	s.m.Close()
	s.mem.Close()
}

func (s *transportSession) level() bool {
	s.lineMu.Lock()
	defer s.lineMu.Unlock()
	return s.line
}

func (s *transportSession) mark(addr, n uint64) {
	for a := addr; a < addr+n && a < transportFuzzRAM && a >= addr; a++ {
		s.allowed[a] = true
	}
}

// noteAllowed adds, for the queues as they are now, every writable buffer
// their descriptor tables name and their used rings.
func (s *transportSession) noteAllowed() {
	for _, q := range s.m.queues {
		n := uint64(q.Size)
		if n == 0 {
			continue
		}
		s.mark(q.DeviceAddr, 6+8*n)
		var table func(base, n uint64, depth int)
		table = func(base, n uint64, depth int) {
			for i := uint64(0); i < n; i++ {
				var e [descSize]byte
				if s.mem.ReadAt(e[:], base+descSize*i) != nil {
					return
				}
				addr := binary.LittleEndian.Uint64(e[:])
				l := uint64(binary.LittleEndian.Uint32(e[8:]))
				flags := binary.LittleEndian.Uint16(e[12:])
				if flags&descFIndirect != 0 && depth == 0 {
					table(addr, l/descSize, 1)
				} else if flags&descFWrite != 0 {
					s.mark(addr, l)
				}
			}
		}
		table(q.DescAddr, n, 0)
	}
}

func (s *transportSession) reg(off uint64, v uint32) {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	s.m.Write(off, b[:])
}

func (s *transportSession) read(off uint64) uint32 {
	var b [4]byte
	s.m.Read(off, b[:])
	return binary.LittleEndian.Uint32(b[:])
}

// driverWrite writes guest memory as the driver.
func (s *transportSession) driverWrite(addr uint64, b []byte) {
	if addr+uint64(len(b)) > transportFuzzRAM {
		return
	}
	copy(s.want[addr:], b)
	if err := s.mem.WriteAt(b, addr); err != nil {
		s.t.Fatal(err)
	}
}

// guestRead reads guest memory (what the device wrote too).
func (s *transportSession) guestRead(addr uint64, n int) []byte {
	b := make([]byte, n)
	if err := s.mem.ReadAt(b, addr); err != nil {
		s.t.Fatalf("reading guest memory at %#x: %v", addr, err)
	}
	return b
}

// fuzzFeatures turns bits 0-2 of feat into VERSION_1, INDIRECT_DESC and
// EVENT_IDX.
func fuzzFeatures(feat byte) uint64 {
	var features uint64
	for i, bit := range []uint64{FeatureVersion1, FeatureIndirectDesc, FeatureEventIdx} {
		if feat>>i&1 != 0 {
			features |= bit
		}
	}
	return features
}

// initDevice runs the driver's initialization with features and sets up
// each queue of rings (size, descriptor table, avail and used ring) before
// DRIVER_OK (the caller lays out and zeroes the rings).
func (s *transportSession) initDevice(features uint64, rings [][4]uint64) {
	s.reg(regStatus, 0)
	s.reg(regStatus, StatusAcknowledge|StatusDriver)
	s.reg(regDriverFeatSel, 0)
	s.reg(regDriverFeatures, uint32(features))
	s.reg(regDriverFeatSel, 1)
	s.reg(regDriverFeatures, uint32(features>>32))
	s.reg(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
	for i, r := range rings {
		size, desc, avail, used := r[0], r[1], r[2], r[3]
		s.reg(regQueueSel, uint32(i))
		s.reg(regQueueNum, uint32(size))
		s.reg(regQueueDescLow, uint32(desc))
		s.reg(regQueueDriverLow, uint32(avail))
		s.reg(regQueueDeviceLow, uint32(used))
	}
	s.noteAllowed() // before the device can use the queues
	for i := range rings {
		s.reg(regQueueSel, uint32(i))
		s.reg(regQueueReady, 1)
	}
	s.reg(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
}

// step runs one of the generic driver operations (op < transportOps) with
// its operands from arg; see fuzzTransport.
func (s *transportSession) step(op byte, arg func() byte) {
	switch op {
	case 0:
		feat, size := arg(), arg()
		desc, avail, used := uint64(arg())<<8, uint64(arg())<<8, uint64(arg())<<8
		s.initDevice(fuzzFeatures(feat), [][4]uint64{{uint64(size), desc, avail, used}})
		s.availIdx, s.qsize, s.availAddr = 0, uint16(size), avail
		var zero [4]byte
		s.driverWrite(avail, zero[:])
	case 1:
		head := uint16(arg())
		if s.qsize == 0 {
			break
		}
		var b [2]byte
		binary.LittleEndian.PutUint16(b[:], head)
		s.driverWrite(s.availAddr+4+2*uint64(s.availIdx%s.qsize), b[:])
		s.availIdx++
		binary.LittleEndian.PutUint16(b[:], s.availIdx)
		s.driverWrite(s.availAddr+2, b[:])
	case 2:
		s.reg(regQueueNotify, uint32(arg()%4))
	case 3:
		off := uint64(arg()) &^ 3
		v := uint32(arg()) | uint32(arg())<<8
		s.reg(off, v)
	case 4:
		s.read(uint64(arg()) &^ 3)
	case 5:
		addr := uint64(arg()) | uint64(arg())<<8
		s.driverWrite(addr, []byte{arg()})
	case 6:
		if st := s.read(regInterruptStatus); st != 0 {
			s.reg(regInterruptACK, st)
		}
	case 7:
		s.reg(regStatus, 0)
		s.qsize = 0
	}
	s.noteAllowed()
}

// checkLine checks that the line follows InterruptStatus. Only a device
// worker changes the line meanwhile, and only up, with InterruptStatus
// under the transport's lock: a line that reads the same before and after
// must agree with the status.
func (s *transportSession) checkLine() {
	before := s.level()
	st := s.read(regInterruptStatus)
	if after := s.level(); before == after && (st != 0) != after {
		s.t.Fatalf("InterruptStatus %#x with the line %v", st, after)
	}
}

// finish resets the transport (which waits for the device's workers) and
// checks that the line dropped and that the device wrote guest memory only
// where it was allowed to.
func (s *transportSession) finish() {
	s.m.Reset()
	if s.level() {
		s.t.Fatal("line up after reset")
	}
	got := s.guestRead(0, transportFuzzRAM)
	for a := range got {
		if got[a] != s.want[a] && !s.allowed[a] {
			s.t.Fatalf("the device wrote guest memory at %#x (%#x, the driver left %#x), outside every writable buffer and used ring", a, got[a], s.want[a])
		}
	}
}

// FuzzTransportRNG runs fuzzTransport with the entropy device in front.
func FuzzTransportRNG(f *testing.F) {
	transportFuzzSeeds(f)
	f.Fuzz(func(t *testing.T, ops, ram []byte) {
		fuzzTransport(t, NewRNG(), ops, ram)
	})
}

// FuzzTransportBlock runs fuzzTransport with a virtio-blk device over a
// small disk image, which must keep its size.
func FuzzTransportBlock(f *testing.F) {
	transportFuzzSeeds(f)
	p := f.TempDir() + "/disk.img"
	const size = 16 * BlockSectorSize
	if err := os.WriteFile(p, make([]byte, size), 0o600); err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, ops, ram []byte) {
		dev, err := NewBlock(BlockConfig{Path: p, ID: "fuzz", Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
		if err != nil {
			t.Fatal(err)
		}
		fuzzTransport(t, dev, ops, ram)
		if err := dev.Close(); err != nil {
			t.Fatal(err)
		}
		if st, err := os.Stat(p); err != nil || st.Size() != size {
			t.Fatalf("disk image: %v, %v", st, err)
		}
	})
}
