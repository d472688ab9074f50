package virtio

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
)

const (
	vsockTestCID   = 3
	vsockTestQSize = 64
	vsockTestSlot  = 4096 + vsockHdrSize // Linux's rx buffer plus header
)

// vsockTestQueue is the driver side of one split virtqueue in test memory:
// descriptor i always points at data slot i.
type vsockTestQueue struct {
	t                  *testing.T
	mem                *memory.Memory
	q                  *Queue
	desc, avail, used  uint64
	data               uint64
	free               []uint16
	availIdx, usedSeen uint16
}

func newVsockTestQueue(t *testing.T, mem *memory.Memory, base uint64) *vsockTestQueue {
	tq := &vsockTestQueue{
		t: t, mem: mem,
		desc:  base,
		avail: base + 16*vsockTestQSize,
		used:  base + 0x1000,
		data:  base + 0x2000,
	}
	tq.q = &Queue{Size: vsockTestQSize, Ready: true, DescAddr: tq.desc, DriverAddr: tq.avail, DeviceAddr: tq.used}
	if err := tq.q.activate(mem, FeatureVersion1, func() {}, func(error) {}); err != nil {
		t.Fatal(err)
	}
	for i := vsockTestQSize - 1; i >= 0; i-- {
		tq.free = append(tq.free, uint16(i))
	}
	return tq
}

func (tq *vsockTestQueue) put(addr uint64, v any) {
	tq.t.Helper()
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, v)
	if err := tq.mem.WriteAt(b.Bytes(), addr); err != nil {
		tq.t.Fatal(err)
	}
}

func (tq *vsockTestQueue) u16(addr uint64) uint16 {
	var b [2]byte
	if err := tq.mem.ReadAt(b[:], addr); err != nil {
		tq.t.Fatal(err)
	}
	return binary.LittleEndian.Uint16(b[:])
}

// add makes one single-descriptor chain available: data to read, or
// (writable) an empty buffer of n bytes.
func (tq *vsockTestQueue) add(data []byte, writable bool, n int) {
	tq.t.Helper()
	if len(tq.free) == 0 {
		tq.t.Fatal("test queue full")
	}
	d := tq.free[len(tq.free)-1]
	tq.free = tq.free[:len(tq.free)-1]
	addr := tq.data + uint64(d)*vsockTestSlot
	var flags uint16
	if writable {
		flags = descFWrite
	} else {
		n = len(data)
		if err := tq.mem.WriteAt(data, addr); err != nil {
			tq.t.Fatal(err)
		}
	}
	tq.put(tq.desc+16*uint64(d), struct {
		Addr  uint64
		Len   uint32
		Flags uint16
		Next  uint16
	}{addr, uint32(n), flags, 0})
	tq.put(tq.avail+4+2*uint64(tq.availIdx%vsockTestQSize), d)
	tq.availIdx++
	tq.put(tq.avail+2, tq.availIdx)
}

// usedChain is one chain the device gave back.
type usedChain struct {
	data []byte
}

// poll returns the chains used since the last poll, freeing their slots.
func (tq *vsockTestQueue) poll() []usedChain {
	tq.t.Helper()
	var out []usedChain
	for idx := tq.u16(tq.used + 2); tq.usedSeen != idx; tq.usedSeen++ {
		var e [8]byte
		if err := tq.mem.ReadAt(e[:], tq.used+4+8*uint64(tq.usedSeen%vsockTestQSize)); err != nil {
			tq.t.Fatal(err)
		}
		head := binary.LittleEndian.Uint32(e[:])
		n := binary.LittleEndian.Uint32(e[4:])
		b := make([]byte, n)
		if err := tq.mem.ReadAt(b, tq.data+uint64(head)*vsockTestSlot); err != nil {
			tq.t.Fatal(err)
		}
		out = append(out, usedChain{b})
		tq.free = append(tq.free, uint16(head))
	}
	return out
}

