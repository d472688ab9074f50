package sandbox

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
)

// Fork makes n children of the running sandbox, each continuing from this
// moment (its processes, files and memory), without copying the guest's
// memory (vmm.VM.Fork); the sandbox itself runs on. Each child has its own
// vsock socket, fresh entropy, the host's time and the host name
// "<name>-<i>", and is returned once its agent answers. A child can be
// forked in turn. A sandbox with a writable root disk cannot be forked (the
// children would write one image); a read-only one is shared. A sandbox
// with a network card needs opts.Net: each child gets a tap and a MAC
// address of its own.
func (s *Sandbox) Fork(ctx context.Context, n int, opts ForkOptions) (_ []*Sandbox, err error) {
	if s.extraDevices {
		return nil, errors.New("sandbox: fork: a sandbox with extra devices cannot be forked")
	}
	if n < 1 {
		return nil, fmt.Errorf("sandbox: fork: %d children: want at least 1", n)
	}
	if err := checkNewNIC("fork: the sandbox", s.nic != nil, opts.Net != nil, "ForkOptions.Net"); err != nil {
		return nil, err
	}
	var oldMAC string
	if s.nic != nil {
		oldMAC = s.nic.MAC().String()
	}
	if s.disk != nil && !s.diskReadOnly {
		return nil, errors.New("sandbox: fork: the root disk is writable; fork needs a read-only one")
	}
	start := time.Now()
	children := make([]*Sandbox, n)
	defer func() {
		if err != nil {
			for _, c := range children {
				if c != nil {
					c.Close(context.Background())
				}
			}
		}
	}()
	for i := range children {
		c, err := newSandbox(s.log.With("fork", i), "", s.hostname, start)
		if err != nil {
			return nil, fmt.Errorf("sandbox: fork: %w", err)
		}
		// A read-only disk is shared; each child opens it itself.
		c.diskPath, c.diskReadOnly = s.diskPath, s.diskReadOnly
		children[i] = c
		if opts.Net != nil {
			if c.netCfg = opts.Net(i); c.netCfg == nil {
				return nil, fmt.Errorf("sandbox: fork: ForkOptions.Net gave child %d no network card", i)
			}
		}
	}
	devices := func(i int) ([]virtio.Device, error) { return children[i].openDevices(nil) }
	vms, err := s.vm.Fork(ctx, n, vmm.ForkConfig{
		Devices: devices,
		Console: func(i int) io.Writer { return children[i].console },
		Logger:  s.log,
	})
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	for i, vm := range vms {
		children[i].vm = vm
		children[i].run()
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, c := range children {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[i] = c.connect(ctx, forkReadyTimeout(n)); errs[i] == nil {
				errs[i] = c.freshen(ctx, fmt.Sprintf("%s-%d", s.hostname, i), oldMAC)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, fmt.Errorf("sandbox: fork: %w", err)
	}
	return children, nil
}

// ForkOptions are what each child of a fork gets of its own, beyond what
// Fork gives every child.
type ForkOptions struct {
	// Net returns child i's network card (a tap of its own, and a MAC
	// address: a new random one when nil); required when the sandbox has
	// a network card.
	Net func(i int) *virtio.NetConfig
}

// forkReadyTimeout is how long Fork waits for each of n children's agents:
// the children run all at once, so the wait grows with their number
// (under emulation 32 children took over 2 minutes to answer).
func forkReadyTimeout(n int) time.Duration {
	return 2*time.Minute + time.Duration(n)*15*time.Second
}
