package virtio

import (
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Per-connection buffering.
const (
	// vsockBufAlloc is the receive buffer the device advertises per
	// connection: the most guest data it holds for a host socket that does
	// not read.
	vsockBufAlloc = 256 << 10
	// vsockHostBuf bounds the host data read ahead per connection, waiting
	// for the guest's credit and rx buffers.
	vsockHostBuf = 64 << 10
	// vsockReadChunk is the size of one read from a host socket.
	vsockReadChunk = 32 << 10
)

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
	hostWriting bool   // hostWriter is writing outside the lock
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
	if v.enqueueLocked(c) {
		v.kickLocked()
	}
}

// enqueueLocked puts c on the ready list if it has something to send and
// is not there yet, and says whether it did; the caller serves it or
// wakes the worker.
func (v *Vsock) enqueueLocked(c *vsockConn) bool {
	if c.queued || !c.wantSend() {
		return false
	}
	c.queued = true
	v.ready = append(v.ready, c)
	return true
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
		if v.enqueueLocked(c) {
			// Hand the data to the guest from here rather than wake
			// the worker to do it: one goroutine switch less per packet.
			v.serveLocked()
		}
		v.mu.Unlock()
	}
}

// hostWriter writes c.toHost to the host socket, and advances fwdCnt.
// While it writes without the lock it sets hostWriting, so that
// writeHostLocked does not write beside it out of order.
func (v *Vsock) hostWriter(c *vsockConn) {
	if len(c.okLine) > 0 {
		_, err := c.host.Write(c.okLine)
		v.mu.Lock()
		c.hostWriting = false
		if err != nil {
			v.resetLocked(c)
			v.mu.Unlock()
			return
		}
		v.mu.Unlock()
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
		c.hostWriting = true
		v.mu.Unlock()
		n, err := c.host.Write(b)
		v.mu.Lock()
		c.hostWriting = false
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

// writeHostLocked writes what it can of c.toHost to the host socket
// without blocking, from the goroutine that took the data from the guest:
// a small message then reaches the host without waking hostWriter. What
// the socket does not take now (it is full, or failed) stays in c.toHost
// for hostWriter, which blocks and handles errors. Call it only while
// hostWriter is not writing (hostWriting false), so that order holds.
func (v *Vsock) writeHostLocked(c *vsockConn) {
	if c.host == nil || len(c.toHost) == 0 {
		return
	}
	rc, err := c.host.SyscallConn()
	if err != nil {
		return
	}
	n := 0
	rc.Write(func(fd uintptr) bool {
		for n < len(c.toHost) {
			k, err := unix.Write(int(fd), c.toHost[n:])
			if err == unix.EINTR {
				continue
			}
			if err != nil || k <= 0 {
				break
			}
			n += k
		}
		return true // never wait for the poller: hostWriter does that
	})
	if n == 0 {
		return
	}
	c.fwdCnt += uint32(n)
	c.toHost = c.toHost[:copy(c.toHost, c.toHost[n:])]
	if c.fwdCnt-c.lastFwdSent >= vsockBufAlloc/4 {
		c.wantCredit = true
		v.scheduleLocked(c)
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
	c.hostWriting = len(c.okLine) > 0 // the OK line goes first
	go v.hostWriter(c)
	if startReader {
		go v.hostReader(c)
	}
	v.scheduleLocked(c)
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
		if n == 0 && !c.hostWriting {
			v.writeHostLocked(c)
		}
		if len(c.toHost) > 0 {
			c.cond.Broadcast()
		}
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