// vsockTestGuest is a fake guest driver of a Vsock device.
type vsockTestGuest struct {
	t          *testing.T
	v          *Vsock
	path       string
	rx, tx, ev *vsockTestQueue
	pending    []usedChain // received, not yet returned by recv
}

func newVsockTestGuest(t *testing.T) *vsockTestGuest {
	t.Helper()
	return newVsockTestGuestDial(t, nil)
}

// newVsockTestGuestDial is newVsockTestGuest with dial as the device's
// VsockConfig.Dial.
func newVsockTestGuestDial(t *testing.T, dial VsockDialer) *vsockTestGuest {
	t.Helper()
	dir, err := os.MkdirTemp("", "vsock")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "v.sock")
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: 4 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() }) // after the device's
	v, err := NewVsock(VsockConfig{CID: vsockTestCID, Path: path, Dial: dial}, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := v.Close(); err != nil {
			t.Error(err)
		}
		if _, err := os.Stat(path); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("Close left %s behind (%v)", path, err)
		}
	})
	g := &vsockTestGuest{t: t, v: v, path: path,
		rx: newVsockTestQueue(t, mem, 0),
		tx: newVsockTestQueue(t, mem, 1<<20),
		ev: newVsockTestQueue(t, mem, 2<<20),
	}
	for range vsockTestQSize / 2 {
		g.rx.add(nil, true, vsockTestSlot)
	}
	if err := v.Activate(mem, FeatureVersion1, []*Queue{g.rx.q, g.tx.q, g.ev.q}); err != nil {
		t.Fatal(err)
	}
	return g
}

func (g *vsockTestGuest) send(h vsockHdr, payload []byte) {
	g.t.Helper()
	g.sendRaw(vsockEnc(h, payload))
}

func (g *vsockTestGuest) sendRaw(b []byte) {
	g.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for g.tx.poll(); len(g.tx.free) == 0; g.tx.poll() {
		if time.Now().After(deadline) {
			g.t.Fatal("the device took no tx buffer within 5s")
		}
		time.Sleep(time.Millisecond)
	}
	g.tx.add(b, false, 0)
	g.v.QueueNotify(1)
}

// recv waits for the next packet on the rx queue (and gives the buffer
// back to the device).
func (g *vsockTestGuest) recv() (vsockHdr, []byte) {
	g.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for len(g.pending) == 0 {
		got := g.rx.poll()
		for range got {
			g.rx.add(nil, true, vsockTestSlot)
		}
		if len(got) > 0 {
			g.v.QueueNotify(0)
		}
		g.pending = append(g.pending, got...)
		if len(g.pending) > 0 {
			break
		}
		if time.Now().After(deadline) {
			g.t.Fatal("no packet from the device within 5s")
		}
		time.Sleep(time.Millisecond)
	}
	c := g.pending[0]
	g.pending = g.pending[1:]
	var h vsockHdr
	if err := h.decode(c.data); err != nil {
		g.t.Fatalf("device wrote a bad packet: %v", err)
	}
	if int(h.Len) != len(c.data)-vsockHdrSize {
		g.t.Fatalf("header says %d payload bytes, chain has %d", h.Len, len(c.data)-vsockHdrSize)
	}
	return h, c.data[vsockHdrSize:]
}

// waitFor waits until cond, called with the device locked, holds.
func (g *vsockTestGuest) waitFor(cond func() bool) {
	g.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		g.v.mu.Lock()
		ok := cond()
		g.v.mu.Unlock()
		if ok {
			return
		}
		if time.Now().After(deadline) {
			g.t.Fatal("condition not reached within 5s")
		}
		time.Sleep(time.Millisecond)
	}
}

// quiet checks that the device sends nothing for a while.
func (g *vsockTestGuest) quiet() {
	g.t.Helper()
	time.Sleep(50 * time.Millisecond)
	g.pending = append(g.pending, g.rx.poll()...)
	if len(g.pending) > 0 {
		var h vsockHdr
		h.decode(g.pending[0].data)
		g.t.Fatalf("unexpected packet %+v", h)
	}
}

