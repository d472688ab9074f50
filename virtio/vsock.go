package virtio

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kilnvm/kiln/memory"
)

// Vsock limits and sizes.
const (
	// VsockQueueSize is the maximum size of the rx and tx queues.
	VsockQueueSize = 256
	// vsockEventQueueSize is the maximum size of the event queue.
	vsockEventQueueSize = 16
	// vsockMaxConns bounds the connections (host and guest initiated).
	vsockMaxConns = 512
	// vsockMaxRST bounds the RSTs queued for the guest; while it is
	// reached the device stops reading the tx queue until the guest gives
	// rx buffers.
	vsockMaxRST = 256
)

// VsockConfig configures a vsock device.
type VsockConfig struct {
	// CID is the guest's context ID, at least 3.
	CID uint64
	// Path is the host Unix socket that host processes connect to and
	// write "CONNECT <port>\n" on to reach a guest port. A guest
	// connection to the host's port P is relayed to the Unix socket
	// Path_P.
	Path string
	// Dial, when set, dials the host side of a guest connection to the
	// host's port instead of this process dialling Path_P itself (a
	// jailed VMM process, which cannot reach Path_P, asks its parent).
	Dial VsockDialer
}

// VsockDialer returns the host side of a guest connection to the host's
// port: a connected Unix socket, as dialling Path_port gives. It returns
// within ctx.
type VsockDialer func(ctx context.Context, port uint32) (*net.UnixConn, error)

// Vsock is a virtio socket device (virtio 1.x section 5.10) whose host side
// is Unix sockets, with Firecracker's conventions: host processes connect to
// Path and ask for a guest port with "CONNECT <port>\n", answered with
// "OK <hostport>\n" once the guest accepts; guest connections to the host's
// port P go to the Unix socket Path_P. Flow control is the virtio credit
// scheme in both directions, and every connection's buffering is bounded.
type Vsock struct {
	cid  uint64
	path string
	dial VsockDialer // nil: dial path_P
	log  *slog.Logger
	ln   *net.UnixListener

	acceptDone chan struct{}
	pending    map[*net.UnixConn]bool // host connections before CONNECT

	mu        sync.Mutex
	closed    bool
	active    bool
	mem       *memory.Memory
	queues    []*Queue
	kick      chan struct{} // wakes the worker; never nil, needs no lock
	stop      chan struct{}
	done      chan struct{}
	conns     map[vsockKey]*vsockConn
	ready     []*vsockConn // connections with a packet to send
	rsts      []vsockHdr   // RSTs for packets of no connection
	nextPort  uint32
	eventWant bool // a transport reset event is to be sent
	// resetOnActivate makes the next Activate send TRANSPORT_RESET (set by
	// RestoreState: the guest's connections are gone).
	resetOnActivate bool
	broken          bool // a queue is malformed: serve nothing until reset
	// serving is set while serveLocked runs: work made during its pass
	// (a packet that queues a reply, a credit update) is picked up by the
	// same pass rather than waking the worker for an empty one. more
	// says such work was made.
	serving, more bool
}

// NewVsock creates a vsock device for guest cfg.CID and listens on
// cfg.Path (which must not exist). log may be nil.
func NewVsock(cfg VsockConfig, log *slog.Logger) (*Vsock, error) {
	if cfg.CID < 3 || cfg.CID > 0xffffffff {
		return nil, fmt.Errorf("vsock: guest CID %d: want 3 to %d", cfg.CID, uint64(0xffffffff))
	}
	if cfg.Path == "" {
		return nil, errors.New("vsock: no host socket path")
	}
	if log == nil {
		log = slog.Default()
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: cfg.Path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("vsock: listening on %s: %w", cfg.Path, err)
	}
	ln.SetUnlinkOnClose(true)
	v := newVsock(cfg, log)
	v.ln = ln
	go v.acceptLoop()
	return v, nil
}

