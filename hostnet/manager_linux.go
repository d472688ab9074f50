package hostnet

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/google/nftables"
	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Manager makes and keeps the network attachments of sandboxes on a host.
// Its methods are safe for concurrent use.
type Manager struct {
	cfg     Config
	log     *slog.Logger
	uplink  string
	refused []netip.Prefix // Config.Refused, or DefaultRefused
	hostFD  int            // the host netns
	dialFD  int            // hostFD, or -1 when the host netns is this process's
	up      *forwarder

	mu      sync.Mutex
	alloc   *allocator
	records map[string]record        // every attachment, adopted or not
	live    map[string]*attachment   // attachments with a running proxy
	busy    map[string]chan struct{} // ids in Attach, Adopt, SetPolicy or Detach; closed when done
	closed  bool
}

// attachment is an adopted attachment: its netns open, its proxy running.
type attachment struct {
	id     string
	blk    block
	nsPath string
	nsFD   int

	mu      sync.Mutex // policy, learned, nftables changes
	policy  Policy
	learned map[netip.Addr]learned

	px     *proxy
	cancel context.CancelFunc
	wg     sync.WaitGroup
	udp    net.PacketConn
	tcp    net.Listener
	// kick asks the deny-list resolver (resolveDeniedLoop) for a round
	// now; it closes the channel sent when the round is done.
	kick chan chan struct{}
}

// learned is an address the proxy resolved for name, until exp.
type learned struct {
	name string
	deny bool
	exp  time.Time
}

// New sets up the host side (IPv4 forwarding on in the host netns; kiln's
// own nftables table there, replaced atomically, so New is idempotent over
// a previous kilnd's) and reads the records of existing attachments, whose
// blocks stay taken; Adopt brings one back to life.
func New(ctx context.Context, cfg Config) (*Manager, error) {
	if err := checkPool(cfg.Pool); err != nil {
		return nil, err
	}
	cfg.Pool = cfg.Pool.Masked()
	refused := DefaultRefused
	if cfg.Refused != nil {
		refused = make([]netip.Prefix, len(cfg.Refused))
		for i, r := range cfg.Refused {
			if !r.IsValid() || !r.Addr().Is4() {
				return nil, fmt.Errorf("hostnet: refused destination %v: want an IPv4 prefix", r)
			}
			refused[i] = r.Masked()
		}
	}
	if cfg.Dir == "" {
		return nil, errors.New("hostnet: Config.Dir is empty")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "hostnet")
	for _, d := range []string{cfg.Dir, recordDir(cfg.Dir), netnsDir(cfg.Dir)} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("hostnet: state dir: %w", err)
		}
	}
	servers := cfg.DNS
	if servers == nil {
		var err error
		if servers, err = resolvConf("/etc/resolv.conf"); err != nil {
			return nil, err
		}
	}
	for _, s := range servers {
		if !s.IsValid() {
			return nil, fmt.Errorf("hostnet: upstream DNS server %v is not an address and port", s)
		}
	}
	m := &Manager{cfg: cfg, log: log, hostFD: -1, dialFD: -1, refused: refused,
		records: map[string]record{}, live: map[string]*attachment{}, busy: map[string]chan struct{}{},
		alloc: newAllocator(poolBlocks(cfg.Pool))}
	hostPath := cfg.HostNetns
	if hostPath == "" {
		hostPath = "/proc/self/ns/net"
	}
	fd, err := openNetns(hostPath)
	if err != nil {
		return nil, fmt.Errorf("hostnet: host netns: %w", err)
	}
	m.hostFD = fd
	if cfg.HostNetns != "" {
		m.dialFD = fd
	}
	m.up = &forwarder{servers: servers, dial: m.dialHost}
	if err := m.setupHost(); err != nil {
		unix.Close(fd)
		return nil, err
	}
	recs, err := readRecords(cfg.Dir, cfg.Pool)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	for _, r := range recs {
		m.records[r.ID] = r
		m.alloc.take(r.Index)
	}
	log.Info("host network ready", "pool", cfg.Pool, "uplink", m.uplink, "dns", servers, "refused", len(refused), "attachments", len(recs))
	return m, nil
}

