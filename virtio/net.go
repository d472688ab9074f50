package virtio

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
)

// Net feature bits (virtio 1.x, section 5.1.3).
const (
	NetFeatureMAC    = 1 << 5  // mac in the config space is valid
	NetFeatureStatus = 1 << 16 // status in the config space is valid
)

// NetStatusLinkUp is VIRTIO_NET_S_LINK_UP in the config space's status.
const NetStatusLinkUp = 1

const (
	// NetQueueSize is the size of each of the receive and transmit queues.
	NetQueueSize = 256
	// NetMaxFrame is the largest Ethernet frame (without the virtio-net
	// header) the device sends or receives: a 64 KiB IP packet with an
	// Ethernet header and a VLAN tag, the limit other VMMs use too.
	NetMaxFrame = 65550

	netRxQueue = 0
	netTxQueue = 1

	// netHdrLen is sizeof(struct virtio_net_hdr_v1): flags, gso_type,
	// hdr_len, gso_size, csum_start, csum_offset, num_buffers. With
	// VIRTIO_F_VERSION_1 it prefixes every frame, in both directions; the
	// tap is told to use the same header (TUNSETVNETHDRSZ).
	netHdrLen = 12
	// netHdrNumBuffers is the offset of num_buffers in the header.
	netHdrNumBuffers = 10
	// netHdrGSOType is the offset of gso_type in the header.
	netHdrGSOType = 1
	// ethHdrLen is the smallest frame: destination, source, EtherType.
	ethHdrLen = 14
	// netCfgSize is the config space the device has: mac[6], status le16.
	netCfgSize = 8
	// netNotifyBatch bounds how many transmitted chains complete before
	// the driver is interrupted during a long drain of the tx queue.
	netNotifyBatch = 64
)

// NetConfig describes the host side of a virtio-net device.
type NetConfig struct {
	// Tap is the tap interface to attach to; it is created when it does
	// not exist. Empty lets the kernel pick a name (see Net.TapName).
	Tap string
	// MAC is the guest's address; a random locally administered unicast
	// address when nil.
	MAC net.HardwareAddr
	// Netns, when set, opens the tap inside that network namespace: a name
	// under /var/run/netns (as `ip netns add` makes) or a path such as
	// /proc/PID/ns/net. The tap stays in that namespace.
	Netns string
	// Logger receives the device's logs; slog.Default() when nil.
	Logger *slog.Logger
}

// NetStats counts what a Net device moved and dropped.
type NetStats struct {
	TxPackets, TxBytes uint64 // frames the guest sent that reached the tap
	TxDropped          uint64 // guest frames dropped: malformed, or the tap failed
	RxPackets, RxBytes uint64 // frames from the tap delivered to the guest
	RxDropped          uint64 // tap frames dropped: malformed, too big, or the device was stopped
}

// Net is a virtio-net device (virtio 1.x, section 5.1) backed by a tap
// interface. It offers no offloads: every frame crosses whole and
// checksummed, in buffers of the driver's choosing (Linux gives 1.5 KiB
// receive buffers without offloads and mergeable buffers). A goroutine reads
// the tap for the life of the device and delivers each frame into the next
// receive chain, waiting for the driver to add one when the queue is empty;
// another goroutine, while the device is active, writes each transmitted
// frame to the tap.
type Net struct {
	tap     tapDevice
	tapName string
	mac     net.HardwareAddr
	config  [netCfgSize]byte
	log     *slog.Logger

	mu     sync.Mutex
	closed bool
	act    *netActivation // nil when not active

	closeOnce  sync.Once
	readerDone chan struct{} // closed when the tap reader exits

	txPackets, txBytes, txDropped atomic.Uint64
	rxPackets, rxBytes, rxDropped atomic.Uint64
}

// netActivation is the state of one Activate..Reset period.
type netActivation struct {
	rx, tx *Queue
	rxKick chan struct{} // buffered(1): a pending QueueNotify of rx
	txKick chan struct{} // buffered(1): a pending QueueNotify of tx
	done   chan struct{} // closed by Reset
	wg     sync.WaitGroup
}

var _ Device = (*Net)(nil)