// NewVsockFromListener creates a vsock device for guest cfg.CID over a
// Unix socket already listening (a jailer made it): host processes
// connect to it, and guest connections to port P still dial cfg.Path_P.
// The device owns ln from the call on.
func NewVsockFromListener(ln *net.UnixListener, cfg VsockConfig, log *slog.Logger) (*Vsock, error) {
	if ln == nil {
		return nil, errors.New("vsock: no listener given")
	}
	if cfg.CID < 3 || cfg.CID > 0xffffffff {
		ln.Close()
		return nil, fmt.Errorf("vsock: guest CID %d: want 3 to %d", cfg.CID, uint64(0xffffffff))
	}
	if log == nil {
		log = slog.Default()
	}
	if cfg.Path == "" {
		cfg.Path = ln.Addr().String()
	}
	v := newVsock(cfg, log)
	v.ln = ln
	go v.acceptLoop()
	return v, nil
}

// newVsock returns a device with no listener (tests use it directly).
func newVsock(cfg VsockConfig, log *slog.Logger) *Vsock {
	return &Vsock{
		cid: cfg.CID, path: cfg.Path, dial: cfg.Dial, log: log.With("device", "vsock"),
		acceptDone: make(chan struct{}),
		pending:    map[*net.UnixConn]bool{},
		kick:       make(chan struct{}, 1),
		conns:      map[vsockKey]*vsockConn{},
		nextPort:   vsockFirstLocalPort,
	}
}

// Close stops the device, drops every connection and removes the
// listening socket.
func (v *Vsock) Close() error {
	v.Reset()
	v.mu.Lock()
	v.closed = true
	for uc := range v.pending {
		uc.Close()
	}
	v.mu.Unlock()
	var err error
	if v.ln != nil {
		if cerr := v.ln.Close(); cerr != nil {
			err = fmt.Errorf("vsock: closing %s: %w", v.path, cerr)
		}
		<-v.acceptDone
	}
	return err
}

// ID implements Device.
func (v *Vsock) ID() uint32 { return IDVsock }

// Features implements Device: stream sockets only.
func (v *Vsock) Features() uint64 { return 0 }

// QueueSizes implements Device: rx, tx and event.
func (v *Vsock) QueueSizes() []uint16 {
	return []uint16{VsockQueueSize, VsockQueueSize, vsockEventQueueSize}
}

// ReadConfig implements Device: the config space is the u64 guest_cid.
func (v *Vsock) ReadConfig(offset uint64, data []byte) {
	var cfg [8]byte
	binary.LittleEndian.PutUint64(cfg[:], v.cid)
	clear(data)
	if offset < uint64(len(cfg)) {
		copy(data, cfg[offset:])
	}
}

// WriteConfig implements Device: the config space is read-only.
func (v *Vsock) WriteConfig(offset uint64, data []byte) {}

// Activate implements Device.
func (v *Vsock) Activate(mem *memory.Memory, features uint64, queues []*Queue) error {
	if len(queues) != 3 {
		return fmt.Errorf("vsock: %d queues, want 3", len(queues))
	}
	v.Reset()
	v.mu.Lock()
	defer v.mu.Unlock()
	v.mem, v.queues = mem, queues
	v.active, v.broken = true, false
	v.eventWant, v.resetOnActivate = v.resetOnActivate, false
	v.stop = make(chan struct{})
	v.done = make(chan struct{})
	go v.serve(v.kick, v.stop, v.done)
	v.kickLocked()
	return nil
}

// QueueNotify implements Device. When the device's lock is free it does
// the work at once on the caller's goroutine (normally the one reading the
// queue's ioeventfd), saving a hand-off to the worker on every packet;
// otherwise it wakes the worker, so that a vCPU never waits for the lock.
func (v *Vsock) QueueNotify(index int) {
	if !v.mu.TryLock() {
		v.wake()
		return
	}
	v.serveLocked()
	v.mu.Unlock()
}

// Reset implements Device: it stops serving the queues and drops every
// connection.
func (v *Vsock) Reset() {
	v.mu.Lock()
	stop, done := v.stop, v.done
	v.active = false
	v.stop, v.done = nil, nil
	v.dropAllLocked()
	v.rsts, v.eventWant = nil, false
	v.mem, v.queues = nil, nil
	v.mu.Unlock()
	if stop != nil {
		close(stop)
		<-done
	}
}

