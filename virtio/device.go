// Package virtio implements virtio 1.x devices for Kiln guests over the MMIO
// transport (version 2): split virtqueues with indirect descriptors and
// EVENT_IDX, feature negotiation, reset, notifications through ioeventfd and
// interrupts through the VMM's interrupt line (or irqfd). Everything a guest
// writes into a queue is untrusted: every index, address and length is
// checked against the queue and guest memory, and a malformed queue puts the
// device in NEEDS_RESET instead of crashing or hanging the VMM.
//
// A device (blk, net, vsock, rng) implements Device; the transport owns the
// registers, the queues and the interrupt, and calls the device.
package virtio

import (
	"encoding/json"

	"github.com/kilnvm/kiln/memory"
)

// Device IDs (virtio 1.x, section 5).
const (
	IDNet   = 1
	IDBlock = 2
	IDRNG   = 4
	IDVsock = 19
)

// Feature bits common to all devices.
const (
	FeatureIndirectDesc = 1 << 28
	FeatureEventIdx     = 1 << 29
	FeatureVersion1     = 1 << 32
)

// Device is one virtio device behind a transport.
type Device interface {
	// ID is the virtio device ID (IDBlock, ...).
	ID() uint32
	// Features returns the device feature bits it offers (the transport adds
	// FeatureVersion1, FeatureIndirectDesc and FeatureEventIdx).
	Features() uint64
	// QueueSizes returns the maximum size of each of the device's queues.
	QueueSizes() []uint16
	// ReadConfig fills data from the device-specific config space at offset.
	// Out-of-range reads read zeros.
	ReadConfig(offset uint64, data []byte)
	// WriteConfig handles a driver write to the config space (most devices
	// ignore it).
	WriteConfig(offset uint64, data []byte)
	// Activate is called once the driver sets DRIVER_OK: the device may start
	// serving queues. features are the negotiated bits. The device keeps q
	// and mem; it signals used buffers with q.Notify (through the transport's
	// interrupt), never by itself.
	Activate(mem *memory.Memory, features uint64, queues []*Queue) error
	// QueueNotify is called when the driver notifies queue index (the guest
	// wrote QueueNotify, or its ioeventfd fired). It must not block on I/O
	// for long; devices with slow backends hand the work to a goroutine.
	QueueNotify(index int)
	// Reset stops all work and returns the device to its initial state
	// (driver wrote 0 to Status, or the VM stops). After Reset, Activate may
	// be called again.
	Reset()
	// SaveState returns the device's own state (beyond the transport's
	// registers and queues) in the device's own form, for a snapshot. It is
	// called with the transport paused. A device with nothing to keep
	// returns nil.
	SaveState() (json.RawMessage, error)
	// RestoreState loads what SaveState returned, into a device built with
	// the same configuration, before the transport activates it again. It
	// checks the state against the device (a disk of another size, say)
	// and returns an error naming the difference.
	RestoreState(state json.RawMessage) error
}