// NewNet opens the tap cfg names and returns a device for it. Close closes
// the tap (a persistent tap interface stays; one this call created goes
// away).
func NewNet(cfg NetConfig) (*Net, error) {
	mac, err := netMAC(cfg.MAC)
	if err != nil {
		return nil, err
	}
	f, name, err := openTap(cfg.Tap, cfg.Netns)
	if err != nil {
		return nil, fmt.Errorf("virtio-net: %w", err)
	}
	return newNet(f, name, mac, cfg.Logger), nil
}

// NewNetFromTap makes a card over a tap already open (a jailer opened it
// in the sandbox's network namespace, say) with IFF_TAP, IFF_NO_PI and
// IFF_VNET_HDR; name is the tap's name, for logs. The device owns tap from
// the call on. cfg.Tap and cfg.Netns are not used.
func NewNetFromTap(tap *os.File, name string, cfg NetConfig) (*Net, error) {
	if tap == nil {
		return nil, errors.New("virtio-net: no tap given")
	}
	mac, err := netMAC(cfg.MAC)
	if err != nil {
		tap.Close()
		return nil, err
	}
	if err := unix.IoctlSetPointerInt(int(tap.Fd()), unix.TUNSETVNETHDRSZ, netHdrLen); err != nil {
		tap.Close()
		return nil, fmt.Errorf("virtio-net: tap %s: setting the vnet header size (is it a tap with IFF_VNET_HDR?): %w", name, err)
	}
	return newNet(tap, name, mac, cfg.Logger), nil
}

// RandomMAC returns a random locally administered unicast MAC address.
func RandomMAC() (net.HardwareAddr, error) {
	m := make(net.HardwareAddr, 6)
	if _, err := rand.Read(m); err != nil {
		return nil, fmt.Errorf("virtio-net: random MAC address: %w", err)
	}
	m[0] = m[0]&^1 | 2 // unicast, locally administered
	return m, nil
}

// netMAC checks a configured MAC address, or makes a random one.
func netMAC(mac net.HardwareAddr) (net.HardwareAddr, error) {
	if mac == nil {
		return RandomMAC()
	}
	if len(mac) != 6 {
		return nil, fmt.Errorf("virtio-net: MAC address %v is %d bytes, want 6", mac, len(mac))
	}
	if mac[0]&1 != 0 {
		return nil, fmt.Errorf("virtio-net: MAC address %v is a multicast address", mac)
	}
	return append(net.HardwareAddr(nil), mac...), nil
}

// newNet makes a device over an open tap and starts its reader.
func newNet(tap tapDevice, name string, mac net.HardwareAddr, log *slog.Logger) *Net {
	if log == nil {
		log = slog.Default()
	}
	n := &Net{
		tap:        tap,
		tapName:    name,
		mac:        mac,
		log:        log.With("device", "virtio-net", "tap", name),
		readerDone: make(chan struct{}),
	}
	copy(n.config[0:6], mac)
	binary.LittleEndian.PutUint16(n.config[6:], NetStatusLinkUp)
	go n.readLoop()
	return n
}

// TapName returns the name of the tap interface.
func (n *Net) TapName() string { return n.tapName }

// MAC returns the guest's MAC address.
func (n *Net) MAC() net.HardwareAddr { return append(net.HardwareAddr(nil), n.mac...) }

// Stats returns the device's counters.
func (n *Net) Stats() NetStats {
	return NetStats{
		TxPackets: n.txPackets.Load(), TxBytes: n.txBytes.Load(), TxDropped: n.txDropped.Load(),
		RxPackets: n.rxPackets.Load(), RxBytes: n.rxBytes.Load(), RxDropped: n.rxDropped.Load(),
	}
}

// Close stops the device and closes the tap.
func (n *Net) Close() error {
	n.Reset()
	var err error
	n.closeOnce.Do(func() {
		n.mu.Lock()
		n.closed = true
		n.mu.Unlock()
		if cerr := n.tap.Close(); cerr != nil {
			err = fmt.Errorf("virtio-net: closing tap %s: %w", n.tapName, cerr)
		}
		<-n.readerDone
	})
	return err
}

// ID returns IDNet.
func (n *Net) ID() uint32 { return IDNet }

// Features returns MAC and STATUS.
func (n *Net) Features() uint64 { return NetFeatureMAC | NetFeatureStatus }

