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
	"strconv"
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
	// vsockBufAlloc is the receive buffer the device advertises per
	// connection: the most guest data it holds for a host socket that does
	// not read.
	vsockBufAlloc = 256 << 10
	// vsockHostBuf bounds the host data read ahead per connection, waiting
	// for the guest's credit and rx buffers.
	vsockHostBuf = 64 << 10
	// vsockReadChunk is the size of one read from a host socket.
	vsockReadChunk = 32 << 10
	// vsockMaxConns bounds the connections (host and guest initiated).
	vsockMaxConns = 512
	// vsockMaxRST bounds the RSTs queued for the guest; while it is
	// reached the device stops reading the tx queue until the guest gives
	// rx buffers.
	vsockMaxRST = 256
	// vsockFirstLocalPort is the first host port given to host-initiated
	// connections (Firecracker's convention).
	vsockFirstLocalPort = 1 << 30
	// vsockConnectTimeout bounds how long a host-initiated connection waits
	// for the guest's answer, and a guest-initiated one for the host
	// listener.
	vsockConnectTimeout = 10 * time.Second
	// vsockMaxConnectLine bounds the host's "CONNECT <port>\n" line.
	vsockMaxConnectLine = 32
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
}

// Vsock is a virtio socket device (virtio 1.x section 5.10) whose host side
// is Unix sockets, with Firecracker's conventions: host processes connect to
// Path and ask for a guest port with "CONNECT <port>\n", answered with
// "OK <hostport>\n" once the guest accepts; guest connections to the host's
// port P go to the Unix socket Path_P. Flow control is the virtio credit
// scheme in both directions, and every connection's buffering is bounded.
type Vsock struct {
	cid  uint64
	path string
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
}

// vsockKey names a connection: the host's port and the guest's.
type vsockKey struct{ local, peer uint32 }

// connection states.
const (
	vsockConnecting = iota // host-initiated: REQUEST sent, waiting for RESPONSE
	vsockDialing           // guest-initiated: dialling Path_P
	vsockEstablished
)

