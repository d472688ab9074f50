package virtio

import (
	"encoding/binary"
	"errors"
	"fmt"

	"log/slog"
	"math"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
	"time"
)

// The vsock session's layout in the 64 KiB guest memory: queue q (0 rx,
// 1 tx, 2 event) has its rings at vsockFuzzRings+q*0x400 and size
// vsockFuzzQSize; descriptor i of a queue always points at that queue's
// buffer slot i.
const (
	vsockFuzzQSize   = 8
	vsockFuzzRings   = 0x1000
	vsockFuzzTxBufs  = 0x4000 // 8 slots of 0x200
	vsockFuzzEvBufs  = 0x5000 // 8 slots of 0x10
	vsockFuzzRxBufs  = 0x8000 // 8 slots of 0x1000
	vsockFuzzMaxData = 0x200 - vsockHdrSize
	vsockFuzzClients = 15 // host connections per session (ids 1-15)
	vsockFuzzWait    = 5 * time.Second
)

// vsockFuzzHostPorts are the host ports the harness listens on for guest
// connections (Path_P); vsockFuzzHostPorts[2] has no listener.
var vsockFuzzHostPorts = [3]uint32{5000, 5001, 5002}

// vsockFuzzQueue is the driver's side of one queue of the layout.
type vsockFuzzQueue struct {
	q                  int
	free               []uint16
	bufLen             [vsockFuzzQSize]uint32
	out                [vsockFuzzQSize]bool
	availIdx, usedSeen uint16
}

func (fq *vsockFuzzQueue) desc() uint64  { return vsockFuzzRings + uint64(fq.q)*0x400 }
func (fq *vsockFuzzQueue) avail() uint64 { return fq.desc() + 0x100 }
func (fq *vsockFuzzQueue) used() uint64  { return fq.desc() + 0x200 }
func (fq *vsockFuzzQueue) buf(i uint16) uint64 {
	switch fq.q {
	case 0:
		return vsockFuzzRxBufs + 0x1000*uint64(i)
	case 1:
		return vsockFuzzTxBufs + 0x200*uint64(i)
	}
	return vsockFuzzEvBufs + 0x10*uint64(i)
}

// vsockFuzzClient is one host-side socket of a connection: one the harness
// dialled (CONNECT) or one it accepted from the device (a guest
// connection). It writes bytes id<<4|pos&15, so the guest can tell whose
// data it got and where in the stream.
type vsockFuzzClient struct {
	id        byte
	conn      *net.UnixConn
	key       vsockKey // local is 0 for a refused CONNECT
	written   []byte
	recv      int // bytes the guest got so far
	eof       chan struct{}
	readerEnd chan struct{}
}

// read drains what the device sends the host until the socket ends.
func (c *vsockFuzzClient) read() {
	defer close(c.readerEnd)
	defer close(c.eof)
	buf := make([]byte, 4096)
	for {
		if _, err := c.conn.Read(buf); err != nil {
			return
		}
	}
}

// vsockFuzzCredit is a credit the guest advertised for a connection, and
// the rx entries that may have seen it: from r0 (entries the driver had
// seen before it published the packet) on.
type vsockFuzzCredit struct {
	bufAlloc, fwdCnt uint32
	r0, r1           int
}

// vsockFuzzConn is the model's view of a connection, as the rx stream
// tells it: opened by the device's REQUEST or RESPONSE, ended by its RST.
type vsockFuzzConn struct {
	open    bool
	txCnt   uint32 // payload bytes the guest got since it opened
	client  *vsockFuzzClient
	credits []vsockFuzzCredit
	lastRST int // rx index of the device's last RST for it
}

// vsockFuzz is one FuzzTransportVsock session.
type vsockFuzz struct {
	t       *testing.T
	s       *transportSession
	v       *Vsock
	path    string
	up      bool // the driver initialised the three queues
	queues  [3]*vsockFuzzQueue
	rxSeen  int // rx used entries seen, all sessions
	conns   map[vsockKey]*vsockFuzzConn
	clients []*vsockFuzzClient
	accept  [2]chan *net.UnixConn
	lns     []*net.UnixListener
	wg      sync.WaitGroup
}