// resolvConf reads the nameservers of a resolv.conf.
func resolvConf(path string) ([]netip.AddrPort, error) {
	cc, err := dns.ClientConfigFromFile(path)
	if err != nil {
		return nil, fmt.Errorf("hostnet: upstream DNS servers from %s: %w", path, err)
	}
	port, err := strconv.ParseUint(cc.Port, 10, 16)
	if err != nil {
		port = 53
	}
	var out []netip.AddrPort
	for _, s := range cc.Servers {
		a, err := netip.ParseAddr(s)
		if err != nil {
			continue
		}
		out = append(out, netip.AddrPortFrom(a.Unmap(), uint16(port)))
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("hostnet: %s names no nameserver; set Config.DNS", path)
	}
	return out, nil
}

// hostHandle is a netlink handle in the host netns.
func (m *Manager) hostHandle() (*netlink.Handle, error) {
	h, err := netlink.NewHandleAt(netns.NsHandle(m.hostFD), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink in the host netns: %w", err)
	}
	return h, nil
}

// setupHost turns forwarding on and installs kiln's table in the host netns.
func (m *Manager) setupHost() error {
	m.uplink = m.cfg.Uplink
	if m.uplink == "" {
		h, err := m.hostHandle()
		if err != nil {
			return fmt.Errorf("hostnet: %w", err)
		}
		defer h.Close()
		routes, err := h.RouteListFiltered(netlink.FAMILY_V4, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("hostnet: listing the host's routes: %w", err)
		}
		for _, r := range routes {
			if r.Dst == nil || r.Dst.IP.IsUnspecified() && isZeroMask(r.Dst.Mask) {
				l, err := h.LinkByIndex(r.LinkIndex)
				if err != nil {
					return fmt.Errorf("hostnet: the default route's link %d: %w", r.LinkIndex, err)
				}
				m.uplink = l.Attrs().Name
				break
			}
		}
		if m.uplink == "" {
			return errors.New("hostnet: the host netns has no IPv4 default route to NAT by; set Config.Uplink")
		}
	}
	if len(m.uplink) >= unix.IFNAMSIZ {
		return fmt.Errorf("hostnet: uplink %q: interface names are at most %d characters", m.uplink, unix.IFNAMSIZ-1)
	}
	// A named uplink must exist: NAT by an interface that is not there
	// would leave every sandbox without a way out, silently.
	h, err := m.hostHandle()
	if err != nil {
		return fmt.Errorf("hostnet: %w", err)
	}
	_, err = h.LinkByName(m.uplink)
	h.Close()
	if err != nil {
		return fmt.Errorf("hostnet: uplink %q: no such interface in the host netns: %w", m.uplink, err)
	}
	if err := writeSysctl(m.hostFD, "/proc/sys/net/ipv4/ip_forward", "1"); err != nil {
		return fmt.Errorf("hostnet: turning on IPv4 forwarding in the host netns: %w", err)
	}
	c, err := nftables.New(nftables.WithNetNSFd(m.hostFD))
	if err != nil {
		return fmt.Errorf("hostnet: nftables in the host netns: %w", err)
	}
	hostRules(c, m.cfg.Pool, m.uplink)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("hostnet: installing nftables table ip %s in the host netns: %w", tableName, err)
	}
	return nil
}

func isZeroMask(m net.IPMask) bool {
	ones, _ := m.Size()
	return ones == 0
}

