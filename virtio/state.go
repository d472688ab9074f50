package virtio

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	"github.com/kilnvm/kiln/memory"
)

// StateVersion is the version of MMIOState's form. A snapshot layer stores
// it beside the state and refuses a state of another version.
const StateVersion = 1

// QueueState is one split virtqueue in a snapshot: what the driver
// configured and how far the device got. The rings themselves live in guest
// memory, which the snapshot holds.
type QueueState struct {
	Size       uint16 `json:"size"`
	Ready      bool   `json:"ready"`
	DescAddr   uint64 `json:"desc_addr"`
	DriverAddr uint64 `json:"driver_addr"`
	DeviceAddr uint64 `json:"device_addr"`
	// Active is whether the device was serving the queue (DRIVER_OK).
	Active bool `json:"active"`
	// LastAvail is the next available-ring entry the device will take,
	// UsedIdx the used ring's index, Notified the used index at the last
	// interrupt decision.
	LastAvail uint16 `json:"last_avail"`
	UsedIdx   uint16 `json:"used_idx"`
	Notified  uint16 `json:"notified"`
}

// MMIOState is a virtio-mmio transport and its device in a snapshot: the
// registers the driver wrote, each queue, and the device's own state in the
// device's own form (Device.SaveState).
type MMIOState struct {
	DeviceID         uint32          `json:"device_id"`
	Status           uint32          `json:"status"`
	DeviceFeatureSel uint32          `json:"device_feature_sel"`
	DriverFeatureSel uint32          `json:"driver_feature_sel"`
	DriverFeatures   uint64          `json:"driver_features"`
	QueueSel         uint32          `json:"queue_sel"`
	InterruptStatus  uint32          `json:"interrupt_status"`
	ConfigGeneration uint32          `json:"config_generation"`
	Failed           string          `json:"failed,omitempty"` // why the device needed reset
	Queues           []QueueState    `json:"queues"`
	Device           json.RawMessage `json:"device,omitempty"`
}

// ErrNotPaused is returned by SaveState on a transport that is not paused.
var ErrNotPaused = errors.New("virtio transport is not paused")

// Pause stops the device taking new chains from its queues and waits until
// it has returned every chain it held, so that nothing the device does
// touches guest memory until Resume: the state SaveState then reads is
// consistent with guest memory. Call it with the vCPUs stopped. Work the
// device still has in host memory (a frame read from a tap, data from a host
// socket) waits until Resume. It fails, leaving the transport paused, when
// ctx ends first.
func (m *MMIO) Pause(ctx context.Context) error {
	m.mu.Lock()
	m.paused = true
	queues := m.queues
	m.mu.Unlock()
	for _, q := range queues {
		q.setPaused(true)
	}
	tick := time.NewTicker(200 * time.Microsecond)
	defer tick.Stop()
	for {
		held := 0
		for _, q := range queues {
			held += q.held()
		}
		if held == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("virtio device %d: %d chains still held: %w", m.id, held, ctx.Err())
		case <-tick.C:
		}
	}
}

// Resume undoes Pause: the device serves its queues again, and is told to
// look at each (work may have arrived while it was paused).
func (m *MMIO) Resume() {
	m.mu.Lock()
	m.paused = false
	queues := m.queues
	m.mu.Unlock()
	for _, q := range queues {
		q.setPaused(false)
	}
	for i := range queues {
		m.notify(uint32(i))
	}
}

// SaveState returns the transport's and its device's state. The transport
// must be paused (Pause).
func (m *MMIO) SaveState() (MMIOState, error) {
	m.devMu.Lock()
	defer m.devMu.Unlock()
	m.mu.Lock()
	if !m.paused {
		m.mu.Unlock()
		return MMIOState{}, fmt.Errorf("virtio device %d: %w", m.id, ErrNotPaused)
	}
	st := MMIOState{
		DeviceID:         m.id,
		Status:           m.status,
		DeviceFeatureSel: m.devFeatSel,
		DriverFeatureSel: m.drvFeatSel,
		DriverFeatures:   m.drvFeat,
		QueueSel:         m.queueSel,
		InterruptStatus:  m.intStatus,
		ConfigGeneration: m.configGen,
	}
	if m.failed != nil {
		st.Failed = m.failed.Error()
	}
	for _, q := range m.queues {
		st.Queues = append(st.Queues, q.state())
	}
	m.mu.Unlock()
	dev, err := m.dev.SaveState()
	if err != nil {
		return MMIOState{}, fmt.Errorf("virtio device %d: save device state: %w", m.id, err)
	}
	st.Device = dev
	return st, nil
}

