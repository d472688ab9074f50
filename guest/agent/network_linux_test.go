package agent

import (
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agentpb"
)

func netReq(mod func(r *agentpb.ConfigureNetworkRequest)) *agentpb.ConfigureNetworkRequest {
	r := &agentpb.ConfigureNetworkRequest{Mac: "02:00:0a:c8:00:06", Addresses: []string{"10.200.0.6/30"},
		Gateway: "10.200.0.5", Mtu: 1500, Nameservers: []string{"10.200.0.5"}}
	if mod != nil {
		mod(r)
	}
	return r
}

func TestParseNetworkRequest(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(r *agentpb.ConfigureNetworkRequest)
		want string // "" : valid
	}{
		{"valid", nil, ""},
		{"named interface", func(r *agentpb.ConfigureNetworkRequest) { r.Interface = "eth0" }, ""},
		{"ipv6 too", func(r *agentpb.ConfigureNetworkRequest) {
			r.Addresses = append(r.Addresses, "fd00::2/64")
		}, ""},
		{"keep mac and mtu, no gateway, no dns", func(r *agentpb.ConfigureNetworkRequest) {
			r.Mac, r.Mtu, r.Gateway, r.Nameservers = "", 0, "", nil
		}, ""},
		{"long interface", func(r *agentpb.ConfigureNetworkRequest) { r.Interface = strings.Repeat("e", 16) }, "interface"},
		{"interface with slash", func(r *agentpb.ConfigureNetworkRequest) { r.Interface = "../eth0" }, "interface"},
		{"interface dotdot", func(r *agentpb.ConfigureNetworkRequest) { r.Interface = ".." }, "interface"},
		{"bad mac", func(r *agentpb.ConfigureNetworkRequest) { r.Mac = "02:00:0a" }, "mac"},
		{"long mac", func(r *agentpb.ConfigureNetworkRequest) { r.Mac = "02:00:00:00:00:00:00:01" }, "mac"},
		{"multicast mac", func(r *agentpb.ConfigureNetworkRequest) { r.Mac = "01:00:5e:00:00:01" }, "unicast"},
		{"zero mac", func(r *agentpb.ConfigureNetworkRequest) { r.Mac = "00:00:00:00:00:00" }, "unicast"},
		{"small mtu", func(r *agentpb.ConfigureNetworkRequest) { r.Mtu = 67 }, "mtu"},
		{"large mtu", func(r *agentpb.ConfigureNetworkRequest) { r.Mtu = 70000 }, "mtu"},
		{"no address", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = nil }, "addresses is empty"},
		{"too many addresses", func(r *agentpb.ConfigureNetworkRequest) {
			for i := range 17 {
				r.Addresses = append(r.Addresses, netip.AddrFrom4([4]byte{10, 1, 0, byte(i + 1)}).String()+"/24")
			}
		}, "at most 16"},
		{"address without prefix", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = []string{"10.200.0.6"} }, "addresses[0]"},
		{"garbage address", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = []string{"x/30"} }, "addresses[0]"},
		{"loopback", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = []string{"127.0.0.2/8"}; r.Gateway = "" }, "not an address"},
		{"unspecified", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = []string{"0.0.0.0/0"}; r.Gateway = "" }, "not an address"},
		{"network address", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = []string{"10.200.0.4/30"} }, "network's or broadcast"},
		{"broadcast", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = []string{"10.200.0.7/30"} }, "network's or broadcast"},
		{"duplicate", func(r *agentpb.ConfigureNetworkRequest) {
			r.Addresses = []string{"10.200.0.6/30", "10.200.0.6/29"}
		}, "twice"},
		{"zoned", func(r *agentpb.ConfigureNetworkRequest) { r.Addresses = []string{"fe80::1%eth0/64"}; r.Gateway = "" }, "addresses[0]"},
		{"bad gateway", func(r *agentpb.ConfigureNetworkRequest) { r.Gateway = "10.200.0" }, "gateway"},
		{"gateway outside", func(r *agentpb.ConfigureNetworkRequest) { r.Gateway = "10.200.0.9" }, "none of the addresses"},
		{"gateway is the address", func(r *agentpb.ConfigureNetworkRequest) { r.Gateway = "10.200.0.6" }, "one of the addresses"},
		{"too many nameservers", func(r *agentpb.ConfigureNetworkRequest) {
			r.Nameservers = []string{"10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"}
		}, "at most 3"},
		{"bad nameserver", func(r *agentpb.ConfigureNetworkRequest) { r.Nameservers = []string{"ns1"} }, "nameservers[0]"},
		{"multicast nameserver", func(r *agentpb.ConfigureNetworkRequest) { r.Nameservers = []string{"224.0.0.1"} }, "nameservers[0]"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseNetworkRequest(netReq(tc.mod))
			if tc.want == "" {
				if err != nil {
					t.Fatalf("valid request refused: %v", err)
				}
				return
			}
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v: want InvalidArgument mentioning %q", err, tc.want)
			}
		})
	}
}

