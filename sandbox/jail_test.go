package sandbox

import (
	"strings"
	"testing"

	"github.com/kilnvm/kiln/virtio"
)

// TestJailNetns: the network namespace a jailed VMM process starts in,
// from its devices.
func TestJailNetns(t *testing.T) {
	nic := func(tap, netns string) virtio.DeviceSpec {
		return virtio.DeviceSpec{ID: "net-" + tap, Kind: virtio.KindNet, Net: &virtio.NetSpec{Tap: tap, Netns: netns}}
	}
	vsock := virtio.DeviceSpec{ID: VsockDevice, Kind: virtio.KindVsock, Vsock: &virtio.VsockSpec{Path: "/sb/vsock.sock"}}
	for _, tc := range []struct {
		name    string
		devices []virtio.DeviceSpec
		want    string
		err     string
	}{
		{"no tap: a new empty one", []virtio.DeviceSpec{vsock}, "", ""},
		{"tap in a named netns", []virtio.DeviceSpec{vsock, nic("tap0", "sb1")}, "/var/run/netns/sb1", ""},
		{"tap in a netns by path", []virtio.DeviceSpec{nic("tap0", "/run/kiln/netns/sb1")}, "/run/kiln/netns/sb1", ""},
		{"tap in the host's", []virtio.DeviceSpec{nic("tap0", "")}, "/proc/self/ns/net", ""},
		{"two taps, one netns", []virtio.DeviceSpec{nic("a", "sb1"), nic("b", "/var/run/netns/sb1")}, "/var/run/netns/sb1", ""},
		{"two netns", []virtio.DeviceSpec{nic("a", "sb1"), nic("b", "")}, "", "one network namespace"},
		{"image root: no network needed", []virtio.DeviceSpec{vsock, {ID: "rootfs", Kind: virtio.KindFS}}, "", ""},
		{"image root and a tap", []virtio.DeviceSpec{{ID: "rootfs", Kind: virtio.KindFS}, nic("tap0", "sb1")}, "/var/run/netns/sb1", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := jailNetns(tc.devices)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("jailNetns: %q, %v; want an error with %q", got, err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("jailNetns: %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

// TestJailOptionsNoIDs: a jail without an id allocator is refused.
func TestJailOptionsNoIDs(t *testing.T) {
	if _, err := (&JailOptions{}).jailConfig(nil); err == nil || !strings.Contains(err.Error(), "no id allocator") {
		t.Fatalf("jailConfig: %v", err)
	}
}
