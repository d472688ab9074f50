package hostnet

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The test topology, all in namespaces the test makes: "host" (the
// manager's HostNetns) joined by the veth up0 (its uplink and default
// route) to "world", which has a line server on :8080 at each of the
// world addresses and a DNS server on 10.99.0.2:53 (the host's upstream)
// and on worldOwnDNS (one a guest might ask instead of the proxy). The
// world's "internet" addresses are outside DefaultRefused; worldMetadata
// and worldLAN are the cloud metadata service and a host on the host's
// LAN, which are not. None of them exists outside these namespaces.
var (
	worldDNS      = netip.MustParseAddrPort("10.99.0.2:53")
	worldOwnDNS   = netip.MustParseAddrPort("11.99.0.53:53")
	worldAllowed  = netip.MustParseAddr("11.99.1.1") // allowed.test
	worldDenied   = netip.MustParseAddr("11.99.2.1") // denied.test
	worldOther    = netip.MustParseAddr("11.99.3.1") // a.wild.test
	worldMetadata = netip.MustParseAddr("169.254.169.254")
	worldLAN      = netip.MustParseAddr("192.168.77.10") // lan.test
	hostUplink    = netip.MustParseAddr("10.99.0.1")
	testPool      = netip.MustParsePrefix("10.200.0.0/16")
	worldZone     = map[string]netip.Addr{
		"allowed.test.": worldAllowed,
		"denied.test.":  worldDenied,
		"a.wild.test.":  worldOther,
		"lan.test.":     worldLAN,
	}
)

const worldPort = 8080

// testNetns is a network namespace a test made.
type testNetns struct {
	path string
	fd   int
}

// newTestNetns makes a pinned netns that the test removes at its end.
func newTestNetns(t testing.TB, name string) *testNetns {
	t.Helper()
	requireRoot(t)
	path := filepath.Join(t.TempDir(), name)
	if err := newPinnedNetns(path); err != nil {
		t.Fatal(err)
	}
	fd, err := openNetns(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Close(fd)
		if err := removePinnedNetns(path); err != nil {
			t.Error(err)
		}
	})
	ns := &testNetns{path: path, fd: fd}
	ns.do(t, func(h *netlink.Handle) error {
		lo, err := h.LinkByName("lo")
		if err != nil {
			return err
		}
		return h.LinkSetUp(lo)
	})
	return ns
}

func requireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: network namespaces, veths, taps and nftables")
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skipf("no tun driver: %v", err)
	}
}

// do runs fn with a netlink handle in ns.
func (ns *testNetns) do(t testing.TB, fn func(h *netlink.Handle) error) {
	t.Helper()
	h, err := netlink.NewHandleAt(netns.NsHandle(ns.fd), unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if err := fn(h); err != nil {
		t.Fatal(err)
	}
}

// listen makes a listener in ns.
func (ns *testNetns) listen(t testing.TB, network, addr string) net.Listener {
	t.Helper()
	var l net.Listener
	if err := inNetns(ns.fd, func() (err error) { l, err = net.Listen(network, addr); return err }); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	return l
}

// dial connects from ns.
func (ns *testNetns) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := inNetns(ns.fd, func() (err error) {
		var d net.Dialer
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}

// world is the test's host and world namespaces with their servers.
type world struct {
	host, world *testNetns
}

func newWorld(t testing.TB) *world {
	t.Helper()
	w := &world{host: newTestNetns(t, "host"), world: newTestNetns(t, "world")}
	w.host.do(t, func(h *netlink.Handle) error {
		v := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "up0"}, PeerName: "eth0", PeerNamespace: netlink.NsFd(w.world.fd)}
		if err := h.LinkAdd(v); err != nil {
			return err
		}
		if err := h.AddrAdd(v, &netlink.Addr{IPNet: ipNet(netip.PrefixFrom(hostUplink, 24))}); err != nil {
			return err
		}
		if err := h.LinkSetUp(v); err != nil {
			return err
		}
		return h.RouteAdd(&netlink.Route{Dst: ipNet(netip.MustParsePrefix("0.0.0.0/0")), Gw: worldDNS.Addr().AsSlice()})
	})
	w.world.do(t, func(h *netlink.Handle) error {
		l, err := h.LinkByName("eth0")
		if err != nil {
			return err
		}
		for _, p := range []string{"10.99.0.2/24", "11.99.0.53/32", "11.99.1.1/32", "11.99.2.1/32", "11.99.3.1/32", "169.254.169.254/32", "192.168.77.10/32"} {
			if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipNet(netip.MustParsePrefix(p))}); err != nil {
				return err
			}
		}
		return h.LinkSetUp(l)
	})
	// The line server: each line in gets "hello <local address>" back.
	serveLines(t, w.world.listen(t, "tcp4", fmt.Sprintf(":%d", worldPort)))
	// The DNS server.
	mux := dns.NewServeMux()
	mux.HandleFunc(".", func(rw dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		if a, ok := worldZone[strings.ToLower(q.Question[0].Name)]; ok && q.Question[0].Qtype == dns.TypeA {
			m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: q.Question[0].Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: a.AsSlice()})
		} else if !ok {
			m.Rcode = dns.RcodeNameError
		}
		rw.WriteMsg(m)
	})
	for _, a := range []netip.AddrPort{worldDNS, worldOwnDNS} {
		var pc net.PacketConn
		if err := inNetns(w.world.fd, func() (err error) { pc, err = net.ListenPacket("udp4", a.String()); return err }); err != nil {
			t.Fatal(err)
		}
		srv := &dns.Server{PacketConn: pc, Handler: mux}
		go srv.ActivateAndServe()
		t.Cleanup(func() { srv.Shutdown() })
		srvTCP := &dns.Server{Listener: w.world.listen(t, "tcp4", a.String()), Handler: mux}
		go srvTCP.ActivateAndServe()
		t.Cleanup(func() { srvTCP.Shutdown() })
	}
	return w
}