func FuzzParseNetworkRequest(f *testing.F) {
	f.Add("eth0", "02:00:0a:c8:00:06", "10.200.0.6/30", "10.200.0.5", uint32(1500), "10.200.0.5")
	f.Add("", "", "fd00::2/64", "fd00::1", uint32(0), "")
	f.Add("/", "ff:ff:ff:ff:ff:ff", "1.2.3.4/0", "::", uint32(1<<31), "x")
	f.Fuzz(func(t *testing.T, iface, mac, addr, gw string, mtu uint32, ns string) {
		req := &agentpb.ConfigureNetworkRequest{Interface: iface, Mac: mac, Addresses: strings.Split(addr, ","),
			Gateway: gw, Mtu: mtu, Nameservers: strings.Split(ns, ",")}
		r, err := parseNetworkRequest(req)
		if err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("error %v: want InvalidArgument", err)
			}
			return
		}
		if len(r.addrs) == 0 || len(r.addrs) > maxNetAddresses || len(r.nameservers) > maxNameservers {
			t.Fatalf("accepted %+v", r)
		}
		if r.gateway.IsValid() {
			in := false
			for _, p := range r.addrs {
				in = in || p.Contains(r.gateway)
			}
			if !in {
				t.Fatalf("gateway %v outside %v", r.gateway, r.addrs)
			}
		}
	})
}

func TestWriteResolvConf(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "etc", "resolv.conf")
	servers := []netip.Addr{netip.MustParseAddr("10.200.0.5"), netip.MustParseAddr("fd00::1")}
	if err := writeResolvConf(path, servers); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := string(b); !strings.Contains(got, "\nnameserver 10.200.0.5\nnameserver fd00::1\n") {
		t.Errorf("resolv.conf: %q", got)
	}
	// Replaced, not appended to; no temporary file left.
	if err := writeResolvConf(path, servers[:1]); err != nil {
		t.Fatal(err)
	}
	b, _ = os.ReadFile(path)
	if strings.Count(string(b), "nameserver") != 1 {
		t.Errorf("second write: %q", b)
	}
	ents, _ := os.ReadDir(filepath.Dir(path))
	if len(ents) != 1 {
		t.Errorf("left in etc: %v", ents)
	}
	// A symlink is not replaced.
	link := filepath.Join(dir, "link.conf")
	if err := os.Symlink("/run/systemd/resolve/stub-resolv.conf", link); err != nil {
		t.Fatal(err)
	}
	err = writeResolvConf(link, servers)
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "symlink") {
		t.Errorf("symlink: %v", err)
	}
	if target, _ := os.Readlink(link); target != "/run/systemd/resolve/stub-resolv.conf" {
		t.Errorf("symlink changed to %q", target)
	}
}

// testNetns makes a network namespace with a ethernet link eth0 in
// it (a veth's end; its peer is peer0), removed when the test ends, and returns its path.
func testNetns(t *testing.T) (string, *netlink.Handle) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a network namespace")
	}
	name := "kiln-agent-test-" + strings.ReplaceAll(t.Name(), "/", "-")
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatal(err)
	}
	ns, err := netns.NewNamed(name)
	if serr := netns.Set(orig); serr != nil {
		// This thread is in the wrong namespace: let it die with the test.
		t.Fatalf("back to the test's network namespace: %v", serr)
	}
	orig.Close()
	runtime.UnlockOSThread()
	if err != nil {
		t.Fatalf("make network namespace %s: %v", name, err)
	}
	t.Cleanup(func() {
		ns.Close()
		if err := netns.DeleteNamed(name); err != nil {
			t.Errorf("delete network namespace %s: %v", name, err)
		}
	})
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}); err != nil {
		t.Fatalf("veth link: %v", err)
	}
	return "/var/run/netns/" + name, h
}