// TransportReset tells the guest that all its connections are gone
// (VIRTIO_VSOCK_EVENT_TRANSPORT_RESET on the event queue, as after a
// snapshot restore) and drops them on the host side.
func (v *Vsock) TransportReset() {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.dropAllLocked()
	v.rsts = nil
	if v.active {
		v.eventWant = true
		v.kickLocked()
	}
}

func (v *Vsock) dropAllLocked() {
	for _, c := range v.conns {
		v.removeLocked(c)
	}
	v.ready = nil
}

// wake wakes the queue worker, if it runs.
func (v *Vsock) wake() {
	select {
	case v.kick <- struct{}{}:
	default:
	}
}

// kickLocked wakes the queue worker (callers hold mu), unless serveLocked
// is running, which then passes once more.
func (v *Vsock) kickLocked() {
	if v.serving {
		v.more = true
		return
	}
	v.wake()
}
func (v *Vsock) queueRSTLocked(h vsockHdr) {
	if len(v.rsts) >= 4*vsockMaxRST {
		return // the guest is flooding without reading: drop
	}
	v.rsts = append(v.rsts, h)
	v.kickLocked()
}

// serve is the queue worker: it handles the tx queue and fills the rx and
// event queues until stop is closed.
func (v *Vsock) serve(kick, stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	for {
		select {
		case <-stop:
			return
		case <-kick:
		}
		v.mu.Lock()
		v.serveLocked()
		v.mu.Unlock()
	}
}

// serveLocked does all the work there is, on whichever goroutine holds the
// lock: the worker, QueueNotify's caller or a host reader with new data. A
// wake-up pending for the worker is taken first, since this pass sees
// everything made available before it. A malformed queue stops the device
// (broken) until reset.
func (v *Vsock) serveLocked() {
	select {
	case <-v.kick:
	default:
	}
	v.serving = true
	defer func() { v.serving = false }()
	for {
		v.more = false
		if err := v.processLocked(); err != nil {
			v.log.Error("vsock queue malformed: stopped serving", "err", err)
			v.broken = true
			v.dropAllLocked()
			return
		}
		if !v.more {
			return
		}
	}
}

// processLocked does all the work there is; an error means a queue is
// malformed.
func (v *Vsock) processLocked() error {
	if !v.active || v.broken {
		return nil
	}
	rx, tx, ev := v.queues[0], v.queues[1], v.queues[2]
	defer rx.Notify()
	defer tx.Notify()
	defer ev.Notify()
	for {
		progress := false
		// Guest to host, unless the guest lets RSTs pile up unread.
		for len(v.rsts) < vsockMaxRST {
			chain, ok, err := tx.Pop()
			if err != nil {
				return fmt.Errorf("tx queue: %w", err)
			}
			if !ok {
				break
			}
			progress = true
			if err := v.handleChainLocked(chain); err != nil {
				v.log.Debug("guest packet", "err", err)
			}
			if err := tx.Push(chain, 0); err != nil {
				return fmt.Errorf("tx queue: %w", err)
			}
		}
		// Host to guest.
		for len(v.rsts) > 0 || len(v.ready) > 0 {
			chain, ok, err := rx.Pop()
			if err != nil {
				return fmt.Errorf("rx queue: %w", err)
			}
			if !ok {
				break
			}
			progress = true
			if err := rx.Push(chain, v.fillRxLocked(chain)); err != nil {
				return fmt.Errorf("rx queue: %w", err)
			}
		}
		if v.eventWant {
			chain, ok, err := ev.Pop()
			if err != nil {
				return fmt.Errorf("event queue: %w", err)
			}
			if ok {
				var e [4]byte
				binary.LittleEndian.PutUint32(e[:], vsockEventTransportReset)
				n, _ := chain.Write(e[:])
				if err := ev.Push(chain, uint32(n)); err != nil {
					return fmt.Errorf("event queue: %w", err)
				}
				v.eventWant = false
			}
		}
		if !progress {
			return nil
		}
	}
}