// dialHost dials from the host netns.
func (m *Manager) dialHost(ctx context.Context, network, addr string) (net.Conn, error) {
	var d net.Dialer
	if m.dialFD < 0 {
		return d.DialContext(ctx, network, addr)
	}
	var c net.Conn
	err := inNetns(m.dialFD, func() error {
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// reserve waits (until ctx is done) for the other operations on id to
// end and marks id busy: operations on one sandbox run one at a time.
func (m *Manager) reserve(ctx context.Context, id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	for {
		m.mu.Lock()
		if m.closed {
			m.mu.Unlock()
			return errors.New("hostnet: manager is closed")
		}
		done, busy := m.busy[id]
		if !busy {
			m.busy[id] = make(chan struct{})
			m.mu.Unlock()
			return nil
		}
		m.mu.Unlock()
		select {
		case <-done:
		case <-ctx.Done():
			return fmt.Errorf("hostnet: sandbox %s: waiting for another network operation on it: %w", id, ctx.Err())
		}
	}
}

func (m *Manager) release(id string) {
	m.mu.Lock()
	close(m.busy[id])
	delete(m.busy, id)
	m.mu.Unlock()
}

// Attach makes sandbox id's network: a new netns pinned under Dir; a veth
// from the host netns into it; a persistent tap (no packet info, vnet
// header) with the gateway address; a /29 from the pool; routes both ways;
// the egress policy p in the netns's nftables; the DNS proxy on
// gateway:53; a fresh random locally administered MAC for the guest. A
// failed Attach leaves nothing behind.
func (m *Manager) Attach(ctx context.Context, id string, p Policy) (info Info, err error) {
	if err := p.Validate(); err != nil {
		return Info{}, err
	}
	p = p.normalized()
	if err := m.reserve(ctx, id); err != nil {
		return Info{}, err
	}
	defer m.release(id)
	m.mu.Lock()
	if _, ok := m.records[id]; ok {
		m.mu.Unlock()
		return Info{}, fmt.Errorf("hostnet: sandbox %s: %w", id, ErrExists)
	}
	index, err := m.alloc.alloc()
	m.mu.Unlock()
	if err != nil {
		return Info{}, err
	}
	rec := record{ID: id, Index: index, MAC: randomMAC(), Policy: p}
	defer func() {
		if err != nil {
			if cerr := m.teardown(rec); cerr != nil {
				m.log.Error("cleaning up a failed attach", "sandbox", id, "err", cerr)
			}
			m.mu.Lock()
			m.alloc.free(index)
			m.mu.Unlock()
			err = fmt.Errorf("hostnet: attaching sandbox %s: %w", id, err)
		}
	}()
	// The record first: a crash from here on leaves a record that List
	// shows and Detach removes with what else was made.
	if err := writeRecord(m.cfg.Dir, rec); err != nil {
		return Info{}, err
	}
	a, err := m.build(ctx, rec)
	if err != nil {
		return Info{}, err
	}
	m.mu.Lock()
	m.records[id] = rec
	if m.closed {
		// Close ran meanwhile: the attachment stays, for a later manager.
		m.mu.Unlock()
		a.stop()
		return m.info(rec), nil
	}
	m.live[id] = a
	m.mu.Unlock()
	m.log.Info("sandbox network attached", "sandbox", id, "address", rec.block(m.cfg.Pool).guest(), "veth", vethName(index), "policy", p.Mode)
	return m.info(rec), nil
}

func (r record) block(pool netip.Prefix) block { return blockAt(pool, r.Index) }

func (m *Manager) info(r record) Info {
	b := r.block(m.cfg.Pool)
	return Info{
		Netns:   filepath.Join(netnsDir(m.cfg.Dir), r.ID),
		Tap:     tapName,
		MAC:     r.MAC,
		Address: b.guest(),
		Gateway: b.gateway().Addr(),
		MTU:     mtu,
	}
}

// randomMAC is a random locally administered unicast MAC.
func randomMAC() string {
	var b [6]byte
	rand.Read(b[:])
	b[0] = b[0]&0xfe | 0x02
	return net.HardwareAddr(b[:]).String()
}

// build makes everything of a new attachment but its record.
func (m *Manager) build(ctx context.Context, rec record) (*attachment, error) {
	b := rec.block(m.cfg.Pool)
	nsPath := filepath.Join(netnsDir(m.cfg.Dir), rec.ID)
	if err := newPinnedNetns(nsPath); err != nil {
		return nil, err
	}
	nsFD, err := openNetns(nsPath)
	if err != nil {
		return nil, err
	}
	a := &attachment{id: rec.ID, blk: b, nsPath: nsPath, nsFD: nsFD, policy: rec.Policy, learned: map[netip.Addr]learned{}}
	ok := false
	defer func() {
		if !ok {
			a.stop()
		}
	}()
	err = inNetns(nsFD, func() error {
		for _, s := range []struct{ path, val string }{
			{"/proc/sys/net/ipv6/conf/all/disable_ipv6", "1"},
			{"/proc/sys/net/ipv6/conf/default/disable_ipv6", "1"},
		} {
			// Best effort: a kernel without IPv6 has nothing to disable.
			os.WriteFile(s.path, []byte(s.val), 0o644)
		}
		if err := os.WriteFile("/proc/sys/net/ipv4/ip_forward", []byte("1"), 0o644); err != nil {
			return fmt.Errorf("turning on IPv4 forwarding in the sandbox netns: %w", err)
		}
		if err := makePersistentTap(tapName); err != nil {
			return err
		}
		return strictReversePath()
	})
	if err != nil {
		return nil, err
	}
	// The veth, its host end in the host netns, its other end in the
	// sandbox netns.
	hh, err := m.hostHandle()
	if err != nil {
		return nil, err
	}
	defer hh.Close()
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: vethName(rec.Index), MTU: mtu},
		PeerName:      nsVethName,
		PeerNamespace: netlink.NsFd(nsFD),
	}
	if err := hh.LinkAdd(veth); err != nil {
		return nil, fmt.Errorf("creating veth %s: %w", veth.Name, err)
	}
	if err := hh.AddrAdd(veth, &netlink.Addr{IPNet: ipNet(b.hostEnd())}); err != nil {
		return nil, fmt.Errorf("addressing veth %s: %w", veth.Name, err)
	}
	if err := hh.LinkSetUp(veth); err != nil {
		return nil, fmt.Errorf("bringing up veth %s: %w", veth.Name, err)
	}
	if err := hh.RouteAdd(&netlink.Route{LinkIndex: veth.Index, Dst: ipNet(b.guestNet()), Gw: b.nsEnd().Addr().AsSlice()}); err != nil {
		return nil, fmt.Errorf("routing %v via veth %s: %w", b.guestNet(), veth.Name, err)
	}
	nh, err := netlink.NewHandleAt(netns.NsHandle(nsFD), unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("netlink in the sandbox netns: %w", err)
	}
	defer nh.Close()
	for _, l := range []struct {
		name string
		addr netip.Prefix
	}{{"lo", netip.Prefix{}}, {nsVethName, b.nsEnd()}, {tapName, b.gateway()}} {
		link, err := nh.LinkByName(l.name)
		if err != nil {
			return nil, fmt.Errorf("sandbox netns link %s: %w", l.name, err)
		}
		if l.addr.IsValid() {
			if err := nh.AddrAdd(link, &netlink.Addr{IPNet: ipNet(l.addr)}); err != nil {
				return nil, fmt.Errorf("addressing %s in the sandbox netns: %w", l.name, err)
			}
		}
		if l.name == tapName {
			if err := nh.LinkSetMTU(link, mtu); err != nil {
				return nil, fmt.Errorf("setting %s's MTU: %w", l.name, err)
			}
		}
		if err := nh.LinkSetUp(link); err != nil {
			return nil, fmt.Errorf("bringing up %s in the sandbox netns: %w", l.name, err)
		}
	}
	if err := nh.RouteAdd(&netlink.Route{Dst: ipNet(netip.PrefixFrom(netip.IPv4Unspecified(), 0)), Gw: b.hostEnd().Addr().AsSlice()}); err != nil {
		return nil, fmt.Errorf("default route in the sandbox netns: %w", err)
	}
	if err := m.applyFresh(a, rec.Policy); err != nil {
		return nil, err
	}
	if err := m.startProxy(ctx, a); err != nil {
		return nil, err
	}
	ok = true
	a.resolveDenied(ctx, m.log)
	return a, nil
}

// strictReversePath turns on strict reverse-path filtering of the tap
// (rp_filter=1) in the calling thread's netns: a packet from the guest
// whose source is not routed back through the tap is dropped before
// nftables sees it (which drops it too).
func strictReversePath() error {
	p := "/proc/sys/net/ipv4/conf/" + tapName + "/rp_filter"
	if err := os.WriteFile(p, []byte("1"), 0o644); err != nil {
		return fmt.Errorf("turning on reverse-path filtering of %s: %w", tapName, err)
	}
	return nil
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// apply replaces a's nftables table with policy p (one batch), carrying
// over the learned addresses given.
func (m *Manager) apply(a *attachment, p Policy, keep []learnedElem) error {
	return m.install(a, sandboxRuleset{policy: p, learned: keep})
}

// applyFresh installs a's first table, in a netns that has none.
func (m *Manager) applyFresh(a *attachment, p Policy) error {
	return m.install(a, sandboxRuleset{policy: p, fresh: true})
}

// install completes r for a and installs it in one batch.
func (m *Manager) install(a *attachment, r sandboxRuleset) error {
	c, err := nftables.New(nftables.WithNetNSFd(a.nsFD))
	if err != nil {
		return fmt.Errorf("nftables in the sandbox netns: %w", err)
	}
	r.pool = m.cfg.Pool
	r.gw = a.blk.gateway().Addr()
	r.guest = a.blk.guest().Addr()
	r.refused = refusedSpans(m.refused, r.policy)
	if err := sandboxRules(c, r); err != nil {
		return err
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("installing the egress policy (nftables table inet %s): %w", tableName, err)
	}
	return nil
}

// startProxy binds the DNS proxy's sockets to gateway:53 in the sandbox
// netns and serves them.
func (m *Manager) startProxy(ctx context.Context, a *attachment) error {
	gw := netip.AddrPortFrom(a.blk.gateway().Addr(), 53).String()
	lc := net.ListenConfig{Control: func(network, address string, c syscall.RawConn) error {
		var serr error
		err := c.Control(func(fd uintptr) {
			// The tap has no carrier until a VMM opens it.
			serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_IP, unix.IP_FREEBIND, 1)
		})
		return errors.Join(err, serr)
	}}
	err := inNetns(a.nsFD, func() error {
		var err error
		if a.udp, err = lc.ListenPacket(ctx, "udp4", gw); err != nil {
			return fmt.Errorf("DNS proxy: %w", err)
		}
		if a.tcp, err = lc.Listen(ctx, "tcp4", gw); err != nil {
			return fmt.Errorf("DNS proxy: %w", err)
		}
		return nil
	})
	if err != nil {
		return err
	}
	pctx, cancel := context.WithCancel(context.Background())
	a.cancel = cancel
	log := m.log.With("sandbox", a.id)
	a.px = newProxy(a.policy, m.up, func(name string, deny bool, addrs []netip.Addr, ttl time.Duration) error {
		return a.learn(name, deny, addrs, ttl)
	}, log)
	a.kick = make(chan chan struct{})
	a.wg.Add(3)
	go func() { defer a.wg.Done(); a.px.serveUDP(pctx, a.udp, &a.wg) }()
	go func() { defer a.wg.Done(); a.px.serveTCP(pctx, a.tcp, &a.wg) }()
	go func() { defer a.wg.Done(); a.resolveDeniedLoop(pctx, m.up, log) }()
	return nil
}

// errPolicyChanged: the policy changed between a query's decision and its
// learning; the guest gets SERVFAIL and asks again.
var errPolicyChanged = errors.New("the egress policy changed during the query")

// learn adds addrs, resolved for name, to the netns's learned set (with a
// timeout of ttl) if the current policy still wants them.
func (a *attachment) learn(name string, deny bool, addrs []netip.Addr, ttl time.Duration) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	p := a.policy
	switch {
	case !deny && p.Mode == AllowAll, deny && (p.Mode != DenyList || !p.matchName(name)):
		return nil
	case !deny && (p.Mode != AllowList || !p.matchName(name)):
		return errPolicyChanged
	}
	now := time.Now()
	exp := now.Add(ttl)
	for addr, l := range a.learned {
		if !l.exp.After(now) {
			delete(a.learned, addr)
		}
	}
	var add []learnedElem
	for _, addr := range addrs {
		old, ok := a.learned[addr]
		if ok && old.deny == deny && !exp.After(old.exp.Add(5*time.Second)) {
			continue // already there, for about as long
		}
		if !ok && len(a.learned)+len(add) >= maxLearned {
			return fmt.Errorf("%d learned addresses, at most %d", len(a.learned), maxLearned)
		}
		add = append(add, learnedElem{addr: addr, left: ttl})
	}
	if len(add) == 0 {
		return nil
	}
	c, err := nftables.New(nftables.WithNetNSFd(a.nsFD))
	if err != nil {
		return fmt.Errorf("nftables in the sandbox netns: %w", err)
	}
	if err := learnElems(c, deny, add); err != nil {
		return err
	}
	if err := c.Flush(); err != nil {
		return fmt.Errorf("adding learned addresses: %w", err)
	}
	for _, e := range add {
		a.learned[e.addr] = learned{name: name, deny: deny, exp: exp}
	}
	return nil
}

