package virtio

import (
	"encoding/binary"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/kilnvm/kiln/memory"
)

// MMIOSize is the size of one virtio-mmio transport's register window: the
// registers, then the device config space at MMIOConfigOffset.
const MMIOSize = 0x1000

// MMIOConfigOffset is where the device-specific config space starts.
const MMIOConfigOffset = 0x100

// MMIOQueueNotify is the offset of the QueueNotify register (for an
// ioeventfd).
const MMIOQueueNotify = 0x050

// VendorID is the virtio-mmio vendor ID Kiln's devices report: "KILN".
const VendorID = 0x4e4c494b

// virtio-mmio registers (virtio 1.x section 4.2.2).
const (
	regMagic            = 0x000
	regVersion          = 0x004
	regDeviceID         = 0x008
	regVendorID         = 0x00c
	regDeviceFeatures   = 0x010
	regDeviceFeatSel    = 0x014
	regDriverFeatures   = 0x020
	regDriverFeatSel    = 0x024
	regQueueSel         = 0x030
	regQueueNumMax      = 0x034
	regQueueNum         = 0x038
	regQueueReady       = 0x044
	regQueueNotify      = MMIOQueueNotify
	regInterruptStatus  = 0x060
	regInterruptACK     = 0x064
	regStatus           = 0x070
	regQueueDescLow     = 0x080
	regQueueDescHigh    = 0x084
	regQueueDriverLow   = 0x090
	regQueueDriverHigh  = 0x094
	regQueueDeviceLow   = 0x0a0
	regQueueDeviceHigh  = 0x0a4
	regSHMLenLow        = 0x0b0
	regSHMLenHigh       = 0x0b4
	regSHMBaseLow       = 0x0b8
	regSHMBaseHigh      = 0x0bc
	regConfigGeneration = 0x0fc

	mmioMagic   = 0x74726976 // "virt"
	mmioVersion = 2
)

// Device status bits (section 2.1).
const (
	StatusAcknowledge = 1
	StatusDriver      = 2
	StatusDriverOK    = 4
	StatusFeaturesOK  = 8
	StatusNeedsReset  = 0x40
	StatusFailed      = 0x80
)

// InterruptStatus bits.
const (
	InterruptUsedBuffer   = 1
	InterruptConfigChange = 2
)

// transportFeatures are the reserved feature bits (24 to 41) this transport
// implements; a device's offer of any other reserved bit is dropped.
const (
	transportFeatures = FeatureVersion1 | FeatureIndirectDesc | FeatureEventIdx
	reservedFeatures  = (uint64(1)<<42 - 1) &^ (1<<24 - 1)
)

// MMIO is a virtio-mmio transport (version 2) in front of one Device. Its
// Read and Write serve the guest's accesses to the register window
// (offsets relative to its base), from any vCPU.
type MMIO struct {
	dev    Device
	mem    *memory.Memory
	irq    func(level bool)
	queues []*Queue
	sizes  []uint16
	id     uint32
	offer  uint64 // the feature bits offered
	log    *slog.Logger

	// devMu serializes what the transport asks of the device (activate,
	// notify, reset, config access). Lock order: devMu, then mu, then a
	// Queue's mu. The device is called with devMu only, never with mu (its
	// workers take mu through the queues' interrupt callbacks, which a
	// Queue calls without its own mu).
	devMu sync.Mutex

	mu         sync.Mutex
	status     uint32
	devFeatSel uint32
	drvFeatSel uint32
	drvFeat    uint64
	queueSel   uint32
	intStatus  uint32
	configGen  uint32
	irqLevel   bool
	irqSince   time.Time // when irqLevel last went up
	failed     error     // the queue or activation error that set NEEDS_RESET
	epoch      uint64    // bumped by every reset: callbacks from before are dropped
	paused     bool      // Pause: queues serve nothing until Resume

}

