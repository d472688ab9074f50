package virtio

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"os/exec"
	"testing"
	"time"
)

// netTestNetns creates a network namespace for the test (deleted at its
// end) and returns its name, skipping the test where that is not possible:
// it needs root, /dev/net/tun and iproute2.
func netTestNetns(t *testing.T, prefix string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create a network namespace and a tap")
	}
	if _, err := os.Stat("/dev/net/tun"); err != nil {
		t.Skipf("no tun driver: %v", err)
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("no ip command (iproute2)")
	}
	ns := fmt.Sprintf("%s-%d", prefix, os.Getpid())
	netTestIP(t, "netns", "add", ns)
	t.Cleanup(func() {
		if out, err := exec.Command("ip", "netns", "delete", ns).CombinedOutput(); err != nil {
			t.Errorf("ip netns delete %s: %v: %s", ns, err, out)
		}
	})
	return ns
}

// netTestIP runs ip with args, failing the test when it fails.
func netTestIP(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
		t.Fatalf("ip %v: %v: %s", args, err, out)
	}
}

// TestTapNetns opens a real tap inside a fresh network namespace and checks
// that a frame the guest sends reaches that namespace's stack and its answer
// comes back: an ARP request for the namespace's address.
func TestTapNetns(t *testing.T) {
	ns := netTestNetns(t, "kiln-tap")
	guestMAC := net.HardwareAddr{0x52, 0x54, 0, 0, 0, 2}
	n, err := NewNet(NetConfig{Tap: "kilntap0", Netns: ns, MAC: guestMAC, Logger: netTestLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
	}()
	if n.TapName() != "kilntap0" {
		t.Errorf("tap name %q, want kilntap0", n.TapName())
	}
	if err := exec.Command("ip", "link", "show", "kilntap0").Run(); err == nil {
		t.Error("the tap is in this namespace, not in " + ns)
	}
	netTestIP(t, "-n", ns, "addr", "add", "10.0.2.1/24", "dev", "kilntap0")
	netTestIP(t, "-n", ns, "link", "set", "kilntap0", "up")

	rx, tx := netTestActivate(t, n)
	heads := map[uint16]uint64{}
	for range 8 {
		head, addrs := rx.add(netTestBuf{writable: netHdrLen + 1518})
		heads[head] = addrs[0]
	}
	n.QueueNotify(netRxQueue)

	// who-has 10.0.2.1 tell 10.0.2.2
	arp := make([]byte, 0, 42)
	arp = append(arp, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff)
	arp = append(arp, guestMAC...)
	arp = append(arp, 0x08, 0x06, 0, 1, 0x08, 0, 6, 4, 0, 1)
	arp = append(arp, guestMAC...)
	arp = append(arp, 10, 0, 2, 2, 0, 0, 0, 0, 0, 0, 10, 0, 2, 1)
	tx.add(netTestBuf{data: make([]byte, netHdrLen)}, netTestBuf{data: arp})
	n.QueueNotify(netTxQueue)
	tx.waitUsed(1)

	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		u := rx.waitUsed(1)[0]
		f := rx.read(heads[u.head], int(u.len))[netHdrLen:]
		// Other frames (IPv6 neighbour discovery) may come first.
		if len(f) >= 42 && binary.BigEndian.Uint16(f[12:]) == 0x0806 && binary.BigEndian.Uint16(f[20:]) == 2 {
			if !bytes.Equal(f[0:6], guestMAC) || !bytes.Equal(f[28:32], []byte{10, 0, 2, 1}) || !bytes.Equal(f[32:38], guestMAC) {
				t.Errorf("ARP reply %x is not for the guest's request", f)
			}
			if st := n.Stats(); st.TxPackets != 1 || st.RxPackets == 0 {
				t.Errorf("stats %+v, want 1 sent and some received", st)
			}
			return
		}
		head, addrs := rx.add(netTestBuf{writable: netHdrLen + 1518})
		heads[head] = addrs[0]
		n.QueueNotify(netRxQueue)
	}
	t.Fatal("no ARP reply from the namespace within 10s")
}
