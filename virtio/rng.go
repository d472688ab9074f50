package virtio

import (
	"crypto/rand"
	"sync"

	"github.com/kilnvm/kiln/memory"
)

// RNGMaxChunk is the most random bytes the entropy device writes for one
// request, whatever buffers the driver offers.
const RNGMaxChunk = 64 << 10

// rngQueueSize is the size of the entropy device's one request queue.
const rngQueueSize = 64

// RNG is a virtio entropy device (device ID 4): it fills the buffers the
// driver offers with bytes from the host's getrandom. It has no config
// space and no feature bits.
type RNG struct {
	mu sync.Mutex
	q  *Queue
}

// NewRNG returns an entropy device.
func NewRNG() *RNG { return &RNG{} }

// ID implements Device.
func (r *RNG) ID() uint32 { return IDRNG }

// Features implements Device.
func (r *RNG) Features() uint64 { return 0 }

// QueueSizes implements Device: one request queue.
func (r *RNG) QueueSizes() []uint16 { return []uint16{rngQueueSize} }

// ReadConfig implements Device: there is no config space.
func (r *RNG) ReadConfig(offset uint64, data []byte) { clear(data) }

// WriteConfig implements Device: there is no config space.
func (r *RNG) WriteConfig(offset uint64, data []byte) {}

// Activate implements Device.
func (r *RNG) Activate(mem *memory.Memory, features uint64, queues []*Queue) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.q = queues[0]
	return nil
}

// QueueNotify implements Device: it answers every pending request.
func (r *RNG) QueueNotify(index int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.q == nil || index != 0 {
		return
	}
	for {
		c, ok, err := r.q.Pop()
		if err != nil || !ok {
			break // a malformed queue was reported to the transport by Pop
		}
		left := RNGMaxChunk
		for _, b := range c.Writable {
			if left == 0 {
				break
			}
			n := min(len(b), left)
			rand.Read(b[:n]) // never fails (Go 1.24+); getrandom on Linux
			left -= n
		}
		if err := r.q.Push(c, uint32(RNGMaxChunk-left)); err != nil {
			break
		}
	}
	r.q.Notify()
}

// Reset implements Device.
func (r *RNG) Reset() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.q = nil
}
