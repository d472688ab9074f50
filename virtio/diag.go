package virtio

import (
	"encoding/binary"
	"fmt"
	"strings"
)

// QueueDiag is one queue's indices as the device and the driver see them:
// what to compare when a device and its driver seem to wait on each other.
type QueueDiag struct {
	Index  int
	Active bool
	Size   uint16
	// Device side.
	LastAvail uint16 // next available entry the device will read
	UsedIdx   uint16 // next used entry the device will write
	Notified  uint16 // UsedIdx at the last interrupt decision
	Held      int    // chains popped and not yet pushed
	// Driver side, read from guest memory.
	AvailIdx   uint16
	AvailFlags uint16
	UsedEvent  uint16 // with VIRTIO_F_EVENT_IDX
	EventIdx   bool
	Broken     string
}

func (d QueueDiag) String() string {
	s := fmt.Sprintf("q%d size=%d active=%t avail=%d lastAvail=%d used=%d notified=%d held=%d availFlags=%#x",
		d.Index, d.Size, d.Active, d.AvailIdx, d.LastAvail, d.UsedIdx, d.Notified, d.Held, d.AvailFlags)
	if d.EventIdx {
		s += fmt.Sprintf(" usedEvent=%d", d.UsedEvent)
	}
	if d.Broken != "" {
		s += " broken=" + d.Broken
	}
	return s
}

// diag reads q's state.
func (q *Queue) diag(index int) QueueDiag {
	q.mu.Lock()
	defer q.mu.Unlock()
	d := QueueDiag{Index: index, Active: q.active, Size: q.size, LastAvail: q.lastAvail,
		UsedIdx: q.usedIdx, Notified: q.notified, Held: q.nHeld, EventIdx: q.eventIdx}
	if q.broken != nil {
		d.Broken = q.broken.Error()
	}
	if q.active {
		d.AvailFlags = binary.LittleEndian.Uint16(q.avail)
		d.AvailIdx = binary.LittleEndian.Uint16(q.avail[2:])
		if q.eventIdx {
			d.UsedEvent = binary.LittleEndian.Uint16(q.avail[4+2*int(q.size):])
		}
	}
	return d
}

// Diagnoser is implemented by devices that can describe their inner state
// (connections, buffers) for a diagnosis.
type Diagnoser interface {
	Diagnose() string
}

// TransportDiag is a transport's state for a diagnosis: registers, each
// queue's indices, and the device's own account where it gives one.
type TransportDiag struct {
	DeviceID  uint32
	Status    uint32
	IntStatus uint32
	IRQLevel  bool
	Paused    bool
	Failed    string
	Queues    []QueueDiag
	Device    string
}

func (d TransportDiag) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "virtio device %d: status=%#x intStatus=%#x irqLevel=%t paused=%t", d.DeviceID, d.Status, d.IntStatus, d.IRQLevel, d.Paused)
	if d.Failed != "" {
		fmt.Fprintf(&b, " failed=%q", d.Failed)
	}
	for _, q := range d.Queues {
		fmt.Fprintf(&b, "\n  %v", q)
	}
	if d.Device != "" {
		fmt.Fprintf(&b, "\n  %s", strings.ReplaceAll(d.Device, "\n", "\n  "))
	}
	return b.String()
}

// Diagnose returns the transport's state. It takes no lock the device
// holds while it waits, so it answers even when the device is stuck.
func (m *MMIO) Diagnose() TransportDiag {
	m.mu.Lock()
	d := TransportDiag{DeviceID: m.id, Status: m.status, IntStatus: m.intStatus, IRQLevel: m.irqLevel, Paused: m.paused}
	if m.failed != nil {
		d.Failed = m.failed.Error()
	}
	queues := m.queues
	m.mu.Unlock()
	for i, q := range queues {
		d.Queues = append(d.Queues, q.diag(i))
	}
	if dg, ok := m.dev.(Diagnoser); ok {
		d.Device = dg.Diagnose()
	}
	return d
}