// vsockConn is one connection; all its fields but host, cond's waiting and
// the immutable ones are guarded by Vsock.mu.
type vsockConn struct {
	key   vsockKey
	host  *net.UnixConn
	state int
	cond  *sync.Cond // signalled on buffer and state changes, Vsock.mu
	gone  bool       // removed: goroutines exit

	// host -> guest
	toGuest        []byte // read from host, not yet sent to the guest
	hostEOF        bool   // the host will send no more
	sentShutSend   bool   // SHUTDOWN(SEND) sent to the guest
	txCnt          uint32 // payload bytes sent to the guest
	peerBufAlloc   uint32
	peerFwdCnt     uint32
	creditAsked    bool // CREDIT_REQUEST sent while stalled
	peerNoRcv      bool // the guest will receive no more
	wantRequest    bool
	wantResponse   bool
	wantCredit     bool
	wantCreditReq  bool
	queued         bool
	connectTimeout *time.Timer

	// guest -> host
	toHost      []byte // from the guest, not yet written to the host
	spare       []byte
	okLine      []byte // "OK <port>\n" for host-initiated connections
	rxCnt       uint32 // payload bytes received from the guest
	fwdCnt      uint32 // payload bytes written to the host
	lastFwdSent uint32 // fwdCnt last advertised to the guest
	peerNoSend  bool   // the guest will send no more
	hostWClosed bool   // toHost flushed and the host's write side closed
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

// newVsock returns a device with no listener (tests use it directly).
func newVsock(cfg VsockConfig, log *slog.Logger) *Vsock {
	return &Vsock{
		cid: cfg.CID, path: cfg.Path, log: log.With("device", "vsock"),
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

// QueueNotify implements Device: it only wakes the worker, so the vCPU
// never waits for the device's lock.
func (v *Vsock) QueueNotify(index int) { v.wake() }

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

// kickLocked wakes the queue worker (callers hold mu).
func (v *Vsock) kickLocked() { v.wake() }

// acceptLoop serves the host socket until it is closed.
func (v *Vsock) acceptLoop() {
	defer close(v.acceptDone)
	for {
		uc, err := v.ln.AcceptUnix()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				v.log.Error("accepting host connection", "err", err)
			}
			return
		}
		v.mu.Lock()
		if v.closed {
			v.mu.Unlock()
			uc.Close()
			return
		}
		v.pending[uc] = true
		v.mu.Unlock()
		go v.hostConnect(uc)
	}
}

// hostConnect reads a host connection's CONNECT line and starts the
// connection to the guest.
func (v *Vsock) hostConnect(uc *net.UnixConn) {
	port, err := readConnectLine(uc)
	v.mu.Lock()
	delete(v.pending, uc)
	if err != nil {
		v.mu.Unlock()
		v.log.Warn("host connection", "err", err)
		uc.Close()
		return
	}
	if v.closed || !v.active || len(v.conns) >= vsockMaxConns {
		active, n := v.active, len(v.conns)
		v.mu.Unlock()
		// Before the guest's driver is up this is routine (a client
		// waiting for the guest to boot retries): only a full table is
		// worth a warning.
		level := slog.LevelDebug
		if n >= vsockMaxConns {
			level = slog.LevelWarn
		}
		v.log.Log(context.Background(), level, "host connection refused", "port", port, "active", active, "conns", n)
		uc.Close()
		return
	}
	local := v.allocPortLocked()
	c := v.newConnLocked(vsockKey{local: local, peer: port}, uc, vsockConnecting)
	c.okLine = fmt.Appendf(nil, "OK %d\n", local)
	c.wantRequest = true
	c.connectTimeout = time.AfterFunc(vsockConnectTimeout, func() {
		v.mu.Lock()
		defer v.mu.Unlock()
		if !c.gone && c.state == vsockConnecting {
			v.log.Warn("guest did not answer a connection request", "port", port)
			v.resetLocked(c)
		}
	})
	v.scheduleLocked(c)
	v.mu.Unlock()
	v.hostReader(c)
}

// readConnectLine reads "CONNECT <port>\n" byte by byte (so nothing after
// it is consumed) within vsockConnectTimeout.
func readConnectLine(uc *net.UnixConn) (uint32, error) {
	uc.SetReadDeadline(time.Now().Add(vsockConnectTimeout))
	defer uc.SetReadDeadline(time.Time{})
	var line []byte
	b := make([]byte, 1)
	for {
		if _, err := io.ReadFull(uc, b); err != nil {
			return 0, fmt.Errorf("reading CONNECT line: %w", err)
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
		if len(line) > vsockMaxConnectLine {
			return 0, fmt.Errorf("CONNECT line longer than %d bytes", vsockMaxConnectLine)
		}
	}
	return parseConnectLine(string(line))
}

// parseConnectLine parses "CONNECT <port>" (without the newline; a
// trailing carriage return is accepted).
func parseConnectLine(line string) (uint32, error) {
	arg, ok := strings.CutPrefix(strings.TrimSuffix(line, "\r"), "CONNECT ")
	if !ok {
		return 0, fmt.Errorf("bad CONNECT line %q: want \"CONNECT <port>\"", line)
	}
	port, err := strconv.ParseUint(arg, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("bad port in CONNECT line %q: %w", line, err)
	}
	return uint32(port), nil
}

// allocPortLocked returns a host port no connection uses.
func (v *Vsock) allocPortLocked() uint32 {
	for {
		p := v.nextPort
		v.nextPort++
		if v.nextPort < vsockFirstLocalPort {
			v.nextPort = vsockFirstLocalPort
		}
		used := false
		for k := range v.conns {
			if k.local == p {
				used = true
				break
			}
		}
		if !used {
			return p
		}
	}
}

func (v *Vsock) newConnLocked(key vsockKey, uc *net.UnixConn, state int) *vsockConn {
	c := &vsockConn{key: key, host: uc, state: state}
	c.cond = sync.NewCond(&v.mu)
	v.conns[key] = c
	return c
}

// removeLocked forgets c and closes its host socket.
func (v *Vsock) removeLocked(c *vsockConn) {
	if c.gone {
		return
	}
	c.gone = true
	delete(v.conns, c.key)
	if c.connectTimeout != nil {
		c.connectTimeout.Stop()
	}
	if c.host != nil {
		c.host.Close()
	}
	c.cond.Broadcast()
}

// resetLocked drops c and tells the guest with an RST.
func (v *Vsock) resetLocked(c *vsockConn) {
	if c.gone {
		return
	}
	v.removeLocked(c)
	v.queueRSTLocked(vsockHdr{
		SrcCID: VsockHostCID, DstCID: v.cid, SrcPort: c.key.local, DstPort: c.key.peer,
		Type: vsockTypeStream, Op: vsockOpRST,
	})
}

func (v *Vsock) queueRSTLocked(h vsockHdr) {
	if len(v.rsts) >= 4*vsockMaxRST {
		return // the guest is flooding without reading: drop
	}
	v.rsts = append(v.rsts, h)
	v.kickLocked()
}

// credit is how many payload bytes the guest can take now.
func (c *vsockConn) credit() uint32 {
	inFlight := c.txCnt - c.peerFwdCnt
	if inFlight >= c.peerBufAlloc {
		return 0
	}
	return c.peerBufAlloc - inFlight
}

// wantSend says whether c has a packet for the guest now.
func (c *vsockConn) wantSend() bool {
	if c.gone {
		return false
	}
	if c.wantRequest || c.wantResponse || c.wantCredit {
		return true
	}
	if c.state != vsockEstablished || c.peerNoRcv {
		return false
	}
	if len(c.toGuest) > 0 {
		return c.credit() > 0 || !c.creditAsked
	}
	return c.hostEOF && !c.sentShutSend
}

// scheduleLocked puts c on the ready list if it has something to send.
func (v *Vsock) scheduleLocked(c *vsockConn) {
	if !c.queued && c.wantSend() {
		c.queued = true
		v.ready = append(v.ready, c)
		v.kickLocked()
	}
}

// hdrLocked returns a header from c's host side with our credit.
func (c *vsockConn) hdrLocked(guestCID uint64, op uint16) vsockHdr {
	c.lastFwdSent = c.fwdCnt
	c.wantCredit = false
	return vsockHdr{
		SrcCID: VsockHostCID, DstCID: guestCID, SrcPort: c.key.local, DstPort: c.key.peer,
		Type: vsockTypeStream, Op: op, BufAlloc: vsockBufAlloc, FwdCnt: c.fwdCnt,
	}
}

// hostReader copies the host socket into c.toGuest, at most vsockHostBuf
// ahead of the guest.
func (v *Vsock) hostReader(c *vsockConn) {
	buf := make([]byte, vsockReadChunk)
	for {
		v.mu.Lock()
		for !c.gone && len(c.toGuest) >= vsockHostBuf {
			c.cond.Wait()
		}
		if c.gone {
			v.mu.Unlock()
			return
		}
		v.mu.Unlock()
		n, err := c.host.Read(buf)
		v.mu.Lock()
		if c.gone {
			v.mu.Unlock()
			return
		}
		c.toGuest = append(c.toGuest, buf[:n]...)
		if err != nil {
			if !errors.Is(err, io.EOF) {
				v.log.Debug("host socket read", "port", c.key.peer, "err", err)
				v.resetLocked(c)
				v.mu.Unlock()
				return
			}
			c.hostEOF = true
			v.scheduleLocked(c)
			v.finishIfDoneLocked(c)
			v.mu.Unlock()
			return
		}
		v.scheduleLocked(c)
		v.mu.Unlock()
	}
}

// hostWriter writes c.toHost to the host socket, and advances fwdCnt.
func (v *Vsock) hostWriter(c *vsockConn) {
	if len(c.okLine) > 0 {
		if _, err := c.host.Write(c.okLine); err != nil {
			v.mu.Lock()
			v.resetLocked(c)
			v.mu.Unlock()
			return
		}
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	for {
		for !c.gone && len(c.toHost) == 0 && !(c.peerNoSend && !c.hostWClosed) {
			c.cond.Wait()
		}
		if c.gone {
			return
		}
		if len(c.toHost) == 0 { // the guest sent everything it will
			c.hostWClosed = true
			v.mu.Unlock()
			c.host.CloseWrite()
			v.mu.Lock()
			v.finishIfDoneLocked(c)
			return // the guest may send nothing more
		}
		b := c.toHost
		c.toHost = c.spare[:0]
		v.mu.Unlock()
		n, err := c.host.Write(b)
		v.mu.Lock()
		if c.gone {
			return
		}
		c.fwdCnt += uint32(n)
		if err != nil {
			v.log.Debug("host socket write", "port", c.key.peer, "err", err)
			v.resetLocked(c)
			return
		}
		if len(c.toHost) == 0 {
			c.spare = b[:0]
		} else {
			// The guest sent more meanwhile: keep order.
			c.toHost = append(b[:0], c.toHost...)
		}
		if c.fwdCnt-c.lastFwdSent >= vsockBufAlloc/4 {
			c.wantCredit = true
			v.scheduleLocked(c)
		}
	}
}

// finishIfDoneLocked closes c when neither side will send more: its host
// socket is closed and the guest gets an RST, which ends the connection.
func (v *Vsock) finishIfDoneLocked(c *vsockConn) {
	if c.gone || !c.hostWClosed {
		return
	}
	if c.peerNoRcv || (c.hostEOF && c.sentShutSend) {
		v.resetLocked(c)
	}
}

// startRelayLocked marks c established and starts its host goroutines
// (the reader already runs for host-initiated connections).
func (v *Vsock) startRelayLocked(c *vsockConn, startReader bool) {
	c.state = vsockEstablished
	if c.connectTimeout != nil {
		c.connectTimeout.Stop()
	}
	go v.hostWriter(c)
	if startReader {
		go v.hostReader(c)
	}
	v.scheduleLocked(c)
}

// guestConnect dials Path_P for a guest connection request.
func (v *Vsock) guestConnect(c *vsockConn) {
	path := fmt.Sprintf("%s_%d", v.path, c.key.local)
	d := net.Dialer{Timeout: vsockConnectTimeout}
	nc, err := d.Dial("unix", path)
	v.mu.Lock()
	defer v.mu.Unlock()
	if err != nil {
		if !c.gone {
			v.log.Debug("guest connection refused", "port", c.key.local, "err", err)
			v.resetLocked(c)
		}
		return
	}
	if c.gone {
		nc.Close()
		return
	}
	c.host = nc.(*net.UnixConn)
	c.wantResponse = true
	v.startRelayLocked(c, true)
}

// handlePacketLocked acts on one packet from the guest whose header h
// passed validate; payload is its data (RW only). It returns an error
// only for logging: the guest got an RST or the packet was dropped.
func (v *Vsock) handlePacketLocked(h *vsockHdr, payload io.Reader) error {
	key := vsockKey{local: h.DstPort, peer: h.SrcPort}
	c := v.conns[key]
	if c == nil {
		switch h.Op {
		case vsockOpRST:
			return nil
		case vsockOpRequest:
			if len(v.conns) >= vsockMaxConns || v.path == "" {
				v.queueRSTLocked(h.rstFor())
				return fmt.Errorf("connection request to port %d refused: %d connections", h.DstPort, len(v.conns))
			}
			c = v.newConnLocked(key, nil, vsockDialing)
			c.peerBufAlloc, c.peerFwdCnt = h.BufAlloc, h.FwdCnt
			go v.guestConnect(c)
			return nil
		}
		v.queueRSTLocked(h.rstFor())
		return fmt.Errorf("op %d for no connection (host port %d, guest port %d)", h.Op, h.DstPort, h.SrcPort)
	}
	c.peerBufAlloc, c.peerFwdCnt = h.BufAlloc, h.FwdCnt
	if c.credit() > 0 {
		c.creditAsked = false
	}
	switch h.Op {
	case vsockOpRST:
		v.removeLocked(c)
		return nil
	case vsockOpRequest:
		v.resetLocked(c)
		return fmt.Errorf("connection request for existing connection %d:%d", h.DstPort, h.SrcPort)
	case vsockOpResponse:
		if c.state != vsockConnecting {
			v.resetLocked(c)
			return fmt.Errorf("unexpected response on connection %d:%d", h.DstPort, h.SrcPort)
		}
		v.startRelayLocked(c, false)
	case vsockOpRW:
		if c.state != vsockEstablished || c.peerNoSend {
			v.resetLocked(c)
			return fmt.Errorf("data on connection %d:%d that is not open for it", h.DstPort, h.SrcPort)
		}
		if c.rxCnt-c.fwdCnt+h.Len > vsockBufAlloc {
			v.resetLocked(c)
			return fmt.Errorf("guest overran its credit on connection %d:%d", h.DstPort, h.SrcPort)
		}
		n := len(c.toHost)
		c.toHost = slices.Grow(c.toHost, int(h.Len))[:n+int(h.Len)]
		if _, err := io.ReadFull(payload, c.toHost[n:]); err != nil {
			v.resetLocked(c)
			return fmt.Errorf("reading %d-byte payload: %w", h.Len, err)
		}
		c.rxCnt += h.Len
		c.cond.Broadcast()
	case vsockOpShutdown:
		if h.Flags&vsockShutdownRcv != 0 {
			c.peerNoRcv = true
			c.toGuest = nil
			c.cond.Broadcast()
		}
		if h.Flags&vsockShutdownSend != 0 {
			c.peerNoSend = true
			c.cond.Broadcast()
		}
		if c.state != vsockEstablished && c.peerNoRcv && c.peerNoSend {
			v.resetLocked(c)
			return nil
		}
		v.finishIfDoneLocked(c)
	case vsockOpCreditUpdate:
	case vsockOpCreditRequest:
		c.wantCredit = true
	}
	v.scheduleLocked(c)
	return nil
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
		if err := v.process(); err != nil {
			v.log.Error("vsock queue malformed: stopped serving", "err", err)
			v.mu.Lock()
			v.broken = true
			v.dropAllLocked()
			v.mu.Unlock()
			<-stop
			return
		}
	}
}

// process does all the work there is; an error means a queue is malformed.
func (v *Vsock) process() error {
	v.mu.Lock()
	defer v.mu.Unlock()
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

// nextPacketLocked builds c's next packet, with at most room payload bytes.
func (v *Vsock) nextPacketLocked(c *vsockConn, room int) (vsockHdr, []byte) {
	switch {
	case c.wantRequest:
		c.wantRequest = false
		return c.hdrLocked(v.cid, vsockOpRequest), nil
	case c.wantResponse:
		c.wantResponse = false
		return c.hdrLocked(v.cid, vsockOpResponse), nil
	case c.state == vsockEstablished && !c.peerNoRcv && len(c.toGuest) > 0 && c.credit() > 0:
		n := min(len(c.toGuest), room, int(c.credit()), vsockMaxPayload)
		h := c.hdrLocked(v.cid, vsockOpRW)
		h.Len = uint32(n)
		c.txCnt += uint32(n)
		return h, c.toGuest[:n]
	case c.state == vsockEstablished && !c.peerNoRcv && len(c.toGuest) > 0 && !c.creditAsked:
		c.creditAsked = true
		return c.hdrLocked(v.cid, vsockOpCreditRequest), nil
	case c.state == vsockEstablished && c.hostEOF && len(c.toGuest) == 0 && !c.sentShutSend && !c.peerNoRcv:
		c.sentShutSend = true
		h := c.hdrLocked(v.cid, vsockOpShutdown)
		h.Flags = vsockShutdownSend
		return h, nil
	default: // wantCredit
		return c.hdrLocked(v.cid, vsockOpCreditUpdate), nil
	}
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
