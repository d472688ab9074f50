package virtio

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/kilnvm/kiln/memory"
)

// mmioFake is a Device that records what the transport asks of it and, on a
// notification, answers every chain of the queue with its readable length.
type mmioFake struct {
	mu        sync.Mutex
	features  uint64
	sizes     []uint16
	config    []byte
	activated int
	gotFeat   uint64
	queues    []*Queue
	notified  []int
	resets    int
	popErrs   []error
	failAct   error
}

func (d *mmioFake) ID() uint32           { return 42 }
func (d *mmioFake) Features() uint64     { return d.features }
func (d *mmioFake) QueueSizes() []uint16 { return d.sizes }
func (d *mmioFake) ReadConfig(off uint64, data []byte) {
	if off < uint64(len(d.config)) {
		copy(data, d.config[off:])
	}
}
func (d *mmioFake) WriteConfig(off uint64, data []byte) {
	if off < uint64(len(d.config)) {
		copy(d.config[off:], data)
	}
}
func (d *mmioFake) Activate(mem *memory.Memory, features uint64, queues []*Queue) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.failAct != nil {
		return d.failAct
	}
	d.activated++
	d.gotFeat, d.queues = features, queues
	return nil
}
func (d *mmioFake) QueueNotify(i int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.notified = append(d.notified, i)
	q := d.queues[i]
	for {
		c, ok, err := q.Pop()
		if err != nil {
			d.popErrs = append(d.popErrs, err)
			return
		}
		if !ok {
			break
		}
		n, _ := c.Write(make([]byte, c.ReadableLen()))
		q.Push(c, uint32(n))
	}
	q.Notify()
}
func (d *mmioFake) Reset() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.resets++
	d.queues = nil
}

// mmioDriver plays a virtio-mmio driver against a transport.
type mmioDriver struct {
	t     *testing.T
	mem   *memory.Memory
	dev   *mmioFake
	m     *MMIO
	level bool
	edges int
}

func newMMIODriver(t *testing.T, dev *mmioFake) *mmioDriver {
	d := &mmioDriver{t: t, mem: vqMemory(t), dev: dev}
	d.m = NewMMIO(dev, d.mem, func(level bool) {
		if level == d.level {
			t.Errorf("irq(%v) twice", level)
		}
		d.level = level
		d.edges++
	})
	return d
}

func (d *mmioDriver) read(off uint64) uint32 {
	var b [4]byte
	d.m.Read(off, b[:])
	return binary.LittleEndian.Uint32(b[:])
}

func (d *mmioDriver) write(off uint64, v uint32) {
	var b [4]byte
	binary.LittleEndian.PutUint32(b[:], v)
	d.m.Write(off, b[:])
}

// queueBase returns where queue i's rings go: a 16 KiB area each.
func mmioQueueBase(i int) uint64 { return 0x20000 + uint64(i)*0x4000 }