func (f *vsockFuzz) conn(k vsockKey) *vsockFuzzConn {
	c := f.conns[k]
	if c == nil {
		c = &vsockFuzzConn{lastRST: -1}
		f.conns[k] = c
	}
	return c
}

// waitFor polls cond (no sleeping beyond yielding) for vsockFuzzWait.
func waitFor(cond func() bool) bool {
	deadline := time.Now().Add(vsockFuzzWait)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		runtime.Gosched()
		time.Sleep(10 * time.Microsecond)
	}
	return true
}

// serving says whether the device is live and reading its tx queue.
func (f *vsockFuzz) serving() bool {
	f.v.mu.Lock()
	defer f.v.mu.Unlock()
	return f.v.active && !f.v.broken && len(f.v.rsts) < vsockMaxRST && f.s.read(regStatus)&(StatusNeedsReset|StatusFailed) == 0
}

// init lays out the three queues and initialises the device with features.
func (f *vsockFuzz) init(features uint64) {
	f.s.reg(regStatus, 0)
	f.forget()
	rings := make([][4]uint64, 3)
	for q := range f.queues {
		fq := &vsockFuzzQueue{q: q}
		for i := vsockFuzzQSize - 1; i >= 0; i-- {
			fq.free = append(fq.free, uint16(i))
		}
		f.s.driverWrite(fq.avail(), make([]byte, 4+2*vsockFuzzQSize))
		f.s.driverWrite(fq.used(), make([]byte, 4+8*vsockFuzzQSize))
		f.queues[q] = fq
		rings[q] = [4]uint64{vsockFuzzQSize, fq.desc(), fq.avail(), fq.used()}
	}
	f.s.initDevice(features, rings)
	f.up = f.s.read(regStatus)&StatusDriverOK != 0
	if f.up {
		// Event buffers, so a transport reset event has somewhere to go.
		for i := 0; i < 2; i++ {
			f.publish(2, 8, true, nil)
		}
		f.s.reg(regQueueNotify, 2)
	}
}

// forget drops the model of the connections: the device was reset.
func (f *vsockFuzz) forget() {
	f.up = false
	f.queues = [3]*vsockFuzzQueue{}
	clear(f.conns)
}

// publish puts one buffer of n bytes (writable or holding data) on queue
// q; false when every descriptor is out.
func (f *vsockFuzz) publish(q int, n uint32, writable bool, data []byte) bool {
	fq := f.queues[q]
	if len(fq.free) == 0 {
		return false
	}
	i := fq.free[len(fq.free)-1]
	fq.free = fq.free[:len(fq.free)-1]
	addr := fq.buf(i)
	if data != nil {
		f.s.driverWrite(addr, data)
	}
	var d [descSize]byte
	binary.LittleEndian.PutUint64(d[:], addr)
	binary.LittleEndian.PutUint32(d[8:], n)
	if writable {
		binary.LittleEndian.PutUint16(d[12:], descFWrite)
	}
	f.s.driverWrite(fq.desc()+descSize*uint64(i), d[:])
	f.s.noteAllowed()
	fq.bufLen[i], fq.out[i] = n, true
	var b [2]byte
	binary.LittleEndian.PutUint16(b[:], i)
	f.s.driverWrite(fq.avail()+4+2*uint64(fq.availIdx%vsockFuzzQSize), b[:])
	fq.availIdx++
	binary.LittleEndian.PutUint16(b[:], fq.availIdx)
	f.s.driverWrite(fq.avail()+2, b[:])
	return true
}