// stop stops the proxy and closes the netns fd; the netns stays.
func (a *attachment) stop() {
	if a.cancel != nil {
		a.cancel()
	}
	if a.udp != nil {
		a.udp.Close()
	}
	if a.tcp != nil {
		a.tcp.Close()
	}
	a.wg.Wait()
	if a.px != nil {
		a.px.bg.Wait() // they use nsFD
	}
	if a.nsFD >= 0 {
		unix.Close(a.nsFD)
		a.nsFD = -1
	}
}

// teardown removes what an attachment made on the host: the host end of
// its veth (which takes the route and the other end), its pinned netns
// (with the tap), its record. What is already gone is fine.
func (m *Manager) teardown(r record) error {
	var errs []error
	hh, err := m.hostHandle()
	if err != nil {
		errs = append(errs, err)
	} else {
		if l, err := hh.LinkByName(vethName(r.Index)); err == nil {
			if err := hh.LinkDel(l); err != nil {
				errs = append(errs, fmt.Errorf("deleting veth %s: %w", vethName(r.Index), err))
			}
		} else if !errors.As(err, new(netlink.LinkNotFoundError)) {
			errs = append(errs, fmt.Errorf("looking up veth %s: %w", vethName(r.Index), err))
		}
		hh.Close()
	}
	if err := removePinnedNetns(filepath.Join(netnsDir(m.cfg.Dir), r.ID)); err != nil {
		errs = append(errs, err)
	}
	if err := os.Remove(recordPath(m.cfg.Dir, r.ID)); err != nil && !errors.Is(err, os.ErrNotExist) {
		errs = append(errs, fmt.Errorf("removing the record of %s: %w", r.ID, err))
	}
	return errors.Join(errs...)
}