// NewMMIO returns a transport for dev over guest memory mem. irq drives the
// device's interrupt line (level-triggered, active high): true while any
// InterruptStatus bit is set.
func NewMMIO(dev Device, mem *memory.Memory, irq func(level bool)) *MMIO {
	// The device's identity is read once: the transport never calls the
	// device while holding its register lock.
	sizes := dev.QueueSizes()
	m := &MMIO{
		dev: dev, mem: mem, irq: irq, sizes: sizes, id: dev.ID(),
		offer: dev.Features()&^reservedFeatures | transportFeatures,
		log:   slog.Default().With("virtio", dev.ID()),
	}
	for range sizes {
		m.queues = append(m.queues, &Queue{})
	}
	return m
}

// SetLogger sets where the transport logs (a device put in NEEDS_RESET);
// slog.Default() until then. Call it before the guest runs.
func (m *MMIO) SetLogger(l *slog.Logger) { m.log = l.With("virtio", m.id) }

// Read serves a guest read of the register window.
func (m *MMIO) Read(offset uint64, data []byte) {
	clear(data)
	if offset >= MMIOConfigOffset {
		if offset >= MMIOSize || !validSize(len(data)) || offset+uint64(len(data)) > MMIOSize {
			return
		}
		m.devMu.Lock()
		m.dev.ReadConfig(offset-MMIOConfigOffset, data)
		m.devMu.Unlock()
		return
	}
	if len(data) != 4 || offset%4 != 0 {
		return
	}
	m.mu.Lock()
	v := m.readReg(offset)
	m.mu.Unlock()
	binary.LittleEndian.PutUint32(data, v)
}

func validSize(n int) bool { return n == 1 || n == 2 || n == 4 || n == 8 }

// sel returns the selected queue, or nil when QueueSel is out of range.
func (m *MMIO) sel() *Queue {
	if int(m.queueSel) < len(m.queues) {
		return m.queues[m.queueSel]
	}
	return nil
}

func (m *MMIO) readReg(offset uint64) uint32 {
	switch offset {
	case regMagic:
		return mmioMagic
	case regVersion:
		return mmioVersion
	case regDeviceID:
		return m.id
	case regVendorID:
		return VendorID
	case regDeviceFeatures:
		switch m.devFeatSel {
		case 0:
			return uint32(m.offer)
		case 1:
			return uint32(m.offer >> 32)
		}
		return 0
	case regQueueNumMax:
		if int(m.queueSel) < len(m.sizes) {
			return uint32(m.sizes[m.queueSel])
		}
		return 0
	case regQueueReady:
		if q := m.sel(); q != nil && q.Ready {
			return 1
		}
		return 0
	case regInterruptStatus:
		return m.intStatus
	case regStatus:
		return m.status
	case regSHMLenLow, regSHMLenHigh, regSHMBaseLow, regSHMBaseHigh:
		return 0xffffffff // no shared memory regions
	case regConfigGeneration:
		return m.configGen
	}
	return 0
}

// Write serves a guest write to the register window. Writes of the wrong
// size, to read-only or unknown registers, or out of sequence are ignored.
func (m *MMIO) Write(offset uint64, data []byte) {
	if offset >= MMIOConfigOffset {
		if offset >= MMIOSize || !validSize(len(data)) || offset+uint64(len(data)) > MMIOSize {
			return
		}
		m.devMu.Lock()
		m.mu.Lock()
		ok := m.status&StatusFailed == 0
		m.mu.Unlock()
		if ok {
			m.dev.WriteConfig(offset-MMIOConfigOffset, data)
		}
		m.devMu.Unlock()
		return
	}
	if len(data) != 4 || offset%4 != 0 {
		return
	}
	v := binary.LittleEndian.Uint32(data)
	switch offset {
	case regStatus:
		m.writeStatus(v)
	case regQueueNotify:
		m.notify(v)
	default:
		m.mu.Lock()
		m.writeReg(offset, v)
		m.mu.Unlock()
	}
}