// QueueSizes returns the receive queue (0) and the transmit queue (1).
func (n *Net) QueueSizes() []uint16 { return []uint16{NetQueueSize, NetQueueSize} }

// ReadConfig reads struct virtio_net_config: mac, then status (link up).
func (n *Net) ReadConfig(offset uint64, data []byte) {
	clear(data)
	if offset < netCfgSize {
		copy(data, n.config[offset:])
	}
}

// WriteConfig ignores the write: the config space is read-only in virtio
// 1.x.
func (n *Net) WriteConfig(offset uint64, data []byte) {}

// Activate starts serving the queues.
func (n *Net) Activate(mem *memory.Memory, features uint64, queues []*Queue) error {
	if len(queues) != 2 || queues[netRxQueue] == nil || queues[netTxQueue] == nil {
		return fmt.Errorf("virtio-net: activated with %d queues, want rx and tx", len(queues))
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return errors.New("virtio-net: activated after Close")
	}
	if n.act != nil {
		return errors.New("virtio-net: activated twice without a reset")
	}
	a := &netActivation{
		rx:     queues[netRxQueue],
		tx:     queues[netTxQueue],
		rxKick: make(chan struct{}, 1),
		txKick: make(chan struct{}, 1),
		done:   make(chan struct{}),
	}
	a.txKick <- struct{}{} // serve what the driver queued before DRIVER_OK
	a.wg.Add(1)
	go n.txLoop(a)
	n.act = a
	return nil
}

// QueueNotify wakes the goroutine serving queue index.
func (n *Net) QueueNotify(index int) {
	n.mu.Lock()
	a := n.act
	n.mu.Unlock()
	if a == nil {
		return
	}
	var kick chan struct{}
	switch index {
	case netRxQueue:
		kick = a.rxKick
	case netTxQueue:
		kick = a.txKick
	default:
		return
	}
	select {
	case kick <- struct{}{}:
	default: // one is already pending
	}
}

// Reset stops serving the queues and waits until neither goroutine touches
// them. Frames the tap delivers while the device is not active are dropped.
func (n *Net) Reset() {
	n.mu.Lock()
	a := n.act
	n.act = nil
	n.mu.Unlock()
	if a == nil {
		return
	}
	close(a.done)
	a.wg.Wait()
}

// acquire returns the current activation, held (Done its wg when finished
// with its queues), or nil when the device is not active.
func (n *Net) acquire() *netActivation {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.act != nil {
		n.act.wg.Add(1) // under mu: Reset cannot be waiting yet
	}
	return n.act
}

// readLoop reads frames from the tap until it is closed, delivering each to
// the guest.
func (n *Net) readLoop() {
	defer close(n.readerDone)
	buf := make([]byte, netHdrLen+NetMaxFrame)
	for {
		m, err := n.tap.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) && !errors.Is(err, io.EOF) {
				n.log.Error("reading the tap failed; no more frames reach the guest", "err", err)
			}
			return
		}
		if err := n.receive(buf[:min(m, len(buf))], m); err != nil {
			n.rxDropped.Add(1)
			level := slog.LevelDebug
			if errors.Is(err, ErrMalformed) {
				level = slog.LevelWarn // the driver broke the queue
			}
			n.log.Log(context.Background(), level, "dropped a frame for the guest", "err", err)
		}
	}
}