// TestConfigureNetwork configures a veth end as the card in a namespace of its own
// twice over (as a restore would) and checks what the kernel has.
func TestConfigureNetwork(t *testing.T) {
	path, h := testNetns(t)
	resolv := filepath.Join(t.TempDir(), "resolv.conf")
	s := NewServer(Config{NetworkNamespace: path, ResolvConf: resolv, System: LinuxSystem()})
	eth0, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	// A neighbour the guest learnt of the old gateway, and an old address.
	if err := h.LinkSetUp(eth0); err != nil {
		t.Fatal(err)
	}
	old, _ := netlink.ParseAddr("10.200.0.2/30")
	if err := h.AddrAdd(eth0, old); err != nil {
		t.Fatal(err)
	}
	if err := h.NeighAdd(&netlink.Neigh{LinkIndex: eth0.Attrs().Index, State: netlink.NUD_REACHABLE,
		IP: net.ParseIP("10.200.0.1"), HardwareAddr: net.HardwareAddr{2, 1, 1, 1, 1, 1}}); err != nil {
		t.Fatal(err)
	}

	for _, want := range []struct {
		mac, addr, gw string
		mtu           uint32
	}{
		{"02:00:0a:c8:00:06", "10.200.0.6/30", "10.200.0.5", 1400},
		{"02:00:0a:c8:00:0a", "10.200.0.10/30", "10.200.0.9", 1500},
	} {
		// The interface found without a name is a "device" link: a
		// veth is not one, so name it here.
		resp, err := s.ConfigureNetwork(t.Context(), &agentpb.ConfigureNetworkRequest{Interface: "eth0", Mac: want.mac,
			Addresses: []string{want.addr}, Gateway: want.gw, Mtu: want.mtu, Nameservers: []string{want.gw}})
		if err != nil {
			t.Fatalf("configure %s: %v", want.addr, err)
		}
		if resp.GetInterface() != "eth0" {
			t.Errorf("interface %q", resp.GetInterface())
		}
		l, err := h.LinkByName("eth0")
		if err != nil {
			t.Fatal(err)
		}
		a := l.Attrs()
		if a.HardwareAddr.String() != want.mac || a.MTU != int(want.mtu) || a.Flags&net.FlagUp == 0 {
			t.Errorf("link: mac %s mtu %d flags %v; want %s %d up", a.HardwareAddr, a.MTU, a.Flags, want.mac, want.mtu)
		}
		addrs, err := h.AddrList(l, netlink.FAMILY_V4)
		if err != nil {
			t.Fatal(err)
		}
		if len(addrs) != 1 || addrs[0].IPNet.String() != want.addr {
			t.Errorf("addresses %v, want only %s", addrs, want.addr)
		}
		neighs, _ := h.NeighList(l.Attrs().Index, netlink.FAMILY_V4)
		for _, n := range neighs {
			if n.IP.String() == "10.200.0.1" {
				t.Errorf("old gateway's neighbour entry left: %v", n)
			}
		}
		routes, err := h.RouteList(l, netlink.FAMILY_V4)
		if err != nil {
			t.Fatal(err)
		}
		def := 0
		for _, r := range routes {
			if r.Dst == nil || r.Dst.String() == "0.0.0.0/0" {
				def++
				if r.Gw.String() != want.gw {
					t.Errorf("default route via %v, want %s", r.Gw, want.gw)
				}
			}
		}
		if def != 1 {
			t.Errorf("%d default routes: %v", def, routes)
		}
		b, _ := os.ReadFile(resolv)
		if !strings.Contains(string(b), "nameserver "+want.gw+"\n") {
			t.Errorf("resolv.conf %q", b)
		}
	}

	// No such card; no ethernet card when none is named (a veth is not
	// a device); bad requests change nothing.
	_, err = s.ConfigureNetwork(t.Context(), netReq(func(r *agentpb.ConfigureNetworkRequest) { r.Interface = "eth9" }))
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "eth9") {
		t.Errorf("eth9: %v", err)
	}
	_, err = s.ConfigureNetwork(t.Context(), netReq(nil))
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "no ethernet card") {
		t.Errorf("unnamed: %v", err)
	}
	_, err = s.ConfigureNetwork(t.Context(), netReq(func(r *agentpb.ConfigureNetworkRequest) { r.Interface, r.Gateway = "eth0", "10.9.9.9" }))
	if status.Code(err) != codes.InvalidArgument {
		t.Errorf("bad gateway: %v", err)
	}
	l, _ := h.LinkByName("eth0")
	if addrs, _ := h.AddrList(l, netlink.FAMILY_V4); len(addrs) != 1 || addrs[0].IPNet.String() != "10.200.0.10/30" {
		t.Errorf("a refused request changed the addresses: %v", addrs)
	}
}