// expect receives a packet and checks its op and addresses.
func (g *vsockTestGuest) expect(op uint16, local, peer uint32) (vsockHdr, []byte) {
	g.t.Helper()
	h, data := g.recv()
	if h.Op != op || h.SrcCID != VsockHostCID || h.DstCID != vsockTestCID || h.Type != vsockTypeStream ||
		(local != 0 && h.SrcPort != local) || h.DstPort != peer {
		g.t.Fatalf("got %+v, want op %d from host port %d to guest port %d", h, op, local, peer)
	}
	return h, data
}

// expectData receives a data packet, skipping credit requests.
func (g *vsockTestGuest) expectData(local, peer uint32) []byte {
	g.t.Helper()
	for {
		h, data := g.recv()
		if h.Op == vsockOpCreditRequest {
			continue
		}
		if h.Op != vsockOpRW || h.SrcPort != local || h.DstPort != peer {
			g.t.Fatalf("got %+v, want data from host port %d to guest port %d", h, local, peer)
		}
		return data
	}
}

// pkt is a guest packet on a connection.
func (g *vsockTestGuest) pkt(op uint16, guestPort, hostPort uint32) vsockHdr {
	return vsockHdr{SrcCID: vsockTestCID, DstCID: VsockHostCID, SrcPort: guestPort, DstPort: hostPort,
		Type: vsockTypeStream, Op: op, BufAlloc: 1 << 20}
}

// hostConnect connects a host process to guest port, through the guest
// accepting; it returns the host side and the host port.
func (g *vsockTestGuest) hostConnect(port uint32) (*net.UnixConn, *bufio.Reader, uint32) {
	g.t.Helper()
	nc, err := net.Dial("unix", g.path)
	if err != nil {
		g.t.Fatal(err)
	}
	uc := nc.(*net.UnixConn)
	g.t.Cleanup(func() { uc.Close() })
	fmt.Fprintf(uc, "CONNECT %d\n", port)
	req, _ := g.expect(vsockOpRequest, 0, port)
	if req.SrcPort < vsockFirstLocalPort {
		g.t.Errorf("host port %d, want >= %d", req.SrcPort, vsockFirstLocalPort)
	}
	g.send(g.pkt(vsockOpResponse, port, req.SrcPort), nil)
	r := bufio.NewReader(uc)
	uc.SetReadDeadline(time.Now().Add(5 * time.Second))
	line, err := r.ReadString('\n')
	if err != nil || line != fmt.Sprintf("OK %d\n", req.SrcPort) {
		g.t.Fatalf("host read %q, %v; want OK %d", line, err, req.SrcPort)
	}
	return uc, r, req.SrcPort
}

func TestVsockDeviceBasics(t *testing.T) {
	v := newVsock(VsockConfig{CID: 0x1122334455}, slog.New(slog.DiscardHandler))
	if v.ID() != IDVsock || v.Features() != 0 || len(v.QueueSizes()) != 3 {
		t.Errorf("ID %d features %#x queues %v", v.ID(), v.Features(), v.QueueSizes())
	}
	tests := []struct {
		off  uint64
		n    int
		want []byte
	}{
		{0, 8, []byte{0x55, 0x44, 0x33, 0x22, 0x11, 0, 0, 0}},
		{0, 4, []byte{0x55, 0x44, 0x33, 0x22}},
		{4, 4, []byte{0x11, 0, 0, 0}},
		{6, 4, []byte{0, 0, 0, 0}},
		{100, 2, []byte{0, 0}},
	}
	for _, tt := range tests {
		got := bytes.Repeat([]byte{0xff}, tt.n)
		v.ReadConfig(tt.off, got)
		if !bytes.Equal(got, tt.want) {
			t.Errorf("ReadConfig(%d, %d) = %x, want %x", tt.off, tt.n, got, tt.want)
		}
	}
	for _, cfg := range []VsockConfig{{CID: 2, Path: "/tmp/x"}, {CID: 1 << 32, Path: "/tmp/x"}, {CID: 3}} {
		if _, err := NewVsock(cfg, nil); err == nil {
			t.Errorf("NewVsock(%+v) succeeded", cfg)
		}
	}
}