// collect takes the used entries of every queue and checks them: each is
// a head the driver gave, once, with a length within its buffer; rx
// entries are then checked as packets.
func (f *vsockFuzz) collect() {
	if !f.up {
		return
	}
	for q, fq := range f.queues {
		idx := binary.LittleEndian.Uint16(f.s.guestRead(fq.used()+2, 2))
		if n := idx - fq.usedSeen; n > vsockFuzzQSize {
			f.t.Fatalf("queue %d: used index %d, %d entries past the %d seen with %d published", q, idx, n, fq.usedSeen, fq.availIdx)
		}
		for fq.usedSeen != idx {
			e := f.s.guestRead(fq.used()+4+8*uint64(fq.usedSeen%vsockFuzzQSize), 8)
			fq.usedSeen++
			id, n := binary.LittleEndian.Uint32(e), binary.LittleEndian.Uint32(e[4:])
			if id >= vsockFuzzQSize || !fq.out[id] {
				f.t.Fatalf("queue %d: used entry for head %d, which the driver did not give", q, id)
			}
			if n > fq.bufLen[id] && q != 1 {
				f.t.Fatalf("queue %d: used length %d for a %d-byte buffer", q, n, fq.bufLen[id])
			}
			fq.out[id] = false
			fq.free = append(fq.free, uint16(id))
			if q == 0 {
				f.rxPacket(f.s.guestRead(fq.buf(uint16(id)), int(n)))
				f.rxSeen++
			}
		}
	}
}

// rxPacket checks one packet the device gave the guest against the model.
func (f *vsockFuzz) rxPacket(b []byte) {
	if len(b) == 0 {
		return // a buffer too small for a header comes back empty
	}
	var h vsockHdr
	if err := h.decode(b); err != nil {
		f.t.Fatalf("rx packet of %d bytes: %v", len(b), err)
	}
	if h.SrcCID != VsockHostCID || h.DstCID != vsockTestCID || h.Type != vsockTypeStream {
		f.t.Fatalf("rx packet from CID %d to %d, type %d: want %d to %d, stream", h.SrcCID, h.DstCID, h.Type, VsockHostCID, vsockTestCID)
	}
	if int(h.Len) != len(b)-vsockHdrSize || (h.Op != vsockOpRW && h.Len != 0) {
		f.t.Fatalf("rx packet op %d: length field %d in a %d-byte used entry", h.Op, h.Len, len(b))
	}
	k := vsockKey{local: h.SrcPort, peer: h.DstPort}
	c := f.conn(k)
	switch h.Op {
	case vsockOpRequest, vsockOpResponse:
		c.open, c.txCnt, c.client = true, 0, nil
		if h.Op == vsockOpRequest {
			for _, cl := range f.clients {
				if cl.key == k {
					c.client = cl
				}
			}
			if c.client == nil {
				f.t.Fatalf("REQUEST from host port %d to guest port %d, which no host socket asked for", k.local, k.peer)
			}
		}
	case vsockOpRST:
		c.open, c.lastRST = false, f.rxSeen
	case vsockOpRW:
		if !c.open {
			f.t.Fatalf("%d bytes for guest port %d from host port %d, a connection the device never opened", h.Len, k.peer, k.local)
		}
		n := h.Len
		ok := false
		for _, cr := range c.credits {
			if cr.r0 <= f.rxSeen && cr.r1 > c.lastRST {
				if inFlight := c.txCnt - cr.fwdCnt; inFlight < cr.bufAlloc && n <= cr.bufAlloc-inFlight {
					ok = true
					break
				}
			}
		}
		if !ok {
			f.t.Fatalf("%d bytes for guest port %d from host port %d after %d: more than any credit the guest gave (%+v)", n, k.peer, k.local, c.txCnt, c.credits)
		}
		c.txCnt += n
		data := b[vsockHdrSize:]
		if c.client == nil && len(data) > 0 {
			id := data[0] >> 4
			for _, cl := range f.clients {
				if cl.id == id && cl.key == k {
					c.client = cl
				}
			}
			if c.client == nil {
				f.t.Fatalf("data %q for guest port %d from host port %d: from no host socket of that port", data, k.peer, k.local)
			}
		}
		if cl := c.client; cl != nil {
			if cl.recv+len(data) > len(cl.written) || string(data) != string(cl.written[cl.recv:cl.recv+len(data)]) {
				f.t.Fatalf("guest port %d got %x from host socket %d at %d; it wrote %x", k.peer, data, cl.id, cl.recv, cl.written)
			}
			cl.recv += len(data)
		}
	}
}