// serveLines answers each line on l's connections with "hello <addr>".
// Its cleanup closes the connections still open: a guest torn down right
// after its last request may never send its FIN.
func serveLines(t testing.TB, l net.Listener) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		open = map[net.Conn]bool{}
	)
	t.Cleanup(func() {
		l.Close()
		mu.Lock()
		for c := range open {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			open[c] = true
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() {
					mu.Lock()
					delete(open, c)
					mu.Unlock()
					c.Close()
				}()
				r := bufio.NewReader(c)
				for {
					if _, err := r.ReadString('\n'); err != nil {
						return
					}
					if _, err := fmt.Fprintf(c, "hello %s\n", c.LocalAddr()); err != nil {
						return
					}
				}
			}()
		}
	}()
}

func (w *world) manager(t testing.TB, dir string) *Manager {
	t.Helper()
	m, err := New(context.Background(), Config{
		Pool:      testPool,
		DNS:       []netip.AddrPort{worldDNS},
		Dir:       dir,
		HostNetns: w.host.path,
		Logger:    slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// guest plays a VMM and its guest: a netns whose tap eth0 is wired, frame
// by frame, to the attachment's tap, configured from the attachment's Info
// as the agent would.
type guest struct {
	ns   *testNetns
	info Info
}

func newGuest(t testing.TB, info Info) *guest {
	t.Helper()
	g := &guest{ns: newTestNetns(t, "guest"), info: info}
	var inner *os.File
	if err := inNetns(g.ns.fd, func() (err error) { inner, err = openVMMTap("eth0"); return err }); err != nil {
		t.Fatal(err)
	}
	// The sandbox side: opened as the VMM does (virtio openTap).
	sfd, err := openNetns(info.Netns)
	if err != nil {
		t.Fatal(err)
	}
	var outer *os.File
	err = inNetns(sfd, func() (err error) { outer, err = openVMMTap(info.Tap); return err })
	unix.Close(sfd)
	if err != nil {
		t.Fatalf("opening the attachment's tap as a VMM does: %v", err)
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); copyFrames(outer, inner) }()
	go func() { defer wg.Done(); copyFrames(inner, outer) }()
	t.Cleanup(func() { inner.Close(); outer.Close(); wg.Wait() })
	g.ns.do(t, func(h *netlink.Handle) error {
		l, err := h.LinkByName("eth0")
		if err != nil {
			return err
		}
		mac, err := net.ParseMAC(info.MAC)
		if err != nil {
			return err
		}
		if err := h.LinkSetHardwareAddr(l, mac); err != nil {
			return err
		}
		if err := h.LinkSetMTU(l, info.MTU); err != nil {
			return err
		}
		if err := h.AddrAdd(l, &netlink.Addr{IPNet: ipNet(info.Address)}); err != nil {
			return err
		}
		if err := h.LinkSetUp(l); err != nil {
			return err
		}
		return h.RouteAdd(&netlink.Route{Dst: ipNet(netip.MustParsePrefix("0.0.0.0/0")), Gw: info.Gateway.AsSlice()})
	})
	return g
}

// openVMMTap opens a tap as virtio's openTapHere does: IFF_TAP, no packet
// info, a 12-byte vnet header, non-blocking on Go's poller.
func openVMMTap(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("TUNSETIFF %s: %w", name, err)
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TUNSETVNETHDRSZ, 12); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("TUNSETVNETHDRSZ %s: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "tun:"+name), nil
}

func copyFrames(dst, src *os.File) {
	buf := make([]byte, 65536+12)
	for {
		n, err := src.Read(buf)
		if err != nil {
			return
		}
		if _, err := dst.Write(buf[:n]); err != nil && errors.Is(err, os.ErrClosed) {
			return
		}
	}
}

// get sends a line to addr:8080 from the guest and returns the answer.
func (g *guest) get(addr netip.Addr) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	c, err := g.ns.dial(ctx, "tcp4", netip.AddrPortFrom(addr, worldPort).String())
	if err != nil {
		return "", err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := io.WriteString(c, "hi\n"); err != nil {
		return "", err
	}
	return bufio.NewReader(c).ReadString('\n')
}

// lookup asks the guest's nameserver (the gateway) for name's A records.
func (g *guest) lookup(name string) (int, []netip.Addr, error) {
	return g.query(name, dns.TypeA, "udp")
}

func (g *guest) query(name string, qtype uint16, network string) (int, []netip.Addr, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := g.ns.dial(ctx, network, netip.AddrPortFrom(g.info.Gateway, 53).String())
	if err != nil {
		return 0, nil, err
	}
	defer c.Close()
	q := new(dns.Msg)
	q.SetQuestion(dns.Fqdn(name), qtype)
	cl := &dns.Client{Net: network, Timeout: 5 * time.Second}
	r, _, err := cl.ExchangeWithConnContext(ctx, q, &dns.Conn{Conn: c})
	if err != nil {
		return 0, nil, err
	}
	addrs, _ := answerAddrs(r)
	return r.Rcode, addrs, nil
}