// RestoreState loads st into a transport that the guest has not touched
// (new, or just reset) whose device was built like the saved one, over
// guest memory restored from the same snapshot. A device that was live
// comes back live: its queues continue where they stopped and the device
// is activated. Every field is checked against the device (its ID, queue
// count and sizes) and guest memory; a state that does not fit gives an
// error and leaves the transport reset.
func (m *MMIO) RestoreState(st MMIOState) error {
	if err := m.checkState(st); err != nil {
		return fmt.Errorf("virtio device %d: restore: %w", m.id, err)
	}
	m.Reset()
	m.devMu.Lock()
	defer m.devMu.Unlock()
	if err := m.dev.RestoreState(st.Device); err != nil {
		return fmt.Errorf("virtio device %d: restore device state: %w", m.id, err)
	}
	m.mu.Lock()
	m.paused = false
	for _, q := range m.queues {
		q.setPaused(false)
	}
	m.status = st.Status
	m.devFeatSel, m.drvFeatSel = st.DeviceFeatureSel, st.DriverFeatureSel
	m.drvFeat, m.queueSel = st.DriverFeatures, st.QueueSel
	m.intStatus, m.configGen = st.InterruptStatus, st.ConfigGeneration
	if st.Failed != "" {
		m.failed = errors.New(st.Failed)
	}
	epoch := m.epoch
	for i, q := range m.queues {
		qs := st.Queues[i]
		q.Size, q.Ready = qs.Size, qs.Ready
		q.DescAddr, q.DriverAddr, q.DeviceAddr = qs.DescAddr, qs.DriverAddr, qs.DeviceAddr
	}
	live := st.Status&StatusDriverOK != 0 && st.Status&StatusFailed == 0 && m.failed == nil
	var err error
	if live {
		interrupt := func() { m.raise(epoch, InterruptUsedBuffer) }
		onError := func(err error) { m.fail(epoch, err) }
		for i, q := range m.queues {
			if !st.Queues[i].Active {
				continue
			}
			if err = q.restore(st.Queues[i], m.mem, m.drvFeat, interrupt, onError); err != nil {
				err = fmt.Errorf("queue %d: %w", i, err)
				break
			}
		}
	}
	// A pending interrupt is raised again: the guest's irqchip state may
	// predate it, and a spurious one is harmless.
	m.updateIRQ()
	m.mu.Unlock()
	if err == nil && live {
		if err = m.dev.Activate(m.mem, m.drvFeat, m.queues); err != nil {
			err = fmt.Errorf("activate device: %w", err)
		}
	}
	if err != nil {
		m.devMu.Unlock()
		m.Reset()
		m.devMu.Lock()
		return fmt.Errorf("virtio device %d: restore: %w", m.id, err)
	}
	return nil
}

// checkState checks st against the transport's device.
func (m *MMIO) checkState(st MMIOState) error {
	if st.DeviceID != m.id {
		return fmt.Errorf("state is of device type %d, this device is type %d", st.DeviceID, m.id)
	}
	if len(st.Queues) != len(m.queues) {
		return fmt.Errorf("state has %d queues, the device has %d", len(st.Queues), len(m.queues))
	}
	if st.DriverFeatures&^m.offer != 0 {
		return fmt.Errorf("state's driver features %#x include bits the device does not offer (%#x)", st.DriverFeatures, st.DriverFeatures&^m.offer)
	}
	if st.Status&^uint32(StatusAcknowledge|StatusDriver|StatusDriverOK|StatusFeaturesOK|StatusNeedsReset|StatusFailed) != 0 {
		return fmt.Errorf("state's status %#x has unknown bits", st.Status)
	}
	for i, qs := range st.Queues {
		if qs.Size > m.sizes[i] {
			return fmt.Errorf("queue %d: size %d is over the device's maximum %d", i, qs.Size, m.sizes[i])
		}
		if qs.Active && (!qs.Ready || st.Status&StatusDriverOK == 0) {
			return fmt.Errorf("queue %d: active but not ready, or the driver is not OK", i)
		}
	}
	return nil
}

// setPaused makes Pop find nothing while paused.
func (q *Queue) setPaused(p bool) {
	q.mu.Lock()
	q.paused = p
	q.mu.Unlock()
}

// held returns how many chains the device has popped and not pushed.
func (q *Queue) held() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.nHeld
}

// state returns the queue's configuration and progress.
func (q *Queue) state() QueueState {
	q.mu.Lock()
	defer q.mu.Unlock()
	return QueueState{
		Size: q.Size, Ready: q.Ready,
		DescAddr: q.DescAddr, DriverAddr: q.DriverAddr, DeviceAddr: q.DeviceAddr,
		Active:    q.active,
		LastAvail: q.lastAvail, UsedIdx: q.usedIdx, Notified: q.notified,
	}
}

// restore activates the queue as the transport does on DRIVER_OK, then
// puts back its progress. The used index in guest memory must agree with
// the state's: otherwise memory and state come from different moments.
func (q *Queue) restore(st QueueState, mem *memory.Memory, features uint64, interrupt func(), onError func(error)) error {
	if err := q.activate(mem, features, interrupt, onError); err != nil {
		return err
	}
	q.mu.Lock()
	defer q.mu.Unlock()
	if got := binary.LittleEndian.Uint16(q.used[2:]); got != st.UsedIdx {
		q.active = false
		return fmt.Errorf("used index in guest memory is %d, the state says %d: memory and device state do not match", got, st.UsedIdx)
	}
	q.lastAvail, q.usedIdx, q.notified = st.LastAvail, st.UsedIdx, st.Notified
	return nil
}
