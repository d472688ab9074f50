package virtio

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/ninep"
	"github.com/kilnvm/kiln/rofs"
)

// Feature9PMountTag is VIRTIO_9P_F_MOUNT_TAG: the config space holds the
// mount tag. Linux refuses a device without it.
const Feature9PMountTag = 1 << 0

const (
	// P9QueueSize is the size of the device's one request queue.
	P9QueueSize = 128
	// P9MaxTagLen bounds the mount tag. The virtio spec sets no limit
	// (tag_len is a le16); this is the spec layer's MaxTagLen.
	P9MaxTagLen = 64
	// P9DefaultWorkers is how many requests are served at once unless
	// told otherwise.
	P9DefaultWorkers = 16
	// p9MaxWorkers bounds FSConfig.Workers: more cannot run than the
	// queue holds chains.
	p9MaxWorkers = P9QueueSize
)

// FSConfig configures a virtio-9p device that exports a read-only tree.
type FSConfig struct {
	// Tag is the mount tag the guest names the device by (mount -t 9p
	// TAG): 1 to P9MaxTagLen printable ASCII bytes, no space.
	Tag string
	// FS is the tree served.
	FS rofs.FS
	// Key says what the tree is (an image's manifest digest): it is saved
	// in the device state, and RestoreState refuses a state of another
	// tree.
	Key string
	// Workers is how many requests are served at once (reads blocked on
	// a fetch hold one each); 0 means P9DefaultWorkers.
	Workers int
	// MaxMsize is the largest msize agreed with the guest; 0 means
	// ninep.DefaultMsize.
	MaxMsize uint32
	// Logger receives the device's logs; slog.Default() when nil.
	Logger *slog.Logger
}

// P9Stats counts what a P9 device served.
type P9Stats struct {
	Requests  uint64 // T-messages served
	Errors    uint64 // Rlerror replies
	BytesRead uint64 // file and xattr bytes the guest read
	Dropped   uint64 // chains with no room for a reply, completed empty
}

// P9 is a virtio-9p device (virtio 1.x, section 5.11) serving a read-only
// tree with a ninep.Server. It takes chains off its one queue on a
// goroutine of its own and serves them on a pool of workers, so that a read
// blocked on a fetch holds up only itself; a Tflush is served at once, off
// the pool.
type P9 struct {
	tag     string
	key     string
	srv     *ninep.Server
	workers int
	log     *slog.Logger
	config  []byte

	mu     sync.Mutex
	queue  *Queue
	kick   chan struct{} // buffered(1): a pending QueueNotify
	cancel context.CancelFunc
	wg     sync.WaitGroup // the dispatcher, the workers and flushes

	// qmu serialises Pop, Push and Notify on the queue: a Queue is used
	// from one goroutine at a time.
	qmu sync.Mutex

	dropped atomic.Uint64
}

var _ Device = (*P9)(nil)

// p9Item is a chain taken from the queue, begun on the server.
type p9Item struct {
	c    *Chain
	call *ninep.Call
}