func TestVsockParseConnectLine(t *testing.T) {
	tests := []struct {
		line string
		port uint32
		ok   bool
	}{
		{"CONNECT 52", 52, true},
		{"CONNECT 4294967295\r", 4294967295, true},
		{"CONNECT 4294967296", 0, false},
		{"CONNECT -1", 0, false},
		{"CONNECT", 0, false},
		{"connect 5", 0, false},
		{"CONNECT 5 6", 0, false},
		{"", 0, false},
	}
	for _, tt := range tests {
		port, err := parseConnectLine(tt.line)
		if (err == nil) != tt.ok || port != tt.port {
			t.Errorf("parseConnectLine(%q) = %d, %v", tt.line, port, err)
		}
	}
}

// TestVsockHostInitiated covers a host connection: request, response, data
// both ways, half close from the host, close from the guest.
func TestVsockHostInitiated(t *testing.T) {
	g := newVsockTestGuest(t)
	uc, r, hp := g.hostConnect(1234)

	if _, err := uc.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	_, data := g.expect(vsockOpRW, hp, 1234)
	if string(data) != "hello" {
		t.Errorf("guest got %q", data)
	}
	g.send(g.pkt(vsockOpRW, 1234, hp), []byte("world"))
	buf := make([]byte, 5)
	if _, err := io.ReadFull(r, buf); err != nil || string(buf) != "world" {
		t.Fatalf("host read %q, %v", buf, err)
	}
	// Credit request: answered with our credit, once the device has
	// counted what the host read.
	g.waitFor(func() bool { c := g.v.conns[vsockKey{hp, 1234}]; return c != nil && c.fwdCnt == 5 })
	g.send(g.pkt(vsockOpCreditRequest, 1234, hp), nil)
	h, _ := g.expect(vsockOpCreditUpdate, hp, 1234)
	if h.BufAlloc != vsockBufAlloc || h.FwdCnt != 5 {
		t.Errorf("credit update buf_alloc %d fwd_cnt %d, want %d 5", h.BufAlloc, h.FwdCnt, vsockBufAlloc)
	}
	// The host closes its write side: the guest gets SHUTDOWN(SEND).
	uc.CloseWrite()
	h, _ = g.expect(vsockOpShutdown, hp, 1234)
	if h.Flags != vsockShutdownSend {
		t.Errorf("shutdown flags %d", h.Flags)
	}
	// The guest sends its last data and closes: the host gets it and EOF,
	// the guest gets RST.
	g.send(g.pkt(vsockOpRW, 1234, hp), []byte("bye"))
	sd := g.pkt(vsockOpShutdown, 1234, hp)
	sd.Flags = vsockShutdownRcv | vsockShutdownSend
	g.send(sd, nil)
	rest, err := io.ReadAll(r)
	if err != nil || string(rest) != "bye" {
		t.Errorf("host read %q, %v before EOF", rest, err)
	}
	g.expect(vsockOpRST, hp, 1234)
	g.v.mu.Lock()
	n := len(g.v.conns)
	g.v.mu.Unlock()
	if n != 0 {
		t.Errorf("%d connections left", n)
	}
}

