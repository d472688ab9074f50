package hostnet

import (
	"context"
	"net"
	"testing"

	"github.com/kilnvm/kiln/virtio"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// TestVMMOpensTap: the VMM's own code (virtio.NewNet with the Info's tap,
// netns and MAC) attaches to the attachment's persistent tap, and the tap,
// with its address, stays when the VMM lets go of it.
func TestVMMOpensTap(t *testing.T) {
	w := newWorld(t)
	m := w.manager(t, t.TempDir())
	t.Cleanup(func() { m.Close() })
	ctx := context.Background()
	info, err := m.Attach(ctx, "vmm", Policy{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Detach(ctx, "vmm") })
	mac, err := net.ParseMAC(info.MAC)
	if err != nil {
		t.Fatal(err)
	}
	for range 2 { // a restarted VMM attaches again
		dev, err := virtio.NewNet(virtio.NetConfig{Tap: info.Tap, Netns: info.Netns, MAC: mac})
		if err != nil {
			t.Fatalf("virtio.NewNet on the attachment's tap: %v", err)
		}
		if dev.TapName() != info.Tap {
			t.Errorf("the VMM attached to %q, want %q", dev.TapName(), info.Tap)
		}
		if err := dev.Close(); err != nil {
			t.Fatal(err)
		}
	}
	fd, err := openNetns(info.Netns)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	h, err := netlink.NewHandleAt(netns.NsHandle(fd), unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	l, err := h.LinkByName(info.Tap)
	if err != nil {
		t.Fatalf("the tap is gone after the VMM closed it: %v", err)
	}
	addrs, err := h.AddrList(l, netlink.FAMILY_V4)
	if err != nil || len(addrs) != 1 || !addrs[0].IP.Equal(info.Gateway.AsSlice()) {
		t.Errorf("tap addresses %v, %v, want the gateway %v", addrs, err, info.Gateway)
	}
}