// portArg picks a port: the usual ones more often than not.
func (f *vsockFuzz) guestPort(arg func() byte) uint32 {
	b := arg()
	if b%4 < 3 {
		return 1024 + uint32(b%4)
	}
	return uint32(arg())
}

func (f *vsockFuzz) hostPort(arg func() byte) uint32 {
	b := arg()
	switch {
	case b%8 < 3:
		return vsockFuzzHostPorts[b%8]
	case b%8 < 7 && len(f.clients) > 0:
		return f.clients[int(b/8)%len(f.clients)].key.local
	}
	return vsockFirstLocalPort + uint32(arg())
}

// tx builds a guest packet from the fuzzer's bytes, publishes it on the tx
// queue and waits until the device consumed it.
func (f *vsockFuzz) tx(arg func() byte) {
	opb, cidb := arg(), arg()
	h := vsockHdr{SrcCID: vsockTestCID, DstCID: VsockHostCID, Type: vsockTypeStream, Op: uint16(opb % 8)}
	if opb >= 0xf0 {
		h.Op = uint16(arg()) | uint16(arg())<<8
	}
	if cidb&1 != 0 {
		h.SrcCID = vsockTestCID + 1
	}
	if cidb&2 != 0 {
		h.DstCID = vsockTestCID
	}
	if cidb&4 != 0 {
		h.Type = 2
	}
	h.SrcPort, h.DstPort = f.guestPort(arg), f.hostPort(arg)
	if h.Op == vsockOpRequest && len(f.clients) >= vsockFuzzClients {
		h.DstPort = vsockFuzzHostPorts[2] // a refused one: no more host sockets
	}
	k := vsockKey{local: h.DstPort, peer: h.SrcPort}
	c := f.conn(k)
	h.Flags = uint32(arg()) & 3
	switch b := arg(); b % 4 {
	case 0:
		h.BufAlloc = 0
	case 1:
		h.BufAlloc = uint32(b)
	case 2:
		h.BufAlloc = 4096
	default:
		h.BufAlloc = uint32(arg()) << (b / 4 % 24)
	}
	received := uint32(0)
	if c.client != nil {
		received = uint32(c.client.recv)
	}
	switch b := arg(); b % 4 {
	case 0:
		h.FwdCnt = received
	case 1:
		h.FwdCnt = received - uint32(b/4)
	case 2:
		h.FwdCnt = uint32(b)
	default:
		h.FwdCnt = ^uint32(b / 4)
	}
	var data []byte
	if h.Op == vsockOpRW || cidb&8 != 0 {
		data = make([]byte, min(int(arg())*2, vsockFuzzMaxData))
		for i := range data {
			data[i] = byte(i) ^ cidb
		}
	}
	h.Len = uint32(len(data))
	if cidb&16 != 0 {
		h.Len = uint32(arg()) << (cidb >> 5 * 2)
	}
	pkt := make([]byte, vsockHdrSize+len(data))
	h.encode(pkt)
	copy(pkt[vsockHdrSize:], data)
	n := uint32(len(pkt))
	if cidb&0xe0 == 0xe0 {
		n = uint32(arg()) % uint32(len(pkt)+1) // a short chain
	}

	if !f.up {
		return
	}
	f.collect()
	if !f.publish(1, n, false, pkt) {
		return
	}
	// What the host side had for this connection before.
	f.v.mu.Lock()
	dc := f.v.conns[k]
	hadHost := dc != nil && dc.host != nil
	f.v.mu.Unlock()
	// The credit counts from the first rx entry that may have seen it:
	// rx entries are checked while the packet is still in flight.
	_, verr := h.validate(vsockTestCID, int(n)-vsockHdrSize)
	valid := int(n) >= vsockHdrSize && verr == nil
	var cr *vsockFuzzCredit
	if valid {
		if len(c.credits) >= 64 {
			c.credits = c.credits[1:]
		}
		c.credits = append(c.credits, vsockFuzzCredit{bufAlloc: h.BufAlloc, fwdCnt: h.FwdCnt, r0: f.rxSeen, r1: math.MaxInt})
		cr = &c.credits[len(c.credits)-1]
	}
	f.s.reg(regQueueNotify, 1)
	fq := f.queues[1]
	if !waitFor(func() bool {
		f.collect()
		return !f.up || fq.usedSeen == fq.availIdx || !f.serving()
	}) {
		f.t.Fatalf("the device did not consume a tx packet in %v: %s", vsockFuzzWait, f.v.Diagnose())
	}
	if !f.up || fq.usedSeen != fq.availIdx {
		return
	}
	f.collect()
	if !valid {
		return
	}
	cr.r1 = f.rxSeen
	switch h.Op {
	case vsockOpRST:
		// A connection the guest resets is gone, on the host side too.
		f.v.mu.Lock()
		gone := f.v.conns[k] == nil
		f.v.mu.Unlock()
		if !gone {
			f.t.Fatalf("guest RST for host port %d, guest port %d: the device keeps the connection", k.local, k.peer)
		}
		if hadHost {
			cl := f.lastClient(k)
			if cl == nil {
				f.t.Fatalf("host port %d, guest port %d had a host socket the harness does not know", k.local, k.peer)
			}
			select {
			case <-cl.eof:
			case <-time.After(vsockFuzzWait):
				f.t.Fatalf("guest RST for host port %d, guest port %d: its host socket %d stays open", k.local, k.peer, cl.id)
			}
		}
	case vsockOpRequest:
		f.awaitDial(k)
	}
}