// TestVsockHostConnectRefused: the guest answers RST (nobody listens) and
// the host connection is closed at once, without OK.
func TestVsockHostConnectRefused(t *testing.T) {
	g := newVsockTestGuest(t)
	nc, err := net.Dial("unix", g.path)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	fmt.Fprintf(nc, "CONNECT 99\n")
	req, _ := g.expect(vsockOpRequest, 0, 99)
	start := time.Now()
	g.send(g.pkt(vsockOpRST, 99, req.SrcPort), nil)
	nc.SetReadDeadline(time.Now().Add(5 * time.Second))
	b, err := io.ReadAll(nc)
	if err != nil || len(b) != 0 {
		t.Errorf("host read %q, %v; want EOF", b, err)
	}
	if d := time.Since(start); d > time.Second {
		t.Errorf("refusal took %v", d)
	}
	// A bad CONNECT line is closed too.
	nc2, err := net.Dial("unix", g.path)
	if err != nil {
		t.Fatal(err)
	}
	defer nc2.Close()
	fmt.Fprintf(nc2, "HELLO\n")
	nc2.SetReadDeadline(time.Now().Add(5 * time.Second))
	if b, err := io.ReadAll(nc2); err != nil || len(b) != 0 {
		t.Errorf("bad CONNECT line: host read %q, %v; want EOF", b, err)
	}
	g.quiet()
}

// TestVsockGuestInitiated covers a guest connection to a host listener on
// Path_P, and one to a port nobody listens on.
func TestVsockGuestInitiated(t *testing.T) {
	g := newVsockTestGuest(t)
	ln, err := net.Listen("unix", g.path+"_5000")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	g.send(g.pkt(vsockOpRequest, 40000, 5000), nil)
	g.expect(vsockOpResponse, 5000, 40000)
	hc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	g.send(g.pkt(vsockOpRW, 40000, 5000), []byte("ping"))
	buf := make([]byte, 4)
	hc.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(hc, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("host read %q, %v", buf, err)
	}
	hc.Write([]byte("pong"))
	if _, data := g.expect(vsockOpRW, 5000, 40000); string(data) != "pong" {
		t.Errorf("guest got %q", data)
	}
	// The host closes: SHUTDOWN(SEND) to the guest; the guest's write
	// then fails on the host side and the guest gets RST.
	hc.Close()
	if h, _ := g.expect(vsockOpShutdown, 5000, 40000); h.Flags != vsockShutdownSend {
		t.Errorf("shutdown flags %d", h.Flags)
	}

	// Nobody listens on port 5001.
	g.send(g.pkt(vsockOpRequest, 40001, 5001), nil)
	g.expect(vsockOpRST, 5001, 40001)
}