func (m *MMIO) writeReg(offset uint64, v uint32) {
	switch offset {
	case regDeviceFeatSel:
		m.devFeatSel = v
	case regDriverFeatSel:
		m.drvFeatSel = v
	case regDriverFeatures:
		if m.status&(StatusFeaturesOK|StatusFailed) != 0 || m.drvFeatSel > 1 {
			return
		}
		shift := 32 * m.drvFeatSel
		m.drvFeat = m.drvFeat&^(0xffffffff<<shift) | uint64(v)<<shift
	case regQueueSel:
		m.queueSel = v
	case regInterruptACK:
		m.intStatus &^= v
		m.updateIRQ()
	default:
		m.writeQueueReg(offset, v)
	}
}

// writeQueueReg handles the selected queue's configuration registers, which
// the driver may write only before DRIVER_OK while the queue is not ready
// (it may always write 0 to QueueReady).
func (m *MMIO) writeQueueReg(offset uint64, v uint32) {
	q := m.sel()
	if q == nil {
		return
	}
	if offset == regQueueReady && v == 0 {
		q.Ready = false
		return
	}
	if m.status&(StatusDriverOK|StatusFailed) != 0 || q.Ready {
		return
	}
	setLow := func(p *uint64) { *p = *p&^0xffffffff | uint64(v) }
	setHigh := func(p *uint64) { *p = *p&0xffffffff | uint64(v)<<32 }
	switch offset {
	case regQueueNum:
		if v >= 1 && v <= uint32(m.sizes[m.queueSel]) {
			q.Size = uint16(v)
		}
	case regQueueReady:
		q.Ready = v == 1
	case regQueueDescLow:
		setLow(&q.DescAddr)
	case regQueueDescHigh:
		setHigh(&q.DescAddr)
	case regQueueDriverLow:
		setLow(&q.DriverAddr)
	case regQueueDriverHigh:
		setHigh(&q.DriverAddr)
	case regQueueDeviceLow:
		setLow(&q.DeviceAddr)
	case regQueueDeviceHigh:
		setHigh(&q.DeviceAddr)
	}
}

// writeStatus runs the device status state machine (section 3.1).
func (m *MMIO) writeStatus(v uint32) {
	if v == 0 {
		m.Reset()
		return
	}
	m.devMu.Lock()
	defer m.devMu.Unlock()
	m.mu.Lock()
	old := m.status
	v = v&^StatusNeedsReset | old&StatusNeedsReset // only the device sets NEEDS_RESET
	set := v &^ old
	switch {
	case old&^v != 0: // the driver may not clear bits, except by writing 0
		m.mu.Unlock()
		return
	case set&StatusDriver != 0 && v&StatusAcknowledge == 0,
		set&StatusFeaturesOK != 0 && v&StatusDriver == 0,
		set&StatusDriverOK != 0 && v&StatusFeaturesOK == 0:
		m.mu.Unlock()
		return // out of sequence
	}
	if set&StatusFeaturesOK != 0 && (m.drvFeat&FeatureVersion1 == 0 || m.drvFeat&^m.offer != 0) {
		// Refused: the driver reads FEATURES_OK back as 0 and gives up.
		v &^= StatusFeaturesOK | StatusDriverOK
		set &^= StatusFeaturesOK | StatusDriverOK
	}
	m.status = v
	activate := set&StatusDriverOK != 0 && v&StatusFailed == 0 && m.failed == nil
	features, epoch := m.drvFeat, m.epoch
	m.mu.Unlock()
	if activate {
		if err := m.activate(features, epoch); err != nil {
			m.fail(epoch, err)
		}
	}
}

// activate maps the ready queues and starts the device. Called with devMu.
func (m *MMIO) activate(features, epoch uint64) error {
	interrupt := func() { m.raise(epoch, InterruptUsedBuffer) }
	onError := func(err error) { m.fail(epoch, err) }
	m.mu.Lock()
	for i, q := range m.queues {
		if !q.Ready {
			continue
		}
		if err := q.activate(m.mem, features, interrupt, onError); err != nil {
			m.mu.Unlock()
			return fmt.Errorf("queue %d: %w", i, err)
		}
	}
	m.mu.Unlock()
	if err := m.dev.Activate(m.mem, features, m.queues); err != nil {
		return fmt.Errorf("activate device: %w", err)
	}
	return nil
}

