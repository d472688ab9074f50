package hostnet

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"github.com/kilnvm/kiln/internal/netnsthread"
	"golang.org/x/sys/unix"
)

// inNetns runs fn on a thread in the network namespace nsFD (-1: this
// one): netnsthread.Run.
func inNetns(nsFD int, fn func() error) error { return netnsthread.Run(nsFD, fn) }

// newPinnedNetns makes a new network namespace and bind-mounts it on path
// (which must not exist), so that it outlives every process in it.
func newPinnedNetns(path string) error {
	f, err := os.OpenFile(path, os.O_RDONLY|os.O_CREATE|os.O_EXCL, 0o444)
	if err != nil {
		return fmt.Errorf("creating the netns pin %s: %w", path, err)
	}
	f.Close()
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("opening this thread's network namespace: %w", err)
			return
		}
		defer unix.Close(orig)
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("unshare(CLONE_NEWNET): %w", err)
			return
		}
		merr := unix.Mount("/proc/thread-self/ns/net", path, "none", unix.MS_BIND, "")
		if merr != nil {
			merr = fmt.Errorf("bind-mounting the new netns on %s: %w", path, merr)
		}
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(merr, fmt.Errorf("leaving the new network namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- merr
	}()
	if err := <-errc; err != nil {
		os.Remove(path)
		return err
	}
	return nil
}

// removePinnedNetns unmounts and removes a pin; a pin that is not there,
// or not mounted, is fine.
func removePinnedNetns(path string) error {
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmounting the netns pin %s: %w", path, err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing the netns pin %s: %w", path, err)
	}
	return nil
}

// openNetns opens a network namespace file (a pin or /proc/.../ns/net) and
// checks that it is one.
func openNetns(path string) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("opening network namespace %s: %w", path, err)
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil || st.Type != unix.NSFS_MAGIC {
		unix.Close(fd)
		return -1, fmt.Errorf("%s is not a network namespace (not on nsfs; is its pin unmounted?)", path)
	}
	return fd, nil
}

// writeSysctl writes a /proc/sys file from a thread in network namespace
// nsFD: net.* sysctls are per namespace.
func writeSysctl(nsFD int, path, value string) error {
	return inNetns(nsFD, func() error {
		if err := os.WriteFile(path, []byte(value), 0o644); err != nil {
			return fmt.Errorf("writing %s: %w", path, err)
		}
		return nil
	})
}

// makePersistentTap creates a persistent TAP interface name in the calling
// thread's netns, with the flags a VMM opens it with (no packet info, a
// vnet header), so that the VMM's TUNSETIFF attaches to it.
func makePersistentTap(name string) error {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening /dev/net/tun: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return fmt.Errorf("tap name %q: %w", name, err)
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		return fmt.Errorf("creating tap %s (TUNSETIFF): %w", name, err)
	}
	if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
		return fmt.Errorf("making tap %s persistent (TUNSETPERSIST): %w", name, err)
	}
	return nil
}
