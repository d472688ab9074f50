package virtio

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unicode"

	"github.com/kilnvm/kiln/internal/netnsthread"
	"golang.org/x/sys/unix"
)

// netnsDir is where `ip netns add NAME` mounts named network namespaces.
const netnsDir = "/var/run/netns"

// tapDevice is the host side of a virtio-net device: one Read returns one
// frame and one Write sends one, each prefixed with a 12-byte
// virtio_net_hdr_v1. *os.File over a tap fd is one; tests use a pipe.
type tapDevice interface {
	Read([]byte) (int, error)
	Write([]byte) (int, error)
	Close() error
}

// openTap opens /dev/net/tun, attaches it to the tap interface name (or
// creates it; the kernel picks a name when name is empty) with a vnet header
// of netHdrLen bytes, and returns it as a non-blocking file on Go's poller,
// with the interface's name. When netns is not empty, the tap is opened
// inside that network namespace: a name under /var/run/netns or a path.
func openTap(name, netns string) (*os.File, string, error) {
	if len(name) >= unix.IFNAMSIZ || strings.ContainsAny(name, "/\x00") || strings.ContainsFunc(name, unicode.IsSpace) {
		return nil, "", fmt.Errorf("tap name %q: want at most %d characters, no '/' or spaces", name, unix.IFNAMSIZ-1)
	}
	if netns == "" {
		return openTapHere(name)
	}
	path, err := netnsPath(netns)
	if err != nil {
		return nil, "", err
	}
	var (
		f      *os.File
		ifname string
	)
	err = inNetns(path, func() error {
		var err error
		f, ifname, err = openTapHere(name)
		return err
	})
	if err != nil {
		return nil, "", err
	}
	return f, ifname, nil
}

// netnsPath turns a namespace name (under /var/run/netns) or path into a path.
func netnsPath(netns string) (string, error) {
	if strings.ContainsRune(netns, '/') {
		return netns, nil
	}
	if netns == "." || netns == ".." || strings.ContainsRune(netns, 0) {
		return "", fmt.Errorf("network namespace name %q is not valid", netns)
	}
	return filepath.Join(netnsDir, netns), nil
}

// inNetns runs fn on a thread in the network namespace at path: taps it
// opens stay there (netnsthread.RunAt).
func inNetns(path string, fn func() error) error { return netnsthread.RunAt(path, fn) }

// openTapHere opens the tap in the calling thread's network namespace.
func openTapHere(name string) (*os.File, string, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, "", fmt.Errorf("opening /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, "", fmt.Errorf("tap name %q: %w", name, err)
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, "", fmt.Errorf("attaching to tap %q (TUNSETIFF): %w", name, err)
	}
	ifname := ifr.Name()
	if err := unix.IoctlSetPointerInt(fd, unix.TUNSETVNETHDRSZ, netHdrLen); err != nil {
		unix.Close(fd)
		return nil, "", fmt.Errorf("tap %s: setting the vnet header size (TUNSETVNETHDRSZ): %w", ifname, err)
	}
	// A non-blocking fd goes on Go's poller: a blocked Read parks only its
	// goroutine, and Close wakes it.
	return os.NewFile(uintptr(fd), "/dev/net/tun:"+ifname), ifname, nil
}
