package shim

import (
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"

	"github.com/kilnvm/kiln/internal/netnsthread"
)

// podNetns makes what CNI makes for a pod, in network namespaces of the
// test's own: the pod's namespace with eth0 (a veth whose peer is in a
// second namespace, the "node"), an address, a default route; and a
// persistent tap kiln0 beside it, as the VMM's would be.
func podNetns(t *testing.T) (pod string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Fatalf("ip (iproute2): %v", err)
	}
	suffix := fmt.Sprint(os.Getpid())
	pod, node := "kilnpod"+suffix, "kilnnode"+suffix
	run := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	for _, ns := range []string{pod, node} {
		run("netns", "add", ns)
		t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	}
	run("-n", pod, "link", "add", "eth0", "mtu", "1400", "type", "veth", "peer", "name", "veth0", "netns", node)
	run("-n", pod, "addr", "add", "10.99.0.2/24", "dev", "eth0")
	run("-n", pod, "link", "set", "eth0", "up")
	run("-n", pod, "link", "set", "lo", "up")
	run("-n", node, "addr", "add", "10.99.0.1/24", "dev", "veth0")
	run("-n", node, "link", "set", "veth0", "up")
	run("-n", pod, "route", "add", "default", "via", "10.99.0.1")
	run("-n", pod, "tuntap", "add", "dev", podTap, "mode", "tap")
	return filepath.Join("/var/run/netns", pod)
}

// TestPodNetwork: the pod's interface, addresses, gateway, MTU and DNS
// are read from its namespace and CRI's resolv.conf, and connect sets the
// two-way redirect between eth0 and the tap.
func TestPodNetwork(t *testing.T) {
	ns := podNetns(t)
	resolv := filepath.Join(t.TempDir(), "resolv.conf")
	if err := os.WriteFile(resolv, []byte("search default.svc\nnameserver 10.96.0.10\nnameserver bogus\nnameserver 1.1.1.1\noptions ndots:5\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	n, err := inspectPodNetwork(ns, resolv)
	if err != nil {
		t.Fatal(err)
	}
	want := []netip.Prefix{netip.MustParsePrefix("10.99.0.2/24")}
	if n.Link != "eth0" || n.Tap != podTap || n.MTU != 1400 || len(n.Addresses) != 1 || n.Addresses[0] != want[0] ||
		n.Gateway != netip.MustParseAddr("10.99.0.1") || len(n.MAC) != 17 {
		t.Errorf("inspectPodNetwork = %+v", n)
	}
	if len(n.Nameservers) != 2 || n.Nameservers[0].String() != "10.96.0.10" || n.Nameservers[1].String() != "1.1.1.1" {
		t.Errorf("nameservers %v, want 10.96.0.10 and 1.1.1.1", n.Nameservers)
	}
	if err := n.connect(); err != nil {
		t.Fatal(err)
	}
	// Again (a restore into the same namespace): replaced, not doubled.
	if err := n.connect(); err != nil {
		t.Fatalf("connect again: %v", err)
	}
	err = netnsthread.RunAt(ns, func() error {
		for _, pair := range [][2]string{{"eth0", podTap}, {podTap, "eth0"}} {
			from, err := netlink.LinkByName(pair[0])
			if err != nil {
				return err
			}
			to, _ := netlink.LinkByName(pair[1])
			fs, err := netlink.FilterList(from, netlink.MakeHandle(0xffff, 0))
			if err != nil {
				return err
			}
			var redirects int
			for _, f := range fs {
				if u, ok := f.(*netlink.U32); ok {
					for _, a := range u.Actions {
						if m, ok := a.(*netlink.MirredAction); ok && m.Ifindex == to.Attrs().Index && m.MirredAction == netlink.TCA_EGRESS_REDIR {
							redirects++
						}
					}
				}
			}
			if redirects != 1 {
				return fmt.Errorf("%s: %d redirects to %s, want 1 (filters %+v)", pair[0], redirects, pair[1], fs)
			}
			if pair[0] == podTap && (to.Attrs().MTU != 1400 || from.Attrs().MTU != 1400) {
				return fmt.Errorf("MTUs %d and %d, want 1400", from.Attrs().MTU, to.Attrs().MTU)
			}
		}
		return nil
	})
	if err != nil {
		t.Error(err)
	}
}

// TestPodNetworkRefused: a namespace without an addressed interface (a
// runtime asked for networking CNI never gave) is an error naming it.
func TestPodNetworkRefused(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("network namespaces need root")
	}
	name := fmt.Sprintf("kilnempty%d", os.Getpid())
	if out, err := exec.Command("ip", "netns", "add", name).CombinedOutput(); err != nil {
		t.Fatalf("ip netns add: %v: %s", err, out)
	}
	defer exec.Command("ip", "netns", "del", name).Run()
	if _, err := inspectPodNetwork(filepath.Join("/var/run/netns", name), ""); err == nil || !strings.Contains(err.Error(), "no interface") {
		t.Errorf("inspectPodNetwork of an empty namespace: %v", err)
	}
	if _, err := inspectPodNetwork("/nonexistent/netns", ""); err == nil {
		t.Error("inspectPodNetwork of a missing path succeeded")
	}
}

func TestParseNameservers(t *testing.T) {
	got := parseNameservers([]byte("nameserver ::ffff:10.0.0.1\nnameserver fd00::1\nnameserver 10.0.0.2\nnameserver 10.0.0.3\n#nameserver 9.9.9.9\n"))
	if len(got) != 3 || got[0].String() != "10.0.0.1" || got[1].String() != "fd00::1" || got[2].String() != "10.0.0.2" {
		t.Errorf("parseNameservers = %v", got)
	}
}

// TestPodNetnsOfApp: CRI names an app container's namespace by its pod
// sandbox's PID, which here is the shim's own: the pod's namespace comes
// from the sandbox container's spec instead, and the shim's own
// namespace is never taken over.
func TestPodNetnsOfApp(t *testing.T) {
	if _, err := inspectPodNetwork(fmt.Sprintf("/proc/%d/ns/net", os.Getpid()), ""); err == nil || !strings.Contains(err.Error(), "shim's own namespace") {
		t.Errorf("inspectPodNetwork of the shim's namespace: %v", err)
	}
	s, _, _ := newTestService(t)
	app := testSpec("true")
	app.Linux.Namespaces[2].Path = fmt.Sprintf("/proc/%d/ns/net", os.Getpid())
	if got := s.podNetns(app); got != "" {
		t.Errorf("podNetns without a sandbox container = %q, want none", got)
	}
	sb := testSpec("pause")
	sb.Annotations = map[string]string{criContainerType: criTypeSandbox}
	sb.Linux.Namespaces[2].Path = "/var/run/netns/cni-1234"
	s.containers["sandbox"] = &container{id: "sandbox", spec: sb}
	if got := s.podNetns(app); got != "/var/run/netns/cni-1234" {
		t.Errorf("podNetns = %q, want the sandbox's /var/run/netns/cni-1234", got)
	}
	other := testSpec("true")
	other.Linux.Namespaces[2].Path = "/var/run/netns/cni-5678"
	if got := s.podNetns(other); got != "/var/run/netns/cni-5678" {
		t.Errorf("podNetns of a spec naming its namespace = %q", got)
	}
}