// raise sets InterruptStatus bits and asserts the line.
func (m *MMIO) raise(epoch uint64, bits uint32) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if epoch != m.epoch {
		return
	}
	m.intStatus |= bits
	m.updateIRQ()
}

// updateIRQ drives the line from InterruptStatus. Called with mu.
func (m *MMIO) updateIRQ() {
	level := m.intStatus != 0
	if level != m.irqLevel {
		m.irqLevel = level
		if level {
			m.irqSince = time.Now()
		}
		if m.irq != nil {
			m.irq(level)
		}
	}
}

// InterruptPending reports whether the device's interrupt has been asserted
// (InterruptStatus non-zero, not acknowledged by the driver) since before
// t. An edge-triggered line raised that long ago and still not
// acknowledged was lost on its way to the guest; see vmm's resend.
func (m *MMIO) InterruptPending(t time.Time) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.irqLevel && m.irqSince.Before(t)
}

// fail puts the device in NEEDS_RESET after the driver broke a queue (or
// activation failed): the transport stops forwarding notifications, every
// queue stops serving, and the driver gets a config-change interrupt.
func (m *MMIO) fail(epoch uint64, err error) {
	m.mu.Lock()
	if epoch != m.epoch || m.failed != nil {
		m.mu.Unlock()
		return
	}
	m.failed = err
	m.status |= StatusNeedsReset
	m.intStatus |= InterruptConfigChange
	m.updateIRQ()
	m.mu.Unlock()
	m.log.Warn("virtio device needs reset", "err", err)
	for _, q := range m.queues {
		q.halt(err)
	}
}

// Err returns the error that put the device in NEEDS_RESET, or nil.
func (m *MMIO) Err() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.failed
}

// Notify delivers a queue notification that reached the VMM another way
// than a guest write to QueueNotify (an ioeventfd the VM registered for
// the queue): the device sees it as that write.
func (m *MMIO) Notify(queue uint32) { m.notify(queue) }

// NumQueues returns how many queues the device has: the indices a guest
// may write to QueueNotify.
func (m *MMIO) NumQueues() int { return len(m.queues) }

// Close resets the device. The VM releases what it registered for the
// transport (ioeventfds, irqfd) before.
func (m *MMIO) Close() error {
	m.Reset()
	return nil
}

// notify forwards a QueueNotify to the device while it is live.
func (m *MMIO) notify(index uint32) {
	m.devMu.Lock()
	defer m.devMu.Unlock()
	m.mu.Lock()
	live := m.status&StatusDriverOK != 0 && m.status&StatusFailed == 0 && m.failed == nil
	m.mu.Unlock()
	if live && int(index) < len(m.queues) {
		m.dev.QueueNotify(int(index))
	}
}

// ConfigChanged tells the driver the device config space changed: it bumps
// ConfigGeneration and raises a config-change interrupt.
func (m *MMIO) ConfigChanged() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.configGen++
	if m.status&StatusDriverOK != 0 {
		m.intStatus |= InterruptConfigChange
		m.updateIRQ()
	}
}

// Reset returns the transport and its device to their initial state, as
// when the driver writes 0 to Status: the device stops, queues forget their
// configuration and the interrupt line drops.
func (m *MMIO) Reset() {
	m.devMu.Lock()
	defer m.devMu.Unlock()
	m.mu.Lock()
	m.epoch++
	m.mu.Unlock()
	m.dev.Reset()
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, q := range m.queues {
		q.Reset()
	}
	m.status = 0
	m.devFeatSel, m.drvFeatSel, m.drvFeat, m.queueSel = 0, 0, 0, 0
	m.failed = nil
	m.intStatus = 0
	m.updateIRQ()
}