// Adopt brings back an attachment a previous manager left (after a kilnd
// restart): it reopens the pinned netns, restarts its DNS proxy and
// returns its Info. ErrNotFound (wrapped) when id has no record; when its
// record outlived its netns (the host rebooted), Adopt removes what is
// left of it, frees its block and returns ErrNotFound too. Adopting a live
// attachment returns its Info.
func (m *Manager) Adopt(ctx context.Context, id string) (Info, error) {
	if err := m.reserve(ctx, id); err != nil {
		return Info{}, err
	}
	defer m.release(id)
	return m.adopt(ctx, id)
}

// adopt is Adopt for a reserved id.
func (m *Manager) adopt(ctx context.Context, id string) (Info, error) {
	m.mu.Lock()
	rec, ok := m.records[id]
	_, isLive := m.live[id]
	m.mu.Unlock()
	if !ok {
		return Info{}, fmt.Errorf("hostnet: sandbox %s: %w", id, ErrNotFound)
	}
	if isLive {
		return m.info(rec), nil
	}
	nsPath := filepath.Join(netnsDir(m.cfg.Dir), id)
	nsFD, err := openNetns(nsPath)
	if err != nil {
		m.log.Warn("dropping an attachment whose netns is gone", "sandbox", id, "err", err)
		if terr := m.teardown(rec); terr != nil {
			return Info{}, fmt.Errorf("hostnet: sandbox %s: its netns is gone and cleaning up failed: %w", id, terr)
		}
		m.mu.Lock()
		delete(m.records, id)
		m.alloc.free(rec.Index)
		m.mu.Unlock()
		return Info{}, fmt.Errorf("hostnet: sandbox %s: its netns is gone (%v): %w", id, err, ErrNotFound)
	}
	a := &attachment{id: id, blk: rec.block(m.cfg.Pool), nsPath: nsPath, nsFD: nsFD, policy: rec.Policy, learned: map[netip.Addr]learned{}}
	// The rules again, as this manager makes them (a kilnd upgrade
	// brings its rules to the sandboxes it adopts), with the addresses
	// learned before for the time they have left.
	err = inNetns(nsFD, strictReversePath)
	if err == nil {
		var keep []learnedElem
		if keep, err = a.learnedInKernel(rec.Policy); err == nil {
			err = m.apply(a, rec.Policy, keep)
		}
	}
	if err == nil {
		err = m.startProxy(ctx, a)
	}
	if err != nil {
		a.stop()
		return Info{}, fmt.Errorf("hostnet: adopting sandbox %s: %w", id, err)
	}
	a.resolveDenied(ctx, m.log)
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		a.stop()
		return Info{}, errors.New("hostnet: manager is closed")
	}
	m.live[id] = a
	m.mu.Unlock()
	m.log.Info("sandbox network adopted", "sandbox", id, "address", a.blk.guest())
	return m.info(rec), nil
}