// init runs the driver initialization of section 3.1.1 with features
// (the high and low words), setting up every queue at size n.
func (d *mmioDriver) init(features uint64, n uint32) {
	d.t.Helper()
	if d.read(regMagic) != mmioMagic || d.read(regVersion) != 2 || d.read(regDeviceID) != 42 || d.read(regVendorID) != VendorID {
		d.t.Fatal("bad identification registers")
	}
	d.write(regStatus, 0)
	d.write(regStatus, StatusAcknowledge)
	d.write(regStatus, StatusAcknowledge|StatusDriver)
	d.write(regDriverFeatSel, 0)
	d.write(regDriverFeatures, uint32(features))
	d.write(regDriverFeatSel, 1)
	d.write(regDriverFeatures, uint32(features>>32))
	d.write(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
	if d.read(regStatus)&StatusFeaturesOK == 0 {
		d.t.Fatalf("features %#x not accepted", features)
	}
	for i := range d.dev.sizes {
		d.write(regQueueSel, uint32(i))
		if d.read(regQueueReady) != 0 {
			d.t.Fatalf("queue %d ready before setup", i)
		}
		if max := d.read(regQueueNumMax); max != uint32(d.dev.sizes[i]) {
			d.t.Fatalf("queue %d: QueueNumMax %d", i, max)
		}
		base := mmioQueueBase(i)
		d.write(regQueueNum, n)
		d.write(regQueueDescLow, uint32(base))
		d.write(regQueueDescHigh, uint32(base>>32))
		d.write(regQueueDriverLow, uint32(base+0x2000))
		d.write(regQueueDriverHigh, 0)
		d.write(regQueueDeviceLow, uint32(base+0x3000))
		d.write(regQueueDeviceHigh, 0)
		d.write(regQueueReady, 1)
		if d.read(regQueueReady) != 1 {
			d.t.Fatalf("queue %d not ready", i)
		}
	}
	d.write(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
}

// ring returns a vqRing view (for laying out descriptors) of queue i.
func (d *mmioDriver) ring(i int, n uint16) *vqRing {
	return &vqRing{t: d.t, mem: d.mem, size: n}
}

// submit lays out a one-readable, one-writable chain at head in queue i
// (size n) and makes it available as the avail'th entry.
func (d *mmioDriver) submit(i int, n, head, avail uint16, buf uint64) {
	base := mmioQueueBase(i)
	r := d.ring(i, n)
	r.desc(base, head, buf, 16, descFNext, (head+1)%n)
	r.desc(base, (head+1)%n, buf+0x100, 64, descFWrite, 0)
	r.put(base+0x2000+4+2*uint64(avail%n), head)
	r.put(base+0x2000+2, avail+1)
}

func TestMMIOInitAndServe(t *testing.T) {
	dev := &mmioFake{features: 1<<5 | 1<<40 | 1<<62, sizes: []uint16{16, 8}, config: []byte{1, 2, 3, 4, 5, 6, 7, 8}}
	d := newMMIODriver(t, dev)
	d.write(regDeviceFeatSel, 0)
	lo := d.read(regDeviceFeatures)
	d.write(regDeviceFeatSel, 1)
	hi := d.read(regDeviceFeatures)
	offered := uint64(hi)<<32 | uint64(lo)
	if want := uint64(1<<5 | FeatureVersion1 | FeatureIndirectDesc | FeatureEventIdx | 1<<62); offered != want {
		t.Fatalf("offered %#x, want %#x (a reserved bit the transport lacks is dropped)", offered, want)
	}
	d.write(regDeviceFeatSel, 2)
	if d.read(regDeviceFeatures) != 0 {
		t.Fatal("feature word 2 is not 0")
	}
	feat := uint64(FeatureVersion1 | FeatureEventIdx | 1<<5)
	d.init(feat, 8)
	if dev.activated != 1 || dev.gotFeat != feat || len(dev.queues) != 2 {
		t.Fatalf("Activate: %d calls, features %#x, %d queues", dev.activated, dev.gotFeat, len(dev.queues))
	}
	if d.read(regStatus) != StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK {
		t.Fatalf("status %#x", d.read(regStatus))
	}

	// Config space: any access size, at 0x100.
	var b [2]byte
	d.m.Read(MMIOConfigOffset+2, b[:])
	if b != [2]byte{3, 4} {
		t.Fatalf("config read %v", b)
	}
	d.m.Write(MMIOConfigOffset+7, []byte{9})
	if dev.config[7] != 9 {
		t.Fatal("config write not forwarded")
	}

	// A request on queue 1: used entry, interrupt, ACK.
	d.submit(1, 8, 0, 0, 0x80000)
	d.write(regQueueNotify, 1)
	if len(dev.notified) != 1 || dev.notified[0] != 1 {
		t.Fatalf("notified %v", dev.notified)
	}
	r := d.ring(1, 8)
	if used := r.u16(mmioQueueBase(1) + 0x3000 + 2); used != 1 {
		t.Fatalf("used idx %d", used)
	}
	if !d.level || d.read(regInterruptStatus) != InterruptUsedBuffer {
		t.Fatalf("irq %v, InterruptStatus %#x", d.level, d.read(regInterruptStatus))
	}
	// Unacknowledged: pending since before now, not since before it rose.
	if !d.m.InterruptPending(time.Now().Add(time.Second)) || d.m.InterruptPending(time.Now().Add(-time.Hour)) {
		t.Fatal("InterruptPending is wrong about an unacknowledged interrupt")
	}
	diag := d.m.Diagnose()
	if q := diag.Queues[1]; len(diag.Queues) != 2 || !q.Active || q.AvailIdx != 1 || q.LastAvail != 1 || q.UsedIdx != 1 || q.Held != 0 || !diag.IRQLevel {
		t.Fatalf("Diagnose: %v", diag)
	}
	d.write(regInterruptACK, InterruptUsedBuffer)
	if d.level || d.read(regInterruptStatus) != 0 {
		t.Fatal("ACK did not drop the line")
	}
	if d.m.InterruptPending(time.Now().Add(time.Second)) {
		t.Fatal("InterruptPending after the ACK")
	}
	// Out-of-range notifications reach nobody.
	d.write(regQueueNotify, 2)
	d.write(regQueueNotify, 0xffffffff)
	if len(dev.notified) != 1 {
		t.Fatalf("notified %v", dev.notified)
	}
	// Queue registers are frozen after DRIVER_OK.
	d.write(regQueueSel, 1)
	d.write(regQueueDescLow, 0x1230)
	if q := dev.queues[1]; q.DescAddr != mmioQueueBase(1) {
		t.Fatalf("DescAddr changed to %#x after DRIVER_OK", q.DescAddr)
	}

	// Reset.
	resets := dev.resets
	d.write(regStatus, 0)
	if dev.resets != resets+1 || d.read(regStatus) != 0 || d.level {
		t.Fatalf("reset: %d device resets, status %#x, irq %v", dev.resets, d.read(regStatus), d.level)
	}
	d.write(regQueueSel, 0)
	if d.read(regQueueReady) != 0 {
		t.Fatal("queue ready after reset")
	}
	// And again, from scratch.
	d.init(uint64(FeatureVersion1), 8)
	if dev.activated != 2 {
		t.Fatal("no second activation")
	}
	d.submit(0, 8, 3, 0, 0x90000)
	d.write(regQueueNotify, 0)
	if !d.level {
		t.Fatal("no interrupt after reinit")
	}
}

func TestMMIONeedsReset(t *testing.T) {
	dev := &mmioFake{sizes: []uint16{8}}
	d := newMMIODriver(t, dev)
	d.init(FeatureVersion1, 8)
	// Head 9 in a queue of 8.
	r := d.ring(0, 8)
	r.put(mmioQueueBase(0)+0x2000+4, uint16(9))
	r.put(mmioQueueBase(0)+0x2000+2, uint16(1))
	d.write(regQueueNotify, 0)
	if len(dev.popErrs) != 1 || !errors.Is(dev.popErrs[0], ErrMalformed) {
		t.Fatalf("device saw %v", dev.popErrs)
	}
	if d.read(regStatus)&StatusNeedsReset == 0 || !errors.Is(d.m.Err(), ErrMalformed) {
		t.Fatalf("status %#x, Err %v; want NEEDS_RESET", d.read(regStatus), d.m.Err())
	}
	if d.read(regInterruptStatus) != InterruptConfigChange || !d.level {
		t.Fatalf("InterruptStatus %#x, irq %v", d.read(regInterruptStatus), d.level)
	}
	// The transport stops serving.
	d.write(regQueueNotify, 0)
	if len(dev.notified) != 1 {
		t.Fatalf("notified %d times after NEEDS_RESET", len(dev.notified))
	}
	// The driver cannot clear NEEDS_RESET except by reset.
	d.write(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
	if d.read(regStatus)&StatusNeedsReset == 0 {
		t.Fatal("driver cleared NEEDS_RESET")
	}
	d.write(regStatus, 0)
	if d.read(regStatus) != 0 || d.m.Err() != nil || d.level {
		t.Fatal("reset did not clear NEEDS_RESET")
	}
	d.init(FeatureVersion1, 8)
	d.submit(0, 8, 0, 0, 0x80000)
	d.write(regQueueNotify, 0)
	if !d.level || d.read(regInterruptStatus) != InterruptUsedBuffer {
		t.Fatal("device does not serve after reset")
	}
}

func TestMMIOActivationFails(t *testing.T) {
	tests := []struct {
		name  string
		setup func(d *mmioDriver)
	}{
		{"rings outside RAM", func(d *mmioDriver) {
			d.write(regQueueSel, 0)
			d.write(regQueueDescLow, 0)
			d.write(regQueueDescHigh, 0x10)
		}},
		{"device refuses", func(d *mmioDriver) { d.dev.failAct = errors.New("no") }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dev := &mmioFake{sizes: []uint16{8}}
			d := newMMIODriver(t, dev)
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, StatusAcknowledge|StatusDriver)
			d.write(regDriverFeatSel, 1)
			d.write(regDriverFeatures, 1)
			d.write(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK)
			d.write(regQueueSel, 0)
			d.write(regQueueNum, 8)
			d.write(regQueueDescLow, 0x20000)
			d.write(regQueueDriverLow, 0x22000)
			d.write(regQueueDeviceLow, 0x23000)
			tc.setup(d)
			d.write(regQueueReady, 1)
			d.write(regStatus, StatusAcknowledge|StatusDriver|StatusFeaturesOK|StatusDriverOK)
			if dev.activated != 0 {
				t.Fatal("device activated")
			}
			if d.read(regStatus)&StatusNeedsReset == 0 || d.read(regInterruptStatus)&InterruptConfigChange == 0 || !d.level {
				t.Fatalf("status %#x, InterruptStatus %#x", d.read(regStatus), d.read(regInterruptStatus))
			}
			d.write(regQueueNotify, 0)
			if len(dev.notified) != 0 {
				t.Fatal("notification forwarded to an inactive device")
			}
		})
	}
}

// TestMMIOHostile drives register sequences a driver must not use; the
// transport ignores them and keeps its state consistent.
func TestMMIOHostile(t *testing.T) {
	const ad = StatusAcknowledge | StatusDriver
	tests := []struct {
		name   string
		steps  func(d *mmioDriver)
		status uint32 // Status afterwards
	}{
		{"FEATURES_OK without VERSION_1", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, ad)
			d.write(regDriverFeatures, FeatureEventIdx)
			d.write(regStatus, ad|StatusFeaturesOK)
		}, ad},
		{"FEATURES_OK with an unoffered bit", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, ad)
			d.write(regDriverFeatures, 1<<7)
			d.write(regDriverFeatSel, 1)
			d.write(regDriverFeatures, 1)
			d.write(regStatus, ad|StatusFeaturesOK)
		}, ad},
		{"everything at once with refused features", func(d *mmioDriver) {
			d.write(regDriverFeatures, 1<<7)
			d.write(regStatus, ad|StatusFeaturesOK|StatusDriverOK)
		}, ad},
		{"feature word 2", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, ad)
			d.write(regDriverFeatSel, 1)
			d.write(regDriverFeatures, 1)
			d.write(regDriverFeatSel, 2)
			d.write(regDriverFeatures, 0xffffffff)
			d.write(regStatus, ad|StatusFeaturesOK)
		}, ad | StatusFeaturesOK},
		{"DRIVER without ACKNOWLEDGE", func(d *mmioDriver) {
			d.write(regStatus, StatusDriver)
		}, 0},
		{"DRIVER_OK without FEATURES_OK", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, ad)
			d.write(regStatus, ad|StatusDriverOK)
		}, ad},
		{"clearing a bit", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, ad)
			d.write(regStatus, StatusAcknowledge)
		}, ad},
		{"setting NEEDS_RESET", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge|StatusNeedsReset)
		}, StatusAcknowledge},
		{"FAILED", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, StatusAcknowledge|StatusFailed)
		}, StatusAcknowledge | StatusFailed},
		{"features changed after FEATURES_OK", func(d *mmioDriver) {
			d.write(regStatus, StatusAcknowledge)
			d.write(regStatus, ad)
			d.write(regDriverFeatSel, 1)
			d.write(regDriverFeatures, 1)
			d.write(regStatus, ad|StatusFeaturesOK)
			d.write(regDriverFeatSel, 0)
			d.write(regDriverFeatures, 1<<9)
			d.write(regStatus, ad|StatusFeaturesOK|StatusDriverOK)
		}, ad | StatusFeaturesOK | StatusDriverOK},
		{"bad sizes and offsets", func(d *mmioDriver) {
			d.m.Write(regStatus, []byte{StatusAcknowledge})
			d.m.Write(regStatus, []byte{StatusAcknowledge, 0})
			d.m.Write(regStatus, []byte{StatusAcknowledge, 0, 0, 0, 0, 0, 0, 0})
			d.m.Write(regStatus+1, []byte{StatusAcknowledge, 0, 0, 0})
			d.m.Write(regStatus, nil)
			d.m.Write(MMIOSize, []byte{1, 0, 0, 0})
			d.m.Write(1<<63, []byte{1, 0, 0, 0})
			d.m.Write(MMIOSize-2, []byte{1, 0, 0, 0})
			d.m.Write(MMIOConfigOffset, []byte{1, 2, 3})
			d.m.Write(MMIOConfigOffset, make([]byte, 16))
		}, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dev := &mmioFake{sizes: []uint16{8}, config: make([]byte, 4)}
			d := newMMIODriver(t, dev)
			tc.steps(d)
			if got := d.read(regStatus); got != tc.status {
				t.Fatalf("status %#x, want %#x", got, tc.status)
			}
			if dev.activated != 0 && tc.status&StatusDriverOK == 0 {
				t.Fatal("device activated")
			}
			if dev.activated == 1 && dev.gotFeat != FeatureVersion1 {
				t.Fatalf("activated with features %#x", dev.gotFeat)
			}
			if string(dev.config) != "\x00\x00\x00\x00" {
				t.Fatalf("config written: %v", dev.config)
			}
		})
	}
}