// lastClient returns the newest host socket of connection k.
func (f *vsockFuzz) lastClient(k vsockKey) *vsockFuzzClient {
	for i := len(f.clients) - 1; i >= 0; i-- {
		if f.clients[i].key == k {
			return f.clients[i]
		}
	}
	return nil
}

// awaitDial waits, after a guest REQUEST for k, until the device has dialled
// the host port or given up, and takes the socket the host accepted.
func (f *vsockFuzz) awaitDial(k vsockKey) {
	var established bool
	if !waitFor(func() bool {
		f.v.mu.Lock()
		defer f.v.mu.Unlock()
		c := f.v.conns[k]
		established = c != nil && c.host != nil
		return c == nil || c.state != vsockDialing
	}) {
		f.t.Fatalf("guest connection to host port %d still dialling after %v", k.local, vsockFuzzWait)
	}
	if !established {
		return
	}
	i := 0
	for i < 2 && vsockFuzzHostPorts[i] != k.local {
		i++
	}
	if i == 2 {
		f.t.Fatalf("guest connection to host port %d established, where nothing listens", k.local)
	}
	select {
	case uc := <-f.accept[i]:
		f.addClient(uc, k)
	case <-time.After(vsockFuzzWait):
		f.t.Fatalf("guest connection to host port %d established, but the host accepted nothing", k.local)
	}
}

func (f *vsockFuzz) addClient(uc *net.UnixConn, k vsockKey) *vsockFuzzClient {
	cl := &vsockFuzzClient{id: byte(len(f.clients) + 1), conn: uc, key: k, eof: make(chan struct{}), readerEnd: make(chan struct{})}
	f.clients = append(f.clients, cl)
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		cl.read()
	}()
	return cl
}

// hostConnect connects to the device's socket and asks for a guest port,
// then waits until the device took the connection or refused it.
func (f *vsockFuzz) hostConnect(arg func() byte) {
	port := f.guestPort(arg)
	if len(f.clients) >= vsockFuzzClients {
		return
	}
	uc, err := net.DialUnix("unix", nil, &net.UnixAddr{Name: f.path, Net: "unix"})
	if err != nil {
		f.t.Fatalf("connecting to the vsock socket: %v", err)
	}
	f.v.mu.Lock()
	next := f.v.nextPort
	f.v.mu.Unlock()
	if _, err := fmt.Fprintf(uc, "CONNECT %d\n", port); err != nil {
		f.t.Fatalf("writing CONNECT: %v", err)
	}
	cl := f.addClient(uc, vsockKey{peer: port})
	if !waitFor(func() bool {
		f.v.mu.Lock()
		defer f.v.mu.Unlock()
		if f.v.nextPort != next {
			cl.key.local = next
			return true
		}
		select {
		case <-cl.eof:
			return true
		default:
			return false
		}
	}) {
		f.t.Fatalf("CONNECT %d neither taken nor refused in %v", port, vsockFuzzWait)
	}
}