// SetPolicy replaces sandbox id's egress policy in one nftables batch: new
// connections follow it at once. Addresses learned for domains the new
// policy still names carry over. Established connections the new policy
// forbids are cut: their conntrack entries in the sandbox netns are
// deleted, so their next packet is judged as new and rejected.
func (m *Manager) SetPolicy(ctx context.Context, id string, p Policy) error {
	if err := p.Validate(); err != nil {
		return err
	}
	p = p.normalized()
	if err := m.reserve(ctx, id); err != nil {
		return err
	}
	defer m.release(id)
	if _, err := m.adopt(ctx, id); err != nil {
		return err
	}
	m.mu.Lock()
	a := m.live[id]
	m.mu.Unlock()
	if err := m.setPolicy(a, p); err != nil {
		return err
	}
	a.resolveDenied(ctx, m.log)
	return nil
}

// setPolicy is SetPolicy's change of a live attachment.
func (m *Manager) setPolicy(a *attachment, p Policy) error {
	id := a.id
	m.mu.Lock()
	rec := m.records[id]
	m.mu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	now := time.Now()
	var keep []learnedElem
	kept := map[netip.Addr]learned{}
	for addr, l := range a.learned {
		if !l.exp.After(now) || !p.matchName(l.name) || l.deny != (p.Mode == DenyList) || p.Mode != AllowList && p.Mode != DenyList {
			continue
		}
		keep = append(keep, learnedElem{addr: addr, left: l.exp.Sub(now)})
		kept[addr] = l
	}
	rec.Policy = p
	if err := writeRecord(m.cfg.Dir, rec); err != nil {
		return err
	}
	if err := m.apply(a, p, keep); err != nil {
		// The record is ahead of the kernel; put it back.
		m.mu.Lock()
		old := m.records[id]
		m.mu.Unlock()
		if werr := writeRecord(m.cfg.Dir, old); werr != nil {
			m.log.Error("restoring a record", "sandbox", id, "err", werr)
		}
		return fmt.Errorf("hostnet: sandbox %s: %w", id, err)
	}
	a.policy = p
	a.learned = kept
	a.px.setPolicy(p)
	m.mu.Lock()
	m.records[id] = rec
	m.mu.Unlock()
	n, err := a.cutForbidden(m.cfg.Pool, p, refusedSpans(m.refused, p), kept)
	if err != nil {
		m.log.Warn("egress policy set, but cutting forbidden connections failed", "sandbox", id, "err", err)
	}
	m.log.Info("egress policy set", "sandbox", id, "policy", p.Mode, "cidrs", len(p.CIDRs), "domains", len(p.Domains), "cut", n)
	return nil
}

