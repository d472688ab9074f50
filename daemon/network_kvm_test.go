package daemon_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/hostnet"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// The addresses of the egress test's world: the host's uplink end, and
// the world's two servers (allowed.test and denied.test), addresses no
// sandbox is refused by default (hostnet.DefaultRefused), and a cloud
// metadata service's, which every sandbox is. They exist only inside the
// namespaces the test makes.
const (
	netTestUplink   = "11.99.0.1"
	netTestAllowed  = "11.99.0.2"
	netTestDenied   = "11.99.0.3"
	netTestMetadata = "169.254.169.254"
	netTestPool     = "10.200.0.0/24"
)

// netWorld is the egress test's outside: a "host" network namespace
// (hostnet's Config.HostNetns) and a "world" one joined to it by a veth,
// the host's uplink and default route. The world serves HTTP on both its
// addresses and DNS on the first, answering allowed.test and denied.test.
type netWorld struct {
	hostPath string
}

// newNetns makes the named network namespace, removed when the test ends.
func newNetns(t *testing.T, name string) netns.NsHandle {
	t.Helper()
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
		t.Fatalf("network namespace %s: %v", name, err)
	}
	t.Cleanup(func() {
		ns.Close()
		if err := netns.DeleteNamed(name); err != nil {
			t.Errorf("delete network namespace %s: %v", name, err)
		}
	})
	return ns
}

// inNetns runs fn on a thread in ns; sockets it makes stay in ns.
func inNetns(ns netns.NsHandle, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		if err := netns.Set(ns); err != nil {
			errc <- err
			return
		}
		ferr := fn()
		if err := netns.Set(orig); err != nil {
			errc <- fmt.Errorf("back from the namespace: %w (and %v)", err, ferr)
			return // the thread stays locked and dies with this goroutine
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

func newNetWorld(t *testing.T) *netWorld {
	t.Helper()
	base := fmt.Sprintf("kn%d", os.Getpid())
	host := newNetns(t, base+"-host")
	world := newNetns(t, base+"-world")
	hh, err := netlink.NewHandleAt(host, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer hh.Close()
	wh, err := netlink.NewHandleAt(world, unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer wh.Close()
	if err := hh.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "kup0"}, PeerName: "kworld0",
		PeerNamespace: netlink.NsFd(int(world))}); err != nil {
		t.Fatalf("uplink veth: %v", err)
	}
	setup := func(h *netlink.Handle, name string, addrs ...string) {
		t.Helper()
		for _, n := range []string{"lo", name} {
			l, err := h.LinkByName(n)
			if err != nil {
				t.Fatal(err)
			}
			if err := h.LinkSetUp(l); err != nil {
				t.Fatal(err)
			}
			if n == "lo" {
				continue
			}
			for _, a := range addrs {
				addr, _ := netlink.ParseAddr(a)
				if err := h.AddrAdd(l, addr); err != nil {
					t.Fatalf("%s %s: %v", name, a, err)
				}
			}
		}
	}
	setup(hh, "kup0", netTestUplink+"/24")
	setup(wh, "kworld0", netTestAllowed+"/24", netTestDenied+"/24", netTestMetadata+"/32")
	if err := hh.RouteAdd(&netlink.Route{Gw: net.ParseIP(netTestAllowed)}); err != nil {
		t.Fatalf("host default route: %v", err)
	}

	// The world's servers, on sockets made inside it.
	var lns []net.Listener
	var pc net.PacketConn
	var dnsTCP net.Listener
	if err := inNetns(world, func() error {
		for _, a := range []string{netTestAllowed, netTestDenied, netTestMetadata} {
			ln, err := net.Listen("tcp", a+":80")
			if err != nil {
				return err
			}
			lns = append(lns, ln)
		}
		var err error
		if pc, err = net.ListenPacket("udp", netTestAllowed+":53"); err != nil {
			return err
		}
		dnsTCP, err = net.Listen("tcp", netTestAllowed+":53")
		return err
	}); err != nil {
		t.Fatalf("world's servers: %v", err)
	}
	hs := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "world %s\n", r.Context().Value(http.LocalAddrContextKey))
	})}
	for _, ln := range lns {
		go hs.Serve(ln)
	}
	t.Cleanup(func() { hs.Close() })
	answers := map[string]string{"allowed.test.": netTestAllowed, "denied.test.": netTestDenied}
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		m.Authoritative = true
		if len(q.Question) == 1 {
			qq := q.Question[0]
			if a, ok := answers[strings.ToLower(qq.Name)]; ok {
				if qq.Qtype == dns.TypeA {
					m.Answer = append(m.Answer, &dns.A{Hdr: dns.RR_Header{Name: qq.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: 60}, A: net.ParseIP(a)})
				}
			} else {
				m.Rcode = dns.RcodeNameError
			}
		}
		w.WriteMsg(m)
	})
	udp := &dns.Server{PacketConn: pc, Handler: handler}
	tcp := &dns.Server{Listener: dnsTCP, Handler: handler}
	go udp.ActivateAndServe()
	go tcp.ActivateAndServe()
	t.Cleanup(func() { udp.Shutdown(); tcp.Shutdown() })
	return &netWorld{hostPath: "/var/run/netns/" + base + "-host"}
}