// hostWrite writes up to 16*n bytes on a host socket, as much as goes
// without waiting.
func (f *vsockFuzz) hostWrite(arg func() byte) {
	sel, n := arg(), int(arg())*16
	if len(f.clients) == 0 {
		return
	}
	cl := f.clients[int(sel)%len(f.clients)]
	b := make([]byte, n)
	for i := range b {
		b[i] = cl.id<<4 | byte(len(cl.written)+i)&15
	}
	cl.conn.SetWriteDeadline(time.Now().Add(time.Millisecond))
	w, err := cl.conn.Write(b)
	cl.written = append(cl.written, b[:w]...)
	if err != nil && !errors.Is(err, net.ErrClosed) {
		var ne net.Error
		if !errors.As(err, &ne) || !ne.Timeout() {
			cl.conn.Close() // the device closed it: nothing more goes
		}
	}
}

// hostClose closes a host socket, or only its write side.
func (f *vsockFuzz) hostClose(arg func() byte) {
	sel := arg()
	if len(f.clients) == 0 {
		return
	}
	cl := f.clients[int(sel/2)%len(f.clients)]
	if sel&1 != 0 {
		cl.conn.CloseWrite()
	} else {
		cl.conn.Close()
	}
}

// vsockFuzzOps are the vsock session's own opcodes, after transportOps.
const vsockFuzzOps = 6

// fuzzVsockSession is FuzzTransportVsock's body; see its comment.
func fuzzVsockSession(t *testing.T, dir string, ops []byte) {
	baseline := runtime.NumGoroutine()
	path := filepath.Join(dir, "v.sock")
	v, err := NewVsock(VsockConfig{CID: vsockTestCID, Path: path}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	f := &vsockFuzz{t: t, v: v, path: path, conns: map[vsockKey]*vsockFuzzConn{}}
	for i := range f.accept {
		ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: fmt.Sprintf("%s_%d", path, vsockFuzzHostPorts[i]), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		f.lns = append(f.lns, ln)
		ch := make(chan *net.UnixConn, vsockFuzzClients+1)
		f.accept[i] = ch
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			for {
				uc, err := ln.AcceptUnix()
				if err != nil {
					return
				}
				select {
				case ch <- uc:
				default:
					uc.Close()
				}
			}
		}()
	}
	f.s = newTransportSession(t, v, nil)
	defer func() {
		f.s.close()
		v.Close()
		for _, ln := range f.lns {
			ln.Close()
		}
		for _, cl := range f.clients {
			cl.conn.Close()
		}
		for _, ch := range f.accept {
			for len(ch) > 0 {
				(<-ch).Close()
			}
		}
		f.wg.Wait()
		if !waitFor(func() bool { return runtime.NumGoroutine() <= baseline }) {
			buf := make([]byte, 1<<16)
			t.Fatalf("%d goroutines after the device closed, %d before:\n%s", runtime.NumGoroutine(), baseline, buf[:runtime.Stack(buf, true)])
		}
	}()
	for len(ops) > 0 {
		op := ops[0] % (transportOps + vsockFuzzOps)
		ops = ops[1:]
		arg := func() byte {
			if len(ops) == 0 {
				return 0
			}
			b := ops[0]
			ops = ops[1:]
			return b
		}
		switch op {
		case 0, 1, 5:
			// The generic queue 0 setup, heads and pokes would break the
			// layout: op 0 is the vsock init instead, 1 and 5 publish rx
			// buffers.
			if op == 0 {
				f.init(fuzzFeatures(arg() | 1))
			} else if f.up {
				size := uint32(arg()) * 16
				if size < 0x100 {
					size %= 64 // headers that fit or not
				}
				if f.publish(0, min(size, 0x1000), true, nil) {
					f.s.reg(regQueueNotify, 0)
				}
			}
		case 2, 3, 4, 6, 7:
			f.s.step(op, arg)
			if f.s.read(regStatus)&StatusDriverOK == 0 {
				f.forget() // a reset or a refused status: the device is reset
			}
		case 8, 9, 10:
			f.tx(arg)
		case 11:
			f.hostConnect(arg)
		case 12:
			f.hostWrite(arg)
		case 13:
			f.hostClose(arg)
		}
		f.collect()
		f.s.checkLine()
		v.mu.Lock()
		n := len(v.conns)
		v.mu.Unlock()
		if n > vsockFuzzClients+vsockMaxRST {
			t.Fatalf("%d connections", n)
		}
	}
	f.s.finish()
}