// receive delivers one frame read from the tap (virtio-net header first),
// of which the tap reported size bytes, into the next receive chain.
func (n *Net) receive(frame []byte, size int) error {
	if size > len(frame) {
		return fmt.Errorf("%d-byte frame is over the %d-byte limit", size-netHdrLen, NetMaxFrame)
	}
	if len(frame) < netHdrLen+ethHdrLen {
		return fmt.Errorf("%d-byte read from the tap is shorter than a header and an Ethernet header", len(frame))
	}
	if gso := frame[netHdrGSOType]; gso != 0 {
		return fmt.Errorf("tap gave a GSO frame (gso_type %d) the driver did not negotiate", gso)
	}
	// Without negotiated offloads the header is all zeros but for
	// num_buffers, which is 1 without VIRTIO_NET_F_MRG_RXBUF (5.1.6.4).
	clear(frame[:netHdrLen])
	binary.LittleEndian.PutUint16(frame[netHdrNumBuffers:], 1)

	a := n.acquire()
	if a == nil {
		return errors.New("device not active")
	}
	defer a.wg.Done()
	var c *Chain
	for {
		var ok bool
		var err error
		c, ok, err = a.rx.Pop()
		if err != nil {
			return fmt.Errorf("receive queue: %w", err)
		}
		if ok {
			break
		}
		select {
		case <-a.rxKick: // the driver added buffers: look again
		case <-a.done:
			return errors.New("device reset while waiting for a receive buffer")
		}
	}
	written, err := c.Writer().Write(frame)
	if err != nil {
		// Give the buffer back empty: Linux counts a too-short length as
		// a length error and reuses the buffer.
		written = 0
		err = fmt.Errorf("%d-byte frame does not fit the driver's %d-byte receive chain", len(frame)-netHdrLen, c.WritableLen())
	}
	if err == nil {
		// Counted before the guest can see the frame, so the stats
		// never lag what the used ring shows.
		n.rxPackets.Add(1)
		n.rxBytes.Add(uint64(len(frame) - netHdrLen))
	}
	if perr := a.rx.Push(c, uint32(written)); perr != nil && !errors.Is(perr, ErrStale) {
		return fmt.Errorf("receive queue: %w", perr)
	}
	a.rx.Notify()
	return err
}

// txLoop serves the transmit queue of activation a until Reset.
func (n *Net) txLoop(a *netActivation) {
	defer a.wg.Done()
	buf := make([]byte, netHdrLen+NetMaxFrame)
	for {
		select {
		case <-a.txKick:
		case <-a.done:
			return
		}
		if err := n.drainTx(a, buf); err != nil {
			n.log.Error("transmit queue stopped", "err", err)
			// The transport has marked the device NEEDS_RESET; wait
			// for the reset.
			<-a.done
			return
		}
	}
}

// drainTx sends every chain the driver made available on the tx queue.
func (n *Net) drainTx(a *netActivation, buf []byte) error {
	pushed := 0
	defer func() {
		if pushed > 0 {
			a.tx.Notify()
		}
	}()
	for {
		select {
		case <-a.done:
			return nil
		default:
		}
		c, ok, err := a.tx.Pop()
		if err != nil {
			return fmt.Errorf("transmit queue: %w", err)
		}
		if !ok {
			return nil
		}
		if frame, err := netTxFrame(c, buf); err != nil {
			n.txDropped.Add(1)
			n.log.Debug("dropped a frame from the guest", "err", err)
		} else if _, err := n.tap.Write(frame); err != nil {
			n.txDropped.Add(1)
			n.log.Debug("writing a frame to the tap failed", "err", err)
		} else {
			n.txPackets.Add(1)
			n.txBytes.Add(uint64(len(frame) - netHdrLen))
		}
		if err := a.tx.Push(c, 0); err != nil {
			if errors.Is(err, ErrStale) {
				return nil
			}
			return fmt.Errorf("transmit queue: %w", err)
		}
		if pushed++; pushed == netNotifyBatch {
			a.tx.Notify()
			pushed = 0
		}
	}
}

// netTxFrame copies a transmit chain (a virtio_net_hdr_v1, then an Ethernet
// frame, across any number of readable buffers) into buf, which holds
// netHdrLen+NetMaxFrame bytes, and returns what to write to the tap: a
// zeroed header (no offloads were negotiated, so the guest's header asks
// for nothing, and whatever else it says is not passed on) and the frame.
func netTxFrame(c *Chain, buf []byte) ([]byte, error) {
	total := c.ReadableLen()
	switch {
	case total < netHdrLen+ethHdrLen:
		return nil, fmt.Errorf("%d-byte transmit chain is shorter than a %d-byte header and an Ethernet header", total, netHdrLen)
	case total > netHdrLen+NetMaxFrame:
		return nil, fmt.Errorf("%d-byte frame is over the %d-byte limit", total-netHdrLen, NetMaxFrame)
	case len(buf) < total:
		return nil, fmt.Errorf("%d-byte transmit buffer is too small for %d bytes", len(buf), total)
	}
	if _, err := io.ReadFull(c.Reader(), buf[:total]); err != nil {
		return nil, fmt.Errorf("reading the transmit chain: %w", err)
	}
	clear(buf[:netHdrLen])
	return buf[:total], nil
}
