package hostcheck

// The checks' kernel calls that fake files cannot stand in for.

import (
	"fmt"
	"runtime"

	"github.com/google/nftables"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
)

// probeKVM opens a KVM device (which checks KVM_GET_API_VERSION) and
// creates, then closes, a VM.
func probeKVM(path string) error {
	s, err := kvm.OpenPath(path)
	if err != nil {
		return err
	}
	defer s.Close()
	vm, err := s.CreateVM()
	if err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	return vm.Close()
}

// listTables lists nftables' tables over netlink in this network
// namespace.
func listTables() (int, error) {
	c, err := nftables.New()
	if err != nil {
		return 0, err
	}
	ts, err := c.ListTables()
	if err != nil {
		return 0, err
	}
	return len(ts), nil
}

// unshareNet makes a network namespace on a thread of its own, which is
// then left to die with its goroutine (a locked thread that is not
// unlocked ends when its goroutine does), so no other goroutine ever
// runs in that namespace.
func unshareNet() error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// Never unlocked: the thread exits with this goroutine.
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare(CLONE_NEWNET): %w", err)
			return
		}
		errc <- nil
	}()
	return <-errc
}