// TestVsockGuestInitiatedDialer: with VsockConfig.Dial (a jailed VMM's
// parent dialling for it), a guest connection goes to what the dialer
// returns for its port, not to Path_P; a dialer's error, or no connection
// from it, resets the guest's connection.
func TestVsockGuestInitiatedDialer(t *testing.T) {
	dir := t.TempDir()
	ln, err := net.Listen("unix", filepath.Join(dir, "elsewhere"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	ports := make(chan uint32, 3)
	g := newVsockTestGuestDial(t, func(ctx context.Context, port uint32) (*net.UnixConn, error) {
		ports <- port
		if _, ok := ctx.Deadline(); !ok {
			return nil, errors.New("no deadline")
		}
		switch port {
		case 5000:
			var d net.Dialer
			nc, err := d.DialContext(ctx, "unix", filepath.Join(dir, "elsewhere"))
			if err != nil {
				return nil, err
			}
			return nc.(*net.UnixConn), nil
		case 5001:
			return nil, nil
		}
		return nil, fmt.Errorf("no listener on host port %d", port)
	})
	// Path_5000 exists too: the dialer, not it, is used.
	decoy, err := net.Listen("unix", g.path+"_5000")
	if err != nil {
		t.Fatal(err)
	}
	defer decoy.Close()
	g.send(g.pkt(vsockOpRequest, 40000, 5000), nil)
	g.expect(vsockOpResponse, 5000, 40000)
	hc, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer hc.Close()
	g.send(g.pkt(vsockOpRW, 40000, 5000), []byte("ping"))
	buf := make([]byte, 4)
	hc.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(hc, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("host read %q, %v", buf, err)
	}
	hc.Write([]byte("pong"))
	if _, data := g.expect(vsockOpRW, 5000, 40000); string(data) != "pong" {
		t.Errorf("guest got %q", data)
	}
	g.send(g.pkt(vsockOpRequest, 40001, 5001), nil)
	g.expect(vsockOpRST, 5001, 40001)
	g.send(g.pkt(vsockOpRequest, 40002, 5002), nil)
	g.expect(vsockOpRST, 5002, 40002)
	for _, want := range []uint32{5000, 5001, 5002} {
		if got := <-ports; got != want {
			t.Errorf("dialer asked for port %d, want %d", got, want)
		}
	}
}

// TestVsockCreditToGuest: the device never sends more than the guest's
// credit, asks for credit when stalled, and resumes on a credit update.
func TestVsockCreditToGuest(t *testing.T) {
	g := newVsockTestGuest(t)
	nc, err := net.Dial("unix", g.path)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	fmt.Fprintf(nc, "CONNECT 7\n")
	req, _ := g.expect(vsockOpRequest, 0, 7)
	hp := req.SrcPort
	resp := g.pkt(vsockOpResponse, 7, hp)
	resp.BufAlloc = 1000
	g.send(resp, nil)
	msg := bytes.Repeat([]byte("0123456789"), 300) // 3000 bytes
	go nc.Write(msg)
	var got []byte
	for len(got) < 1000 {
		_, data := g.expect(vsockOpRW, hp, 7)
		got = append(got, data...)
	}
	if len(got) != 1000 {
		t.Fatalf("guest got %d bytes with 1000 of credit", len(got))
	}
	g.expect(vsockOpCreditRequest, hp, 7)
	g.quiet()
	upd := g.pkt(vsockOpCreditUpdate, 7, hp)
	upd.BufAlloc, upd.FwdCnt = 1000, 1000
	g.send(upd, nil)
	for len(got) < 2000 {
		got = append(got, g.expectData(hp, 7)...)
	}
	if len(got) != 2000 {
		t.Fatalf("guest got %d bytes with 2000 of credit", len(got))
	}
	upd.BufAlloc, upd.FwdCnt = 1<<20, 2000
	g.send(upd, nil)
	for len(got) < 3000 {
		got = append(got, g.expectData(hp, 7)...)
	}
	if !bytes.Equal(got, msg) {
		t.Error("data corrupted")
	}
}

// TestVsockCreditFromGuest: the device advertises credit as the host
// consumes data, and resets a guest that overruns it.
func TestVsockCreditFromGuest(t *testing.T) {
	g := newVsockTestGuest(t)
	uc, r, hp := g.hostConnect(8)
	chunk := bytes.Repeat([]byte{'x'}, 4096)
	total := 0
	// Send a quarter of the buffer: the host reads it, the device tells
	// the guest with a credit update.
	for total < vsockBufAlloc/4 {
		g.send(g.pkt(vsockOpRW, 8, hp), chunk)
		total += len(chunk)
	}
	if _, err := io.ReadFull(r, make([]byte, total)); err != nil {
		t.Fatal(err)
	}
	h, _ := g.expect(vsockOpCreditUpdate, hp, 8)
	if h.FwdCnt != uint32(total) || h.BufAlloc != vsockBufAlloc {
		t.Errorf("credit update fwd_cnt %d buf_alloc %d, want %d %d", h.FwdCnt, h.BufAlloc, total, vsockBufAlloc)
	}
	// The host stops reading; the guest sends past its credit and is
	// reset, and the device holds no more than its buffer meanwhile.
	uc.SetReadBuffer(4096)
	sent := 0
	for sent <= 2*vsockBufAlloc+(8<<20) {
		g.send(g.pkt(vsockOpRW, 8, hp), chunk)
		sent += len(chunk)
		g.v.mu.Lock()
		c := g.v.conns[vsockKey{hp, 8}]
		var held int
		if c != nil {
			held = len(c.toHost)
		}
		g.v.mu.Unlock()
		if held > vsockBufAlloc {
			t.Fatalf("device holds %d bytes for the host", held)
		}
		if c == nil {
			break
		}
	}
	for {
		h, _ := g.recv()
		if h.Op == vsockOpRST {
			break
		}
		if h.Op != vsockOpCreditUpdate {
			t.Fatalf("got %+v, want credit updates then RST", h)
		}
	}
}

// TestVsockBadPackets: hostile packets get an RST or are dropped.
func TestVsockBadPackets(t *testing.T) {
	g := newVsockTestGuest(t)
	p := g.pkt(vsockOpRW, 1, 2)
	tests := []struct {
		name string
		raw  func() []byte
		rst  bool
	}{
		{"short header", func() []byte { return make([]byte, 20) }, false},
		{"wrong source CID", func() []byte { h := p; h.SrcCID = 9; return vsockEnc(h, nil) }, false},
		{"wrong destination CID", func() []byte { h := p; h.DstCID = 5; return vsockEnc(h, nil) }, false},
		{"RST with bad type", func() []byte { h := p; h.Op, h.Type = vsockOpRST, 2; return vsockEnc(h, nil) }, false},
		{"RST for no connection", func() []byte { h := p; h.Op = vsockOpRST; return vsockEnc(h, nil) }, false},
		{"seqpacket", func() []byte { h := p; h.Type = 2; return vsockEnc(h, nil) }, true},
		{"unknown op", func() []byte { h := p; h.Op = 99; return vsockEnc(h, nil) }, true},
		{"op 0", func() []byte { h := p; h.Op = 0; return vsockEnc(h, nil) }, true},
		{"length past the chain", func() []byte { h := p; h.Len = 100; return vsockEnc(h, []byte("abc")) }, true},
		{"huge length", func() []byte { h := p; h.Len = 1 << 31; return vsockEnc(h, nil) }, true},
		{"data for no connection", func() []byte { return vsockEnc(p, []byte("abc")) }, true},
		{"shutdown for no connection", func() []byte { h := p; h.Op = vsockOpShutdown; return vsockEnc(h, nil) }, true},
		{"response for no connection", func() []byte { h := p; h.Op = vsockOpResponse; return vsockEnc(h, nil) }, true},
		{"request with payload", func() []byte { h := p; h.Op, h.Len = vsockOpRequest, 3; return vsockEnc(h, []byte("abc")) }, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g.t = t
			g.sendRaw(tt.raw())
			if tt.rst {
				g.expect(vsockOpRST, 2, 1)
			}
			g.quiet()
		})
	}
}

func vsockEnc(h vsockHdr, payload []byte) []byte {
	b := make([]byte, vsockHdrSize+len(payload))
	if h.Len == 0 {
		h.Len = uint32(len(payload))
	}
	h.encode(b)
	copy(b[vsockHdrSize:], payload)
	return b
}

// TestVsockTransportReset: the event reaches the guest and host
// connections are closed.
func TestVsockTransportReset(t *testing.T) {
	g := newVsockTestGuest(t)
	_, r, _ := g.hostConnect(77)
	g.ev.add(nil, true, 4)
	g.v.TransportReset()
	deadline := time.Now().Add(5 * time.Second)
	var got []usedChain
	for len(got) == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
		got = g.ev.poll()
	}
	if len(got) != 1 || !bytes.Equal(got[0].data, []byte{0, 0, 0, 0}) {
		t.Fatalf("event queue got %v, want one transport reset event", got)
	}
	if b, err := io.ReadAll(r); err != nil || len(b) != 0 {
		t.Errorf("host read %q, %v; want EOF", b, err)
	}
	// The device still works after it.
	g.hostConnect(78)
}

