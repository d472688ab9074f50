// Package netnsthread runs a function on an OS thread that has joined a
// network namespace: sockets, taps and netlink handles it opens stay in
// that namespace after the thread leaves it. hostnet (a sandbox's netns,
// its DNS sockets, per-netns sysctls) and virtio (a tap in a named netns)
// share it.
package netnsthread

import (
	"errors"
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"
)

// Run runs fn on a locked OS thread inside the network namespace nsFD
// (an open /proc/.../ns/net or a pinned namespace file), then moves the
// thread back; nsFD < 0 runs fn on a locked thread of the current one.
// When the thread cannot move back it stays locked, so the Go runtime
// ends it with the goroutine instead of reusing it in the wrong netns.
func Run(nsFD int, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if nsFD < 0 {
			err := fn()
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("opening this thread's network namespace: %w", err)
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(nsFD, unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("entering a network namespace: %w", err)
			return
		}
		ferr := fn()
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("leaving a network namespace: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

// RunAt is Run in the network namespace at path.
func RunAt(path string, fn func() error) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening network namespace %s: %w", path, err)
	}
	defer unix.Close(fd)
	if err := Run(fd, fn); err != nil {
		return fmt.Errorf("network namespace %s: %w", path, err)
	}
	return nil
}