// TestKVMDaemonNetwork: a sandbox on its own network (hostnet, in
// namespaces this test makes) and its fork child, through the server:
// deny-all reaches nothing and DNS is refused; an allow list naming the
// server's address reaches it (a policy update, no restart); a domain
// allow list reaches allowed.test once the proxy resolved it, and neither
// resolves nor reaches denied.test; the child has its own address, MAC
// and namespace under the parent's policy; a rollback stays on its
// network; destroy removes the namespaces.
func TestKVMDaemonNetwork(t *testing.T) {
	kvmtest.Require(t)
	began := time.Now()
	w := newNetWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	mgr, err := hostnet.New(ctx, hostnet.Config{Pool: netip.MustParsePrefix(netTestPool),
		DNS: []netip.AddrPort{netip.MustParseAddrPort(netTestAllowed + ":53")}, Dir: t.TempDir(), HostNetns: w.hostPath,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatalf("hostnet: %v", err)
	}
	t.Cleanup(func() {
		for _, id := range mgr.List() {
			mgr.Detach(context.Background(), id)
		}
		mgr.Close()
	})
	e := newKVMEnv(t)
	e.stop()
	e.cfg.Network = daemon.HostNetwork(mgr)
	e.cfg.DefaultEgress = daemon.EgressPolicy{Mode: daemon.EgressDenyAll}
	e.startKVM()

	sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
		Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image}, Resources: &kilnpb.Resources{MemoryMib: 256}})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	n := sb.GetNetwork()
	t.Logf("sandbox %s ready in %d ms: %s via %s, mac %s, %s (setup %v)", sb.Id, sb.ReadyMs, n.GetAddress(), n.GetGateway(), n.GetMac(), n.GetNetns(),
		time.Since(began).Round(time.Millisecond))
	if n.GetEgress().GetMode() != kilnpb.EgressPolicy_MODE_DENY_ALL || n.GetAddress() == "" {
		t.Fatalf("network %v", n)
	}

	// sh runs script in sandbox id, returning its output and whether it
	// succeeded.
	sh := func(id, script string) (string, bool) {
		t.Helper()
		r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", script}})
		if r.err != nil {
			t.Fatalf("sandbox %s: %q: %v", id, script, r.err)
		}
		return strings.TrimSpace(r.stdout + r.stderr), r.exit.GetExitCode() == 0
	}
	// reach asks the world's HTTP server at addr for its page with
	// busybox nc (busybox wget crashes in a root without libc's files).
	reach := func(id, addr string, want bool) {
		t.Helper()
		get := `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 3 ` + addr + ` 80`
		out, _ := sh(id, get)
		if got := strings.HasSuffix(out, "world "+addr+":80"); got != want {
			t.Errorf("sandbox %s: %s: reached %v (%q), want %v", id, get, got, out, want)
		}
	}
	resolve := func(id, name, want string) {
		t.Helper()
		out, ok := sh(id, "nslookup "+name)
		switch {
		case want == "" && (ok || !strings.Contains(out, "REFUSED")):
			t.Errorf("sandbox %s: nslookup %s: %v %q, want REFUSED", id, name, ok, out)
		case want != "" && (!ok || !strings.Contains(out, "Address: "+want)):
			t.Errorf("sandbox %s: nslookup %s: %v %q, want %s", id, name, ok, out, want)
		}
	}
	// guestNet checks what the agent configured in the guest.
	guestNet := func(s *kilnpb.Sandbox) {
		t.Helper()
		out, ok := sh(s.Id, "ip -4 -o addr show eth0; ip link show eth0; ip route show default; cat /etc/resolv.conf")
		n := s.GetNetwork()
		for _, want := range []string{"inet " + n.GetAddress(), "link/ether " + n.GetMac(), "default via " + n.GetGateway(), "nameserver " + n.GetGateway()} {
			if !ok || !strings.Contains(out, want) {
				t.Errorf("sandbox %s: guest network lacks %q: %q", s.Id, want, out)
			}
		}
	}
	guestNet(sb)

	// Deny-all: nothing, DNS refused.
	reach(sb.Id, netTestAllowed, false)
	resolve(sb.Id, "allowed.test", "")

	// An allow list of the server's address, on the running sandbox.
	upd := func(p *kilnpb.EgressPolicy) {
		t.Helper()
		got, err := e.c.UpdateNetworkPolicy(ctx, &kilnpb.UpdateNetworkPolicyRequest{Id: sb.Id, Egress: p})
		if err != nil || got.GetNetwork().GetEgress().GetMode() != p.Mode {
			t.Fatalf("update policy: %v %v", got, err)
		}
	}
	upd(&kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Cidrs: []string{netTestAllowed + "/32"}})
	reach(sb.Id, netTestAllowed, true)
	reach(sb.Id, netTestDenied, false)

	// A domain allow list: allowed.test's address only once the proxy
	// has resolved it; denied.test neither by name nor by address.
	upd(&kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_LIST, Domains: []string{"allowed.test"}})
	reach(sb.Id, netTestAllowed, false)
	resolve(sb.Id, "allowed.test", netTestAllowed)
	reach(sb.Id, netTestAllowed, true)
	resolve(sb.Id, "denied.test", "")
	reach(sb.Id, netTestDenied, false)
	reach(sb.Id, netTestMetadata, false)

	// A fork child: its own namespace, address and MAC, the guest
	// reconfigured, the parent's policy (with a learned set of its own).
	kids, err := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 1})
	if err != nil || len(kids) != 1 {
		t.Fatalf("fork: %v %v", kids, err)
	}
	kid := kids[0]
	kn := kid.GetNetwork()
	t.Logf("fork child %s ready in %d ms: %s, mac %s", kid.Id, kid.ReadyMs, kn.GetAddress(), kn.GetMac())
	if kn.GetAddress() == n.GetAddress() || kn.GetMac() == n.GetMac() || kn.GetNetns() == n.GetNetns() || kn.GetAddress() == "" {
		t.Errorf("child's network %v is its parent's %v", kn, n)
	}
	if eg := kn.GetEgress(); eg.GetMode() != kilnpb.EgressPolicy_MODE_ALLOW_LIST || len(eg.GetDomains()) != 1 {
		t.Errorf("child's egress %v, want the parent's", eg)
	}
	guestNet(kid)
	resolve(kid.Id, "allowed.test", netTestAllowed)
	reach(kid.Id, netTestAllowed, true)
	resolve(kid.Id, "denied.test", "")
	reach(kid.Id, netTestDenied, false)
	// The parent still answers on its own address.
	reach(sb.Id, netTestAllowed, true)

	// A rollback in place: the old VMM lets go of the tap, the new one
	// opens it; the same address, MAC and policy, the guest reconfigured.
	ck, err := e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: sb.Id})
	if err != nil {
		t.Fatal(err)
	}
	rb, err := e.c.Rollback(ctx, &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck.Id})
	if err != nil {
		t.Fatalf("rollback: %v", err)
	}
	if rn := rb.GetNetwork(); rn.GetAddress() != n.GetAddress() || rn.GetMac() != n.GetMac() || rn.GetNetns() != n.GetNetns() {
		t.Errorf("rolled back onto %v, was %v", rn, n)
	}
	t.Logf("rolled back in %d ms", rb.ReadyMs)
	guestNet(rb)
	resolve(sb.Id, "allowed.test", netTestAllowed)
	reach(sb.Id, netTestAllowed, true)
	reach(sb.Id, netTestDenied, false)

	// Destroy removes the namespaces and the attachments.
	for _, s := range []*kilnpb.Sandbox{kid, sb} {
		if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: s.Id}); err != nil {
			t.Errorf("destroy %s: %v", s.Id, err)
		}
		if _, err := os.Stat(s.GetNetwork().GetNetns()); !os.IsNotExist(err) {
			t.Errorf("sandbox %s: network namespace %s left: %v", s.Id, s.GetNetwork().GetNetns(), err)
		}
	}
	if left := mgr.List(); len(left) > 0 {
		t.Errorf("attachments left: %v", left)
	}
	t.Logf("all in %v", time.Since(began).Round(time.Millisecond))
}