// TestVsockMalformedQueue: a broken tx queue stops the device without a
// panic.
func TestVsockMalformedQueue(t *testing.T) {
	g := newVsockTestGuest(t)
	g.tx.put(g.tx.avail+2, uint16(1000)) // 1000 chains in a queue of 64
	g.v.QueueNotify(1)
	deadline := time.Now().Add(5 * time.Second)
	for {
		g.v.mu.Lock()
		broken := g.v.broken
		g.v.mu.Unlock()
		if broken {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("device did not notice the malformed queue")
		}
		time.Sleep(time.Millisecond)
	}
	g.v.Reset()
}

// FuzzVsockPacket feeds sequences of guest packets (each a chain, its
// header possibly split across buffers) to the packet handler and drains
// the replies, checking that nothing panics and buffering stays bounded.
func FuzzVsockPacket(f *testing.F) {
	hdr := func(op uint16, l uint32, flags uint32) []byte {
		h := vsockHdr{SrcCID: vsockTestCID, DstCID: VsockHostCID, SrcPort: 10, DstPort: 20, Len: l,
			Type: vsockTypeStream, Op: op, Flags: flags, BufAlloc: 4096, FwdCnt: 0}
		b := make([]byte, vsockHdrSize+int(l))
		h.encode(b)
		return b
	}
	seq := func(pkts ...[]byte) []byte {
		var out []byte
		for _, p := range pkts {
			out = binary.LittleEndian.AppendUint16(out, uint16(len(p)))
			out = append(out, p...)
		}
		return out
	}
	f.Add(seq(hdr(vsockOpRequest, 0, 0)))
	f.Add(seq(hdr(vsockOpRW, 5, 0), hdr(vsockOpShutdown, 0, 3)))
	f.Add(seq(hdr(vsockOpRequest, 0, 0), hdr(vsockOpCreditRequest, 0, 0), hdr(vsockOpRST, 0, 0)))
	f.Add(seq(hdr(99, 0, 0), hdr(vsockOpRW, 70000, 0)[:50]))
	f.Add([]byte{1, 0, 0})
	dir := f.TempDir()
	f.Fuzz(func(t *testing.T, data []byte) {
		v := newVsock(VsockConfig{CID: vsockTestCID, Path: filepath.Join(dir, "none")}, slog.New(slog.DiscardHandler))
		v.mu.Lock()
		// A connection in every state, so packets can hit them; the
		// peers read nothing, so the device must bound what it holds.
		for i, st := range []int{vsockConnecting, vsockDialing, vsockEstablished} {
			ours, theirs := vsockSocketPair(t)
			defer theirs.Close()
			if st == vsockDialing {
				ours.Close()
				ours = nil
			}
			c := v.newConnLocked(vsockKey{local: 20 + uint32(i), peer: 10}, ours, st)
			c.peerBufAlloc = 1000
			if st == vsockEstablished {
				go v.hostWriter(c)
			}
		}
		for len(data) >= 2 {
			n := int(binary.LittleEndian.Uint16(data))
			data = data[2:]
			n = min(n, len(data))
			pkt := data[:n]
			data = data[n:]
			chain := &Chain{}
			split := min(len(pkt), 1+n%vsockHdrSize)
			chain.Readable = [][]byte{pkt[:split], pkt[split:]}
			v.handleChainLocked(chain)
			for len(v.rsts) > 0 || len(v.ready) > 0 {
				rx := &Chain{Writable: [][]byte{make([]byte, 100)}}
				if n := v.fillRxLocked(rx); n > 100 || n == 0 {
					t.Fatalf("fillRx wrote %d bytes into 100", n)
				}
			}
			for _, c := range v.conns {
				if len(c.toHost) > vsockBufAlloc || len(c.toGuest) > vsockHostBuf {
					t.Fatalf("connection holds %d/%d bytes", len(c.toHost), len(c.toGuest))
				}
			}
			if len(v.conns) > vsockMaxConns {
				t.Fatalf("%d connections", len(v.conns))
			}
		}
		v.mu.Unlock()
		v.Reset()
	})
}

// vsockSocketPair returns the two ends of a connected Unix socket pair.
func vsockSocketPair(t *testing.T) (*net.UnixConn, *net.UnixConn) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	var conns [2]*net.UnixConn
	for i, fd := range fds {
		f := os.NewFile(uintptr(fd), "socketpair")
		nc, err := net.FileConn(f)
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = nc.(*net.UnixConn)
	}
	return conns[0], conns[1]
}