func TestMMIOQueueRegisters(t *testing.T) {
	dev := &mmioFake{sizes: []uint16{8}}
	d := newMMIODriver(t, dev)
	d.write(regStatus, StatusAcknowledge)
	d.write(regStatus, StatusAcknowledge|StatusDriver)
	// Reads of unknown and write-only registers are 0, whatever the size.
	for _, off := range []uint64{0x18, 0x20, 0x50, 0x64, 0xc0, 0xf8} {
		if v := d.read(off); v != 0 {
			t.Errorf("register %#x reads %#x", off, v)
		}
	}
	var wide [8]byte
	d.m.Read(regMagic, wide[:])
	if wide != [8]byte{} {
		t.Errorf("8-byte read of MagicValue = %v", wide)
	}
	if d.read(regSHMLenLow) != 0xffffffff {
		t.Error("SHMLen of no region is not -1")
	}
	// Out-of-range queue.
	d.write(regQueueSel, 1)
	if d.read(regQueueNumMax) != 0 {
		t.Error("QueueNumMax of a missing queue is not 0")
	}
	d.write(regQueueReady, 1)
	if d.read(regQueueReady) != 0 {
		t.Error("a missing queue became ready")
	}
	d.write(regQueueSel, 0)
	q := d.m.queues[0]
	d.write(regQueueNum, 9) // above QueueNumMax
	d.write(regQueueNum, 0)
	if q.Size != 0 {
		t.Errorf("QueueNum accepted %d", q.Size)
	}
	d.write(regQueueNum, 4)
	d.write(regQueueDescLow, 0x1000)
	d.write(regQueueDescHigh, 0x2)
	d.write(regQueueReady, 1)
	d.write(regQueueDescLow, 0x5000) // ignored: queue ready
	d.write(regQueueNum, 8)
	if q.Size != 4 || q.DescAddr != 0x2_0000_1000 {
		t.Errorf("queue %d at %#x", q.Size, q.DescAddr)
	}
	d.write(regQueueReady, 0)
	if d.read(regQueueReady) != 0 {
		t.Error("QueueReady 0 not taken")
	}
}

