package virtio

import (
	"bytes"
	"encoding/binary"
	"errors"
	"log/slog"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kilnvm/kiln/memory"
)

// netTestTap is an in-memory tap: frames put on rx come out of Read, and
// what the device writes goes to tx.
type netTestTap struct {
	rx       chan []byte
	tx       chan []byte
	closed   chan struct{}
	once     sync.Once
	writeErr error
}

func newNetTestTap() *netTestTap {
	return &netTestTap{rx: make(chan []byte), tx: make(chan []byte, 64), closed: make(chan struct{})}
}

func (p *netTestTap) Read(b []byte) (int, error) {
	select {
	case f := <-p.rx:
		return copy(b, f), nil
	case <-p.closed:
		return 0, os.ErrClosed
	}
}

func (p *netTestTap) Write(b []byte) (int, error) {
	if p.writeErr != nil {
		return 0, p.writeErr
	}
	p.tx <- append([]byte(nil), b...)
	return len(b), nil
}

func (p *netTestTap) Close() error {
	p.once.Do(func() { close(p.closed) })
	return nil
}

// send hands the device a frame from the host, failing after a while if the
// device does not read it.
func (p *netTestTap) send(t *testing.T, f []byte) {
	t.Helper()
	select {
	case p.rx <- f:
	case <-time.After(10 * time.Second):
		t.Fatal("the device did not read the tap")
	}
}