// cutForbidden deletes the conntrack entries of the guest's connections
// that p forbids.
func (a *attachment) cutForbidden(pool netip.Prefix, p Policy, refused []span, kept map[netip.Addr]learned) (uint, error) {
	h, err := netlink.NewHandleAt(netns.NsHandle(a.nsFD), unix.NETLINK_NETFILTER)
	if err != nil {
		return 0, fmt.Errorf("conntrack netlink in the sandbox netns: %w", err)
	}
	defer h.Close()
	f := forbidFilter{guest: a.blk.guest().Addr(), gw: a.blk.gateway().Addr(), pool: pool, p: p, refused: refused, learned: kept}
	return h.ConntrackDeleteFilters(netlink.ConntrackTable, unix.AF_INET, f)
}

type forbidFilter struct {
	guest, gw netip.Addr
	pool      netip.Prefix
	p         Policy
	refused   []span
	learned   map[netip.Addr]learned
}

func (f forbidFilter) MatchConntrackFlow(flow *netlink.ConntrackFlow) bool {
	src, ok1 := netip.AddrFromSlice(flow.Forward.SrcIP.To4())
	dst, ok2 := netip.AddrFromSlice(flow.Forward.DstIP.To4())
	if !ok1 || !ok2 || src != f.guest || dst == f.gw {
		return false
	}
	_, learned := f.learned[dst]
	return f.pool.Contains(dst) || !f.p.allows(dst, learned, f.refused)
}

// Policy returns sandbox id's egress policy (normalized).
func (m *Manager) Policy(id string) (Policy, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.records[id]
	if !ok {
		return Policy{}, fmt.Errorf("hostnet: sandbox %s: %w", id, ErrNotFound)
	}
	p := r.Policy
	p.CIDRs = slices.Clone(p.CIDRs)
	p.Domains = slices.Clone(p.Domains)
	return p, nil
}