func TestMMIOConfigChanged(t *testing.T) {
	dev := &mmioFake{sizes: []uint16{8}}
	d := newMMIODriver(t, dev)
	d.m.ConfigChanged()
	if d.read(regConfigGeneration) != 1 || d.level {
		t.Fatal("config change before DRIVER_OK")
	}
	d.init(FeatureVersion1, 8)
	d.m.ConfigChanged()
	if d.read(regConfigGeneration) != 2 || d.read(regInterruptStatus) != InterruptConfigChange || !d.level {
		t.Fatal("no config-change interrupt")
	}
	d.write(regInterruptACK, InterruptUsedBuffer) // the wrong bit
	if !d.level {
		t.Fatal("line dropped with a bit still set")
	}
	d.write(regInterruptACK, InterruptConfigChange)
	if d.level {
		t.Fatal("line still up")
	}
	resets := dev.resets
	if err := d.m.Close(); err != nil {
		t.Fatal(err)
	}
	if dev.resets != resets+1 {
		t.Fatal("Close did not reset the device")
	}
}

// FuzzMMIO writes fuzzed register sequences to a transport in front of the
// fake device (with a queue in guest memory the input also fills) and
// checks that the interrupt line always follows InterruptStatus.
func FuzzMMIO(f *testing.F) {
	f.Add([]byte{0x70, 1, 0x70, 3, 0x24, 1, 0x20, 1, 0x70, 11, 0x38, 8, 0x44, 1, 0x70, 15, 0x50, 0})
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: 0x4000}})
	if err != nil {
		f.Fatal(err)
	}
	defer mem.Close()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	f.Fuzz(func(t *testing.T, data []byte) {
		dev := &mmioFake{sizes: []uint16{8, 4}, config: make([]byte, 8)}
		clear(mem.Host(0))
		copy(mem.Host(0), data)
		var level bool
		m := NewMMIO(dev, mem, func(l bool) {
			if l == level {
				t.Fatalf("irq(%v) twice", l)
			}
			level = l
		})
		m.SetLogger(quiet)
		for len(data) >= 2 {
			off, v := uint64(data[0])&^3, uint32(data[1])
			if data[0]&3 == 1 {
				v <<= 12 // addresses
			}
			data = data[2:]
			var b [4]byte
			binary.LittleEndian.PutUint32(b[:], v)
			if data := data; len(data) > 0 && data[0] == 0xff {
				m.Read(off, b[:])
			} else {
				m.Write(off, b[:])
			}
			m.Read(regInterruptStatus, b[:])
			if st := binary.LittleEndian.Uint32(b[:]); (st != 0) != level {
				t.Fatalf("InterruptStatus %#x with the line %v", st, level)
			}
		}
		m.Reset()
		if level {
			t.Fatal("line up after reset")
		}
	})
}