// NewFS returns a virtio-9p device serving cfg.FS.
func NewFS(cfg FSConfig) (*P9, error) {
	if err := checkTag(cfg.Tag); err != nil {
		return nil, err
	}
	if cfg.FS == nil {
		return nil, fmt.Errorf("virtio-9p %s: no tree given", cfg.Tag)
	}
	workers := cfg.Workers
	switch {
	case workers == 0:
		workers = P9DefaultWorkers
	case workers < 0 || workers > p9MaxWorkers:
		return nil, fmt.Errorf("virtio-9p %s: %d workers, want 1 to %d", cfg.Tag, workers, p9MaxWorkers)
	}
	if cfg.MaxMsize != 0 && (cfg.MaxMsize < ninep.MinMsize || cfg.MaxMsize > ninep.MaxMsizeLimit) {
		return nil, fmt.Errorf("virtio-9p %s: msize %d is outside %d..%d", cfg.Tag, cfg.MaxMsize, ninep.MinMsize, ninep.MaxMsizeLimit)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("device", "virtio-9p", "tag", cfg.Tag)
	p := &P9{
		tag:     cfg.Tag,
		key:     cfg.Key,
		srv:     ninep.NewServer(cfg.FS, ninep.Options{MaxMsize: cfg.MaxMsize, Logger: log}),
		workers: workers,
		log:     log,
		config:  make([]byte, 2+len(cfg.Tag)),
	}
	binary.LittleEndian.PutUint16(p.config, uint16(len(cfg.Tag)))
	copy(p.config[2:], cfg.Tag)
	return p, nil
}

// checkTag checks a mount tag: what mount(8) takes as the device name.
func checkTag(tag string) error {
	if tag == "" || len(tag) > P9MaxTagLen {
		return fmt.Errorf("virtio-9p: mount tag %q is %d bytes, want 1 to %d", tag, len(tag), P9MaxTagLen)
	}
	for i := 0; i < len(tag); i++ {
		if c := tag[i]; c <= ' ' || c > '~' {
			return fmt.Errorf("virtio-9p: mount tag %q has byte %#x at %d: only printable ASCII without spaces", tag, c, i)
		}
	}
	return nil
}

// Tag returns the mount tag.
func (p *P9) Tag() string { return p.tag }

// Server returns the 9P server behind the device.
func (p *P9) Server() *ninep.Server { return p.srv }

// Stats returns the device's counters.
func (p *P9) Stats() P9Stats {
	st := p.srv.Stats()
	return P9Stats{Requests: st.Requests, Errors: st.Errors, BytesRead: st.BytesRead, Dropped: p.dropped.Load()}
}

// Close stops the device (as Reset does). The tree is the caller's to
// release.
func (p *P9) Close() error {
	p.Reset()
	return nil
}

// Diagnose describes the device's session and counters.
func (p *P9) Diagnose() string {
	st := p.Stats()
	p.mu.Lock()
	active := p.cancel != nil
	p.mu.Unlock()
	return fmt.Sprintf("virtio-9p tag=%s key=%s active=%t msize=%d fids=%d in_flight=%d requests=%d errors=%d bytes_read=%d dropped=%d",
		p.tag, p.key, active, p.srv.Msize(), p.srv.Fids(), p.srv.InFlight(), st.Requests, st.Errors, st.BytesRead, st.Dropped)
}

// ID returns ID9P (declared with the device specs).
func (p *P9) ID() uint32 { return ID9P }

// Features returns MOUNT_TAG.
func (p *P9) Features() uint64 { return Feature9PMountTag }

// QueueSizes returns the one request queue's size.
func (p *P9) QueueSizes() []uint16 { return []uint16{P9QueueSize} }

// ReadConfig reads struct virtio_9p_config: le16 tag_len, then the tag
// (not NUL-terminated); zeros past it.
func (p *P9) ReadConfig(offset uint64, data []byte) {
	clear(data)
	if offset < uint64(len(p.config)) {
		copy(data, p.config[offset:])
	}
}

// WriteConfig ignores the write: the config space is read-only.
func (p *P9) WriteConfig(offset uint64, data []byte) {}

// Activate starts serving the request queue.
func (p *P9) Activate(mem *memory.Memory, features uint64, queues []*Queue) error {
	if len(queues) != 1 || queues[0] == nil {
		return fmt.Errorf("virtio-9p %s: activated with %d queues, want 1", p.tag, len(queues))
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.cancel != nil {
		return fmt.Errorf("virtio-9p %s: activated twice without a reset", p.tag)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p.queue, p.cancel = queues[0], cancel
	p.kick = make(chan struct{}, 1)
	p.kick <- struct{}{} // serve anything queued before DRIVER_OK
	// At most the queue's size of chains is held at once, flushes aside:
	// the dispatcher never blocks handing one over.
	pending := make(chan p9Item, P9QueueSize)
	p.wg.Add(1 + p.workers)
	go p.dispatch(ctx, p.queue, p.kick, pending)
	for range p.workers {
		go p.work(p.queue, pending)
	}
	return nil
}

// QueueNotify wakes the dispatcher; it never blocks.
func (p *P9) QueueNotify(index int) {
	if index != 0 {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.kick == nil {
		return
	}
	select {
	case p.kick <- struct{}{}:
	default: // a wake-up is already pending
	}
}

// Reset stops serving: requests in flight are cancelled (a read blocked on
// a fetch gives up), and Reset waits until every goroutine of the device
// has finished. The 9P session (msize, fids) stays until the guest's next
// Tversion.
func (p *P9) Reset() {
	p.mu.Lock()
	cancel := p.cancel
	p.queue, p.kick, p.cancel = nil, nil, nil
	p.mu.Unlock()
	if cancel != nil {
		cancel()
		p.wg.Wait()
	}
}

// dispatch takes every chain the driver makes available, in order, and
// begins it on the server (so that a later Tflush finds it). Tflush is
// served at once on a goroutine of its own: it only waits for the request
// it flushes, which may be waiting for a worker. Other requests go to the
// workers.
func (p *P9) dispatch(ctx context.Context, q *Queue, kick <-chan struct{}, pending chan<- p9Item) {
	defer p.wg.Done()
	defer close(pending)
	for {
		select {
		case <-ctx.Done():
			return
		case <-kick:
		}
		for ctx.Err() == nil {
			p.qmu.Lock()
			c, ok, err := q.Pop()
			p.qmu.Unlock()
			if err != nil {
				if !errors.Is(err, ErrStale) {
					p.log.Warn("request queue stopped", "err", err)
				}
				return
			}
			if !ok {
				break
			}
			var hdr [7]byte
			n := blkGather(hdr[:], c.Readable)
			tag := uint16(ninep.NoTag)
			if n == len(hdr) {
				tag = binary.LittleEndian.Uint16(hdr[5:])
			}
			it := p9Item{c: c, call: p.srv.Begin(ctx, tag)}
			if n == len(hdr) && hdr[4] == p9Tflush {
				p.wg.Add(1)
				go func() {
					defer p.wg.Done()
					p.serve(q, it, new(p9Scratch))
				}()
				continue
			}
			select {
			case pending <- it:
			case <-ctx.Done():
				it.call.Serve(nil, make([]byte, 16), nil) // end the call: nothing waits on it
				return
			}
		}
	}
}

// p9Tflush is the message type of Tflush.
const p9Tflush = 108

// p9Scratch is a worker's buffers: the request copied out of guest memory
// and the reply before it is scattered into the chain.
type p9Scratch struct {
	req, resp []byte
}

// p9Grow returns b with length n, reusing its storage when it can.
func p9Grow(b []byte, n int) []byte {
	if cap(b) >= n {
		return b[:n]
	}
	return make([]byte, n)
}

// work serves chains until the dispatcher stops. After a reset the chains
// left are still served (quickly: their context is cancelled) so that
// every call ends; their pushes fail as stale and are dropped.
func (p *P9) work(q *Queue, pending <-chan p9Item) {
	defer p.wg.Done()
	var s p9Scratch
	for it := range pending {
		p.serve(q, it, &s)
	}
}

// serve runs one chain: the request is the readable buffers (cut to the
// size in its header), the reply goes into the writable ones, and the chain
// is pushed and the driver notified before the call ends, so that an
// Rflush never overtakes the reply of the request it flushed.
func (p *P9) serve(q *Queue, it p9Item, s *p9Scratch) {
	c := it.c
	total := c.ReadableLen()
	maxMsize := int(p.srv.MaxMsize())
	n := min(total, maxMsize)
	var size [4]byte
	if blkGather(size[:], c.Readable) == 4 {
		// The driver's buffers may be longer than the message; a size
		// shorter than a header is malformed, and cutting the message
		// to it would lose the tag the reply must carry.
		if sz := int(binary.LittleEndian.Uint32(size[:])); sz >= 7 && sz <= total && sz <= maxMsize {
			n = sz
		}
	}
	s.req = p9Grow(s.req, n)
	blkGather(s.req, c.Readable)
	w := min(c.WritableLen(), maxMsize)
	s.resp = p9Grow(s.resp, w)
	it.call.Serve(s.req, s.resp, func(r []byte) {
		written := 0
		if len(r) > 0 {
			written, _ = c.Write(r) // r fits: resp was cut to the writable length
		} else {
			p.dropped.Add(1)
		}
		p.qmu.Lock()
		err := q.Push(c, uint32(written))
		if err == nil {
			q.Notify()
		}
		p.qmu.Unlock()
		if err != nil && !errors.Is(err, ErrStale) {
			p.log.Warn("pushing a reply failed", "err", err)
		}
	})
}