// netTestLogger sends a device's logs, debug included, to the test log.
func netTestLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(netTestLogWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type netTestLogWriter struct{ t *testing.T }

func (w netTestLogWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// netTestRing plays the driver of one split virtqueue in guest memory.
type netTestRing struct {
	t                  *testing.T
	mem                *memory.Memory
	q                  *Queue
	size               uint16
	desc, avail, used  uint64
	nextDesc, availIdx uint16
	usedSeen           uint16
	bufNext            uint64
	interrupts         atomic.Int32
	errs               chan error
}

// netTestBuf is one descriptor: data the device reads, or (when writable is
// non-zero) that many bytes the device writes.
type netTestBuf struct {
	data     []byte
	writable int
}

type netTestUsed struct {
	head uint16
	len  uint32
}

func newNetTestRing(t *testing.T, mem *memory.Memory, base uint64, bufBase uint64) *netTestRing {
	t.Helper()
	r := &netTestRing{
		t: t, mem: mem, size: 16,
		desc: base, avail: base + 0x1000, used: base + 0x2000,
		bufNext: bufBase,
		errs:    make(chan error, 8),
	}
	r.q = &Queue{Size: r.size, Ready: true, DescAddr: r.desc, DriverAddr: r.avail, DeviceAddr: r.used}
	err := r.q.activate(mem, FeatureVersion1, func() { r.interrupts.Add(1) }, func(err error) { r.errs <- err })
	if err != nil {
		t.Fatalf("activating the queue: %v", err)
	}
	return r
}

func (r *netTestRing) put16(addr uint64, v uint16) {
	var b [2]byte
	binary.LittleEndian.PutUint16(b[:], v)
	if err := r.mem.WriteAt(b[:], addr); err != nil {
		r.t.Fatal(err)
	}
}

// add makes a chain of bufs available and returns its head and the guest
// addresses of its buffers.
func (r *netTestRing) add(bufs ...netTestBuf) (uint16, []uint64) {
	r.t.Helper()
	head := r.nextDesc % r.size
	var addrs []uint64
	for i, b := range bufs {
		d := r.nextDesc % r.size
		r.nextDesc++
		n := uint64(len(b.data))
		var flags uint16
		if b.writable > 0 {
			n = uint64(b.writable)
			flags |= descFWrite
		}
		addr := r.bufNext
		r.bufNext += (n + 15) &^ 15
		if b.data != nil {
			if err := r.mem.WriteAt(b.data, addr); err != nil {
				r.t.Fatal(err)
			}
		}
		if i < len(bufs)-1 {
			flags |= descFNext
		}
		var e [descSize]byte
		binary.LittleEndian.PutUint64(e[0:], addr)
		binary.LittleEndian.PutUint32(e[8:], uint32(n))
		binary.LittleEndian.PutUint16(e[12:], flags)
		binary.LittleEndian.PutUint16(e[14:], r.nextDesc%r.size)
		if err := r.mem.WriteAt(e[:], r.desc+descSize*uint64(d)); err != nil {
			r.t.Fatal(err)
		}
		addrs = append(addrs, addr)
	}
	r.put16(r.avail+4+2*uint64(r.availIdx%r.size), head)
	r.availIdx++
	r.put16(r.avail+2, r.availIdx)
	return head, addrs
}

// waitUsed waits for n more used entries and returns them.
func (r *netTestRing) waitUsed(n int) []netTestUsed {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	var b [2]byte
	for {
		if err := r.mem.ReadAt(b[:], r.used+2); err != nil {
			r.t.Fatal(err)
		}
		if int(binary.LittleEndian.Uint16(b[:])-r.usedSeen) >= n {
			break
		}
		if time.Now().After(deadline) {
			r.t.Fatalf("waited 10s for %d used entries", n)
		}
		time.Sleep(time.Millisecond)
	}
	var out []netTestUsed
	for range n {
		var e [8]byte
		if err := r.mem.ReadAt(e[:], r.used+4+8*uint64(r.usedSeen%r.size)); err != nil {
			r.t.Fatal(err)
		}
		out = append(out, netTestUsed{uint16(binary.LittleEndian.Uint32(e[:])), binary.LittleEndian.Uint32(e[4:])})
		r.usedSeen++
	}
	return out
}

func (r *netTestRing) read(addr uint64, n int) []byte {
	r.t.Helper()
	b := make([]byte, n)
	if err := r.mem.ReadAt(b, addr); err != nil {
		r.t.Fatal(err)
	}
	return b
}

// netTestSetup builds a device over a fake tap with its two queues active.
func netTestSetup(t *testing.T) (*Net, *netTestTap, *netTestRing, *netTestRing) {
	t.Helper()
	tap := newNetTestTap()
	mac := net.HardwareAddr{0x52, 0x54, 0, 0x12, 0x34, 0x56}
	n := newNet(tap, "fake0", mac, netTestLogger(t))
	t.Cleanup(func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
	})
	rx, tx := netTestActivate(t, n)
	return n, tap, rx, tx
}

// netTestActivate activates n on two fresh queues in fresh memory.
func netTestActivate(t *testing.T, n *Net) (*netTestRing, *netTestRing) {
	t.Helper()
	mem, err := memory.NewAnonymous(memory.Layout{{GuestAddr: 0, Size: 4 << 20}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mem.Close() })
	rx := newNetTestRing(t, mem, 0x10000, 0x100000)
	tx := newNetTestRing(t, mem, 0x20000, 0x200000)
	if err := n.Activate(mem, FeatureVersion1, []*Queue{rx.q, tx.q}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Reset)
	return rx, tx
}

// netTestFrame is an Ethernet frame of size bytes with a recognizable body.
func netTestFrame(size int) []byte {
	f := make([]byte, size)
	for i := range f {
		f[i] = byte(i*7 + 3)
	}
	return f
}

func netTestHdr(flags, gsoType byte) []byte {
	h := make([]byte, netHdrLen)
	h[0], h[1] = flags, gsoType
	binary.LittleEndian.PutUint16(h[netHdrNumBuffers:], 7)
	return h
}

func TestNetDeviceInfo(t *testing.T) {
	mac := net.HardwareAddr{0x52, 0x54, 0, 0xaa, 0xbb, 0xcc}
	n := newNet(newNetTestTap(), "fake0", mac, nil)
	defer n.Close()
	if n.ID() != IDNet {
		t.Errorf("ID %d, want %d", n.ID(), IDNet)
	}
	if f := n.Features(); f != NetFeatureMAC|NetFeatureStatus {
		t.Errorf("features %#x, want MAC|STATUS", f)
	}
	if q := n.QueueSizes(); len(q) != 2 || q[0] != 256 || q[1] != 256 {
		t.Errorf("queue sizes %v, want [256 256]", q)
	}
	tests := []struct {
		offset uint64
		n      int
		want   []byte
	}{
		{0, 6, mac},
		{6, 2, []byte{NetStatusLinkUp, 0}},
		{0, 8, append(append([]byte(nil), mac...), NetStatusLinkUp, 0)},
		{4, 4, []byte{0xbb, 0xcc, NetStatusLinkUp, 0}},
		{6, 4, []byte{NetStatusLinkUp, 0, 0, 0}},
		{8, 2, []byte{0, 0}},
		{1 << 40, 4, []byte{0, 0, 0, 0}},
	}
	for _, tt := range tests {
		got := bytes.Repeat([]byte{0xff}, tt.n)
		n.ReadConfig(tt.offset, got)
		if !bytes.Equal(got, tt.want) {
			t.Errorf("ReadConfig(%d, %d bytes) = %x, want %x", tt.offset, tt.n, got, tt.want)
		}
	}
	n.WriteConfig(0, []byte{1, 2, 3, 4, 5, 6})
	got := make([]byte, 6)
	if n.ReadConfig(0, got); !bytes.Equal(got, mac) {
		t.Errorf("config MAC %x after a driver write, want %x unchanged", got, mac)
	}
	if n.TapName() != "fake0" || n.MAC().String() != mac.String() {
		t.Errorf("TapName %q MAC %v, want fake0 %v", n.TapName(), n.MAC(), mac)
	}
}

func TestNetMAC(t *testing.T) {
	tests := []struct {
		name    string
		mac     net.HardwareAddr
		wantErr bool
	}{
		{"random", nil, false},
		{"given", net.HardwareAddr{2, 0, 0, 0, 0, 1}, false},
		{"short", net.HardwareAddr{2, 0, 0, 0, 1}, true},
		{"EUI-64", net.HardwareAddr{2, 0, 0, 0, 0, 0, 0, 1}, true},
		{"multicast", net.HardwareAddr{1, 0, 0x5e, 0, 0, 1}, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := netMAC(tt.mac)
			if tt.wantErr {
				if err == nil {
					t.Fatalf("netMAC(%v) = %v, want an error", tt.mac, got)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != 6 || got[0]&1 != 0 {
				t.Fatalf("netMAC(%v) = %v, want a 6-byte unicast address", tt.mac, got)
			}
			if tt.mac == nil && got[0]&2 == 0 {
				t.Errorf("random MAC %v is not locally administered", got)
			}
			if tt.mac != nil && !bytes.Equal(got, tt.mac) {
				t.Errorf("netMAC(%v) = %v", tt.mac, got)
			}
		})
	}
	a, _ := netMAC(nil)
	b, _ := netMAC(nil)
	if bytes.Equal(a, b) {
		t.Errorf("two random MACs are both %v", a)
	}
}

func TestNetTx(t *testing.T) {
	frame := netTestFrame(1514)
	big := netTestFrame(NetMaxFrame)
	tests := []struct {
		name string
		bufs []netTestBuf
		want []byte // what reaches the tap after the zeroed header; nil: dropped
	}{
		{"one buffer", []netTestBuf{{data: append(netTestHdr(0, 0), frame...)}}, frame},
		{"header apart", []netTestBuf{{data: netTestHdr(0, 0)}, {data: frame}}, frame},
		{"split everywhere", []netTestBuf{{data: netTestHdr(0, 0)[:5]}, {data: append(netTestHdr(0, 0)[5:], frame[:1]...)}, {data: frame[1:100]}, {data: frame[100:]}}, frame},
		{"offload header cleared", []netTestBuf{{data: netTestHdr(1, 1)}, {data: frame}}, frame},
		{"largest frame", []netTestBuf{{data: netTestHdr(0, 0)}, {data: big}}, big},
		{"smallest frame", []netTestBuf{{data: netTestHdr(0, 0)}, {data: frame[:ethHdrLen]}}, frame[:ethHdrLen]},
		{"trailing writable buffer ignored", []netTestBuf{{data: netTestHdr(0, 0)}, {data: frame}, {writable: 64}}, frame},
		{"too big", []netTestBuf{{data: netTestHdr(0, 0)}, {data: big}, {data: []byte{1}}}, nil},
		{"short header", []netTestBuf{{data: netTestHdr(0, 0)[:11]}}, nil},
		{"header only", []netTestBuf{{data: netTestHdr(0, 0)}}, nil},
		{"runt frame", []netTestBuf{{data: netTestHdr(0, 0)}, {data: frame[:ethHdrLen-1]}}, nil},
		{"writable only", []netTestBuf{{writable: 1600}}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n, tap, _, tx := netTestSetup(t)
			head, _ := tx.add(tt.bufs...)
			n.QueueNotify(netTxQueue)
			used := tx.waitUsed(1)
			if used[0] != (netTestUsed{head, 0}) {
				t.Errorf("used entry %+v, want {head:%d len:0}", used[0], head)
			}
			st := n.Stats()
			if tt.want == nil {
				if st.TxDropped != 1 || st.TxPackets != 0 {
					t.Errorf("stats %+v, want one dropped frame", st)
				}
				select {
				case f := <-tap.tx:
					t.Errorf("dropped frame reached the tap: %d bytes", len(f))
				default:
				}
				return
			}
			select {
			case f := <-tap.tx:
				if !bytes.Equal(f[:netHdrLen], make([]byte, netHdrLen)) {
					t.Errorf("header to the tap %x, want zeros", f[:netHdrLen])
				}
				if !bytes.Equal(f[netHdrLen:], tt.want) {
					t.Errorf("tap got a %d-byte frame, want the guest's %d bytes", len(f)-netHdrLen, len(tt.want))
				}
			case <-time.After(10 * time.Second):
				t.Fatal("no frame reached the tap")
			}
			if st.TxPackets != 1 || st.TxBytes != uint64(len(tt.want)) || st.TxDropped != 0 {
				t.Errorf("stats %+v, want 1 packet of %d bytes", st, len(tt.want))
			}
			if tx.interrupts.Load() == 0 {
				t.Error("no interrupt after transmitting")
			}
		})
	}
}

func TestNetTxBatchAndTapError(t *testing.T) {
	n, tap, _, tx := netTestSetup(t)
	frame := netTestFrame(60)
	for range 10 {
		tx.add(netTestBuf{data: append(netTestHdr(0, 0), frame...)})
	}
	n.QueueNotify(netTxQueue)
	tx.waitUsed(10)
	for i := range 10 {
		if f := <-tap.tx; !bytes.Equal(f[netHdrLen:], frame) {
			t.Errorf("frame %d differs", i)
		}
	}
	tap.writeErr = errors.New("tap is down")
	tx.add(netTestBuf{data: append(netTestHdr(0, 0), frame...)})
	n.QueueNotify(netTxQueue)
	tx.waitUsed(1)
	if st := n.Stats(); st.TxPackets != 10 || st.TxDropped != 1 {
		t.Errorf("stats %+v, want 10 sent and 1 dropped", st)
	}
}

func TestNetRx(t *testing.T) {
	n, tap, rx, _ := netTestSetup(t)
	frame := netTestFrame(1514)

	// A frame with no buffer waits for one, without dropping it.
	tap.send(t, append(netTestHdr(1<<1, 0), frame...)) // DATA_VALID, not negotiated
	time.Sleep(20 * time.Millisecond)
	if st := n.Stats(); st.RxPackets != 0 || st.RxDropped != 0 {
		t.Fatalf("stats %+v before any receive buffer", st)
	}
	head, addrs := rx.add(netTestBuf{writable: netHdrLen + 1518})
	n.QueueNotify(netRxQueue)
	used := rx.waitUsed(1)
	if used[0] != (netTestUsed{head, uint32(netHdrLen + len(frame))}) {
		t.Fatalf("used entry %+v, want {head:%d len:%d}", used[0], head, netHdrLen+len(frame))
	}
	got := rx.read(addrs[0], netHdrLen+len(frame))
	wantHdr := make([]byte, netHdrLen)
	wantHdr[netHdrNumBuffers] = 1
	if !bytes.Equal(got[:netHdrLen], wantHdr) {
		t.Errorf("header %x, want %x", got[:netHdrLen], wantHdr)
	}
	if !bytes.Equal(got[netHdrLen:], frame) {
		t.Error("received frame differs from the tap's")
	}
	if rx.interrupts.Load() == 0 {
		t.Error("no interrupt after receiving")
	}

	// A frame spread over a chain of small buffers.
	_, addrs = rx.add(netTestBuf{writable: 10}, netTestBuf{writable: 100}, netTestBuf{writable: 2000})
	tap.send(t, append(netTestHdr(0, 0), frame...))
	used = rx.waitUsed(1)
	if used[0].len != uint32(netHdrLen+len(frame)) {
		t.Errorf("used length %d, want %d", used[0].len, netHdrLen+len(frame))
	}
	got = append(append(rx.read(addrs[0], 10), rx.read(addrs[1], 100)...), rx.read(addrs[2], netHdrLen+len(frame)-110)...)
	if !bytes.Equal(got[netHdrLen:], frame) {
		t.Error("frame received over three buffers differs")
	}

	// Too big for the chain: the chain comes back empty, the frame is
	// dropped, and the next frame still gets through.
	head, _ = rx.add(netTestBuf{writable: 100})
	tap.send(t, append(netTestHdr(0, 0), frame...))
	if used = rx.waitUsed(1); used[0] != (netTestUsed{head, 0}) {
		t.Errorf("used entry %+v for a frame too big, want {head:%d len:0}", used[0], head)
	}
	// A GSO frame and a runt are dropped without taking a buffer.
	tap.send(t, append(netTestHdr(0, 1), frame...))
	tap.send(t, netTestHdr(0, 0))
	tap.send(t, append(netTestHdr(0, 0), frame[:ethHdrLen-1]...))
	rx.add(netTestBuf{writable: 2000})
	tap.send(t, append(netTestHdr(0, 0), frame[:60]...))
	if used = rx.waitUsed(1); used[0].len != netHdrLen+60 {
		t.Errorf("used length %d after drops, want %d", used[0].len, netHdrLen+60)
	}
	if st := n.Stats(); st.RxPackets != 3 || st.RxDropped != 4 || st.RxBytes != uint64(2*len(frame)+60) {
		t.Errorf("stats %+v, want 3 received and 4 dropped", st)
	}
}

func TestNetRxOversizedRead(t *testing.T) {
	n := newNet(newNetTestTap(), "fake0", net.HardwareAddr{2, 0, 0, 0, 0, 1}, nil)
	defer n.Close()
	buf := make([]byte, netHdrLen+NetMaxFrame)
	if err := n.receive(buf, len(buf)+100); err == nil {
		t.Error("a read the tap truncated was delivered")
	}
}

func TestNetResetAndClose(t *testing.T) {
	n, tap, rx, tx := netTestSetup(t)
	// The reader waits for a receive buffer; Reset must stop the wait.
	tap.send(t, append(netTestHdr(0, 0), netTestFrame(60)...))
	time.Sleep(20 * time.Millisecond)
	done := make(chan struct{})
	go func() { n.Reset(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Reset hung while the reader waited for a buffer")
	}
	// The reader counts the drop after Reset has let it go.
	waitDropped := func(want uint64) {
		t.Helper()
		deadline := time.Now().Add(10 * time.Second)
		for n.Stats().RxDropped != want {
			if time.Now().After(deadline) {
				t.Fatalf("stats %+v, want %d frames dropped", n.Stats(), want)
			}
			time.Sleep(time.Millisecond)
		}
	}
	waitDropped(1)
	// Not active: frames are dropped, notifications ignored. The drop is
	// awaited, or the reader could take the frame after the Activate below
	// and wait for a buffer that rx2.add does not notify.
	tap.send(t, append(netTestHdr(0, 0), netTestFrame(60)...))
	n.QueueNotify(netRxQueue)
	n.QueueNotify(netTxQueue)
	n.QueueNotify(7)
	waitDropped(2)
	n.Reset()
	// Activate again on fresh queues and move a frame each way.
	mem := rx.mem
	rx2 := newNetTestRing(t, mem, 0x30000, 0x300000)
	tx2 := newNetTestRing(t, mem, 0x40000, 0x380000)
	if err := n.Activate(mem, FeatureVersion1, []*Queue{rx2.q, tx2.q}); err != nil {
		t.Fatal(err)
	}
	if err := n.Activate(mem, FeatureVersion1, []*Queue{rx2.q, tx2.q}); err == nil {
		t.Error("second Activate without Reset succeeded")
	}
	rx2.add(netTestBuf{writable: 2000})
	tap.send(t, append(netTestHdr(0, 0), netTestFrame(60)...))
	rx2.waitUsed(1)
	tx2.add(netTestBuf{data: append(netTestHdr(0, 0), netTestFrame(60)...)})
	n.QueueNotify(netTxQueue)
	tx2.waitUsed(1)
	<-tap.tx
	_ = tx
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := n.Activate(mem, FeatureVersion1, []*Queue{rx2.q, tx2.q}); err == nil {
		t.Error("Activate after Close succeeded")
	}
	if err := n.Activate(mem, FeatureVersion1, []*Queue{rx2.q}); err == nil {
		t.Error("Activate with one queue succeeded")
	}
}

func TestNetMalformedQueue(t *testing.T) {
	n, tap, rx, tx := netTestSetup(t)
	// The driver claims 100 chains in a 16-entry queue.
	tx.put16(tx.avail+2, 100)
	n.QueueNotify(netTxQueue)
	select {
	case err := <-tx.errs:
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("queue error %v, want ErrMalformed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a broken tx queue was not reported")
	}
	// A chain whose buffer lies outside guest memory breaks rx.
	var e [descSize]byte
	binary.LittleEndian.PutUint64(e[0:], 1<<40)
	binary.LittleEndian.PutUint32(e[8:], 2000)
	binary.LittleEndian.PutUint16(e[12:], descFWrite)
	if err := rx.mem.WriteAt(e[:], rx.desc); err != nil {
		t.Fatal(err)
	}
	rx.put16(rx.avail+4, 0)
	rx.put16(rx.avail+2, 1)
	tap.send(t, append(netTestHdr(0, 0), netTestFrame(60)...))
	select {
	case err := <-rx.errs:
		if !errors.Is(err, ErrMalformed) {
			t.Errorf("queue error %v, want ErrMalformed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a broken rx queue was not reported")
	}
	// The device keeps reading the tap (dropping) and resets cleanly.
	tap.send(t, append(netTestHdr(0, 0), netTestFrame(60)...))
	n.Reset()
}

func TestTapName(t *testing.T) {
	tests := []struct{ tap, netns string }{
		{"sixteen-chars-xx", ""},
		{"a/b", ""},
		{"a b", ""},
		{"nul\x00", ""},
		{"ok", ".."},
		{"ok", "."},
		{"ok", "/nonexistent/netns"},
	}
	for _, tt := range tests {
		if f, _, err := openTap(tt.tap, tt.netns); err == nil {
			f.Close()
			t.Errorf("openTap(%q, %q) succeeded", tt.tap, tt.netns)
		}
	}
}

func FuzzNetTx(f *testing.F) {
	f.Add([]byte{12, 60}, append(netTestHdr(0, 0), netTestFrame(60)...))
	f.Add([]byte{5, 0, 200}, netTestFrame(300))
	f.Add([]byte{11}, netTestFrame(11))
	f.Add([]byte{}, []byte{})
	f.Fuzz(func(t *testing.T, cuts []byte, data []byte) {
		// cuts splits data into readable buffers; what is left over
		// becomes a writable buffer, which transmit ignores.
		c := &Chain{}
		rest := data
		for _, k := range cuts {
			k := min(int(k), len(rest))
			c.Readable = append(c.Readable, rest[:k])
			rest = rest[k:]
		}
		if len(cuts) == 0 {
			c.Readable = append(c.Readable, rest)
			rest = nil
		}
		if len(rest) > 0 {
			c.Writable = append(c.Writable, rest)
		}
		readable := data[:len(data)-len(rest)]
		buf := make([]byte, netHdrLen+NetMaxFrame)
		out, err := netTxFrame(c, buf)
		ok := len(readable) >= netHdrLen+ethHdrLen && len(readable) <= netHdrLen+NetMaxFrame
		if ok != (err == nil) {
			t.Fatalf("%d readable bytes: err %v", len(readable), err)
		}
		if err != nil {
			return
		}
		if !bytes.Equal(out[:netHdrLen], make([]byte, netHdrLen)) || !bytes.Equal(out[netHdrLen:], readable[netHdrLen:]) {
			t.Fatalf("tap frame %x, want a zero header and %x", out, readable[netHdrLen:])
		}
	})
}