// TestMMIOResetWhileServing resets the transport (as a vCPU writing 0 to
// Status would) while another goroutine pops, pushes and notifies, as a
// device's worker does. Run with -race.
func TestMMIOResetWhileServing(t *testing.T) {
	dev := &mmioFake{sizes: []uint16{8}}
	d := newMMIODriver(t, dev)
	var mu sync.Mutex // the driver's view of the line, written by irq
	d.m.irq = func(level bool) { mu.Lock(); d.level = level; mu.Unlock() }
	for round := 0; round < 50; round++ {
		d.init(FeatureVersion1, 8)
		q := dev.queues[0]
		for h := uint16(0); h < 8; h += 2 {
			d.submit(0, 8, h, h/2, 0x80000+uint64(h)*0x1000)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			for range 100 {
				c, ok, err := q.Pop()
				if err != nil {
					t.Errorf("Pop: %v", err)
					return
				}
				if ok {
					if err := q.Push(c, 0); err != nil && !errors.Is(err, ErrStale) {
						t.Errorf("Push: %v", err)
					}
				}
				q.Notify()
			}
		}()
		d.write(regStatus, 0)
		<-done
		mu.Lock()
		level := d.level
		mu.Unlock()
		if level || d.read(regInterruptStatus) != 0 {
			t.Fatalf("round %d: interrupt pending after reset", round)
		}
	}
}

func (d *mmioFake) SaveState() (json.RawMessage, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return json.Marshal(d.config)
}

func (d *mmioFake) RestoreState(data json.RawMessage) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	var cfg []byte
	if err := json.Unmarshal(data, &cfg); err != nil {
		return err
	}
	if len(cfg) != len(d.config) {
		return errors.New("config length differs")
	}
	copy(d.config, cfg)
	return nil
}