// FuzzTransportVsock is the end-to-end target for the vsock device: one
// input is a driver's session (initialisation with fuzzed features, rx
// buffers of fuzzed sizes, tx packets with fuzzed ops, ports, CIDs, types,
// lengths, flags, buf_alloc and fwd_cnt, notifies, register accesses and
// resets) interleaved with the host side's actions over the real Unix
// sockets (CONNECT to a guest port, writes, closes; guest connections to
// ports 5000 and 5001 are accepted). Opcodes (mod 14): 0 init, 1 and 5 an
// rx buffer, 2 3 4 6 7 fuzzTransport's, 8-10 a tx packet, 11 CONNECT, 12
// a host write, 13 a host close.
//
// Checked against a model: the device writes guest memory only in the rx
// and event buffers and used rings; every used entry names an outstanding
// head with a length within its buffer; every rx packet comes from CID 2
// to the guest's CID with a length that matches; data reaches the guest
// only on connections the device opened, within the credit the guest
// advertised, and in the order each host socket wrote it; a guest RST
// removes the connection and closes its host socket; the connections stay
// bounded, and no goroutine outlives the device.
func FuzzTransportVsock(f *testing.F) {
	req := func(op, hostPort byte) []byte { return []byte{8, op, 0, 0, hostPort, 0, 2, 0} }
	// init, rx buffers, a guest connection to 5000, host data, credit,
	// shutdown, RST.
	f.Add(append(append([]byte{0, 1, 1, 200, 1, 200, 1, 200, 1, 200},
		req(vsockOpRequest, 0)...), 12, 0, 4, 8, vsockOpCreditUpdate, 0, 0, 0, 0, 2, 0, 12, 0, 2,
		8, vsockOpShutdown, 0, 0, 0, 3, 2, 0, 13, 0, 8, vsockOpRST, 0, 0, 0, 0, 2, 0))
	// A host CONNECT to guest port 1024, the guest's RESPONSE, data both ways.
	f.Add([]byte{0, 1, 1, 200, 1, 200, 11, 0, 1, 200, 8, vsockOpResponse, 0, 0, 3, 0, 2, 0,
		12, 0, 10, 1, 200, 8, vsockOpRW, 0, 0, 3, 0, 2, 0, 20, 13, 1, 1, 200, 1, 200, 8, vsockOpRST, 0, 0, 3, 0, 2, 0})
	// Small credit, tiny rx buffers, a refused port, bad CIDs, a reset.
	f.Add([]byte{0, 1, 1, 1, 1, 2, 11, 1, 8, vsockOpResponse, 1, 0, 3, 0, 1, 10, 0, 12, 0, 100, 1, 200, 1, 200,
		8, vsockOpRequest, 0, 0, 2, 0, 2, 0, 8, vsockOpRW, 3, 0, 0, 0, 2, 0, 9, 7, 0, 0, 0, 0, 1, 200})
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, ops []byte) {
		sub, err := os.MkdirTemp(dir, "s")
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(sub)
		fuzzVsockSession(t, sub, ops)
	})
}