// Detach stops sandbox id's DNS proxy, deletes its veth and its netns
// (with the tap), unpins it, frees its block and drops its record. An id
// with no attachment is no error.
func (m *Manager) Detach(ctx context.Context, id string) error {
	if err := m.reserve(ctx, id); err != nil {
		return err
	}
	defer m.release(id)
	m.mu.Lock()
	rec, ok := m.records[id]
	a := m.live[id]
	m.mu.Unlock()
	if !ok {
		return nil
	}
	if a != nil {
		a.stop()
	}
	m.mu.Lock()
	delete(m.live, id)
	m.mu.Unlock()
	if err := m.teardown(rec); err != nil {
		return fmt.Errorf("hostnet: detaching sandbox %s: %w", id, err)
	}
	m.mu.Lock()
	delete(m.records, id)
	m.alloc.free(rec.Index)
	m.mu.Unlock()
	m.log.Info("sandbox network detached", "sandbox", id)
	return nil
}

// List returns the ids that have an attachment (a record), sorted: the
// daemon prunes those it has no sandbox for.
func (m *Manager) List() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	ids := make([]string, 0, len(m.records))
	for id := range m.records {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// Close stops every DNS proxy and leaves the attachments in place, for a
// later Manager to adopt.
func (m *Manager) Close() error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	live := m.live
	m.live = map[string]*attachment{}
	m.mu.Unlock()
	for _, a := range live {
		a.stop()
	}
	return unix.Close(m.hostFD)
}

// resolveDeniedLoop resolves a deny list's domains into deny_dns (package
// doc, deny.go) until ctx is done: a round when a.kick asks for one and
// whenever the last round's answers are due again.
func (a *attachment) resolveDeniedLoop(ctx context.Context, up exchanger, log *slog.Logger) {
	rl := newRateLog(log, time.Second)
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		var done chan struct{}
		select {
		case <-ctx.Done():
			return
		case done = <-a.kick:
		case <-timer.C:
		}
		a.mu.Lock()
		p := a.policy
		a.mu.Unlock()
		next := resolveDenied(ctx, up, a.learn, p, rl)
		if done != nil {
			close(done)
		}
		timer.Stop()
		if next > 0 {
			timer.Reset(next)
		}
	}
}

// resolveDenied asks a's resolver for a round now and waits for it, at
// most denyWait (the round goes on after that), when a's policy is a deny
// list by domain.
func (a *attachment) resolveDenied(ctx context.Context, log *slog.Logger) {
	a.mu.Lock()
	p := a.policy
	a.mu.Unlock()
	if p.Mode != DenyList || len(p.Domains) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, denyWait)
	defer cancel()
	done := make(chan struct{})
	select {
	case a.kick <- done:
	case <-ctx.Done():
		log.Warn("deny list: the resolver is busy; its round goes on in the background", "sandbox", a.id)
		return
	}
	select {
	case <-done:
	case <-ctx.Done():
		log.Warn("deny list: resolving the denied domains goes on in the background", "sandbox", a.id, "waited", denyWait)
	}
}

// learnedInKernel reads the learned set p's mode uses from a's netns
// table, with the time each address has left: what a table made by an
// earlier manager knew. Nothing when there is no table yet.
func (a *attachment) learnedInKernel(p Policy) ([]learnedElem, error) {
	if p.Mode != AllowList && p.Mode != DenyList {
		return nil, nil
	}
	c, err := nftables.New(nftables.WithNetNSFd(a.nsFD))
	if err != nil {
		return nil, fmt.Errorf("nftables in the sandbox netns: %w", err)
	}
	_, allow, deny := sandboxTable()
	s := allow
	if p.Mode == DenyList {
		s = deny
	}
	got, err := c.GetSetByName(s.Table, s.Name)
	if err != nil {
		return nil, nil // no such set: nothing learned
	}
	es, err := c.GetSetElements(got)
	if err != nil {
		return nil, fmt.Errorf("reading nftables set %s: %w", s.Name, err)
	}
	var out []learnedElem
	for _, e := range es {
		addr, ok := netip.AddrFromSlice(e.Key)
		if !ok || !addr.Is4() || e.Expires <= 0 {
			continue
		}
		out = append(out, learnedElem{addr: addr, left: e.Expires})
	}
	return out, nil
}