// handleChainLocked parses and handles one tx chain.
func (v *Vsock) handleChainLocked(chain *Chain) error {
	var b [vsockHdrSize]byte
	if _, err := io.ReadFull(chain, b[:]); err != nil {
		return fmt.Errorf("%w: chain of %d readable bytes, want a %d-byte header", errVsockPacket, chain.ReadableLen(), vsockHdrSize)
	}
	var h vsockHdr
	h.decode(b[:])
	reply, err := h.validate(v.cid, chain.ReadableLen()-vsockHdrSize)
	if err != nil {
		if reply {
			v.queueRSTLocked(h.rstFor())
			if c := v.conns[vsockKey{local: h.DstPort, peer: h.SrcPort}]; c != nil {
				v.removeLocked(c)
			}
		}
		return err
	}
	return v.handlePacketLocked(&h, chain)
}

// fillRxLocked writes the next packet for the guest into chain and returns
// its length, or 0 when the chain is too small for a header (it is then
// returned empty, and the packet waits for the next one).
func (v *Vsock) fillRxLocked(chain *Chain) uint32 {
	var b [vsockHdrSize]byte
	room := chain.WritableLen() - vsockHdrSize
	if room < 0 {
		return 0
	}
	if len(v.rsts) > 0 {
		v.rsts[0].encode(b[:])
		v.rsts = v.rsts[1:]
		if len(v.rsts) == 0 {
			v.rsts = nil
		}
		chain.Write(b[:])
		return vsockHdrSize
	}
	for len(v.ready) > 0 {
		c := v.ready[0]
		v.ready[0] = nil
		v.ready = v.ready[1:]
		if len(v.ready) == 0 {
			v.ready = nil
		}
		c.queued = false
		if !c.wantSend() {
			continue
		}
		h, data := v.nextPacketLocked(c, room)
		h.encode(b[:])
		chain.Write(b[:])
		if len(data) > 0 {
			chain.Write(data)
			c.toGuest = c.toGuest[len(data):]
			if len(c.toGuest) == 0 {
				c.toGuest = c.toGuest[:0:0]
			}
			c.cond.Broadcast()
		}
		v.scheduleLocked(c)
		if h.Op == vsockOpShutdown {
			v.finishIfDoneLocked(c)
		}
		return vsockHdrSize + uint32(len(data))
	}
	return 0
}

// Diagnose describes the connections and what each holds. When the device
// lock stays held (a stuck worker), it says so instead of waiting.
func (v *Vsock) Diagnose() string {
	deadline := time.Now().Add(time.Second)
	for !v.mu.TryLock() {
		if time.Now().After(deadline) {
			return "vsock: device lock held for over a second"
		}
		time.Sleep(10 * time.Millisecond)
	}
	defer v.mu.Unlock()
	var b strings.Builder
	fmt.Fprintf(&b, "vsock cid=%d active=%t broken=%t conns=%d ready=%d rsts=%d eventWant=%t",
		v.cid, v.active, v.broken, len(v.conns), len(v.ready), len(v.rsts), v.eventWant)
	keys := make([]vsockKey, 0, len(v.conns))
	for k := range v.conns {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b vsockKey) int { return int(int64(a.local) - int64(b.local)) })
	for _, k := range keys {
		c := v.conns[k]
		fmt.Fprintf(&b, "\nconn host:%d guest:%d state=%d queued=%t toGuest=%d hostEOF=%t txCnt=%d peerBufAlloc=%d peerFwdCnt=%d credit=%d creditAsked=%t toHost=%d rxCnt=%d fwdCnt=%d lastFwdSent=%d peerNoSend=%t peerNoRcv=%t",
			k.local, k.peer, c.state, c.queued, len(c.toGuest), c.hostEOF, c.txCnt, c.peerBufAlloc, c.peerFwdCnt, c.credit(), c.creditAsked,
			len(c.toHost), c.rxCnt, c.fwdCnt, c.lastFwdSent, c.peerNoSend, c.peerNoRcv)
	}
	return b.String()
}
