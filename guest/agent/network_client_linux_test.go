package agent_test

import (
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/agent"
	"github.com/kilnvm/kiln/guest/client"
)

// TestConfigureNetworkClient drives ConfigureNetwork through the client
// and a served agent, on a veth in a network namespace of the test's.
func TestConfigureNetworkClient(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to make a network namespace")
	}
	name := "kiln-agent-client-test"
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		t.Fatal(err)
	}
	ns, err := netns.NewNamed(name)
	if serr := netns.Set(orig); serr != nil {
		t.Fatalf("back to the test's network namespace: %v", serr) // the thread dies locked
	}
	orig.Close()
	runtime.UnlockOSThread()
	if err != nil {
		t.Fatal(err)
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
	defer h.Close()
	if err := h.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "eth0"}, PeerName: "peer0"}); err != nil {
		t.Fatal(err)
	}
	resolv := filepath.Join(t.TempDir(), "resolv.conf")
	a := startAgent(t, agent.Config{NetworkNamespace: "/var/run/netns/" + name, ResolvConf: resolv})
	ctx := testContext(t, time.Minute)
	cfg := client.NetworkConfig{Interface: "eth0", MAC: "02:00:0a:c8:00:0a",
		Addresses: []netip.Prefix{netip.MustParsePrefix("10.200.0.10/30")}, Gateway: netip.MustParseAddr("10.200.0.9"),
		MTU: 1400, Nameservers: []netip.Addr{netip.MustParseAddr("10.200.0.9")}}
	got, err := a.ConfigureNetwork(ctx, cfg)
	if err != nil || got != "eth0" {
		t.Fatalf("configure: %q %v", got, err)
	}
	l, err := h.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	addrs, _ := h.AddrList(l, netlink.FAMILY_V4)
	if l.Attrs().HardwareAddr.String() != cfg.MAC || l.Attrs().MTU != 1400 || len(addrs) != 1 || addrs[0].IPNet.String() != "10.200.0.10/30" {
		t.Errorf("link %+v, addresses %v", l.Attrs(), addrs)
	}
	if b, _ := os.ReadFile(resolv); !strings.Contains(string(b), "nameserver 10.200.0.9\n") {
		t.Errorf("resolv.conf %q", b)
	}
	// The client refuses what it cannot send; the agent what is wrong.
	if _, err := a.ConfigureNetwork(ctx, client.NetworkConfig{MTU: 1 << 20}); err == nil {
		t.Error("an MTU of 1 MiB was sent")
	}
	_, err = a.ConfigureNetwork(ctx, client.NetworkConfig{Interface: "eth0"})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "addresses is empty") {
		t.Errorf("no address: %v", err)
	}
}
