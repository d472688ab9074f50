package sandbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kilnvm/kiln/virtio"
)

// Fork makes n children of the running sandbox, each continuing from this
// moment (its processes, files and memory), without copying the guest's
// memory (vmm.VM.Fork); the sandbox itself runs on. Each child has its own
// vsock socket, fresh entropy, the host's time and the host name
// "<name>-<i>", and is returned once its agent answers. A child can be
// forked in turn. Read-only disks are shared; a writable disk (the root or
// a data disk) needs an image per child, from opts.Disks. Read-only
// volumes (AttachVolume) are shared too, empty volume slots stay empty in
// the children, and a writable volume makes Fork fail with
// ErrWritableVolume. A sandbox with a
// network card needs opts.Net: each child gets a tap and a MAC address of
// its own.
func (s *Sandbox) Fork(ctx context.Context, n int, opts ForkOptions) (_ []*Sandbox, err error) {
	s.life.Lock()
	defer s.life.Unlock()
	if n < 1 {
		return nil, fmt.Errorf("sandbox: fork: %d children: want at least 1", n)
	}
	specs := s.m.devices()
	oldMAC := specMAC(specs)
	if err := checkNewNIC("fork: the sandbox", oldMAC != "", opts.Net != nil, "ForkOptions.Net"); err != nil {
		return nil, err
	}
	var writable []string
	for _, d := range specs {
		if d.Kind != virtio.KindBlock || d.Block.ReadOnly || d.Block.EmptySlot() {
			continue
		}
		if d.Block.Slot {
			return nil, fmt.Errorf("sandbox: fork: %w: volume %s in slot %s is writable and the children cannot share it (attach it read-only to fork)", ErrWritableVolume, d.Block.Path, d.ID)
		}
		writable = append(writable, d.ID)
	}
	if len(writable) > 0 && opts.Disks == nil {
		return nil, fmt.Errorf("sandbox: fork: disk %q is writable and the children cannot share it: ForkOptions.Disks must give each child an image of its own (or make the disk read-only)", writable[0])
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
	nics := make([]*virtio.NetSpec, n)
	for i := range children {
		c, err := newSandbox(s.log.With("fork", i), "", s.hostname, start)
		if err != nil {
			return nil, fmt.Errorf("sandbox: fork: %w", err)
		}
		children[i] = c
		c.image, c.openFS, c.modules, c.snapKey = s.image, s.openFS, s.modules, s.snapKey
		c.imageFS, c.roots = s.imageFS, s.roots
		if opts.Net != nil {
			if nics[i] = opts.Net(i); nics[i] == nil {
				return nil, fmt.Errorf("sandbox: fork: ForkOptions.Net gave child %d no network card", i)
			}
		}
	}
	// Called while the parent is paused: ForkOptions.Disks may copy a
	// writable image as it is at this instant.
	devices := func(i int) ([]virtio.DeviceSpec, error) {
		disks := map[string]string{}
		for _, id := range writable {
			p, err := opts.Disks(i, id)
			if err != nil {
				return nil, fmt.Errorf("ForkOptions.Disks for disk %q: %w", id, err)
			}
			if p == "" {
				return nil, fmt.Errorf("ForkOptions.Disks gave no image for disk %q", id)
			}
			disks[id] = p
		}
		o, err := children[i].overrides(specs, nics[i], func(id string) (string, bool) {
			p, ok := disks[id]
			return p, ok
		})
		children[i].disks = blockPaths(s.disks, o)
		return o, err
	}
	machines, err := forkMachines(ctx, s.m, children, devices, opts.Cgroup, s.log)
	if err != nil {
		return nil, err
	}
	for i, m := range machines {
		children[i].m = m
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
	// address: a new random one when empty); required when the sandbox
	// has a network card.
	Net func(i int) *virtio.NetSpec
	// Disks returns the image child i uses for the sandbox's writable
	// disk id (RootDevice, or an ID of Options.Devices); required when
	// the sandbox has one. It is called while the parent is paused, so it
	// may copy the parent's image as it is at that instant (cp
	// --reflink); the image must have the parent's disk's size.
	Disks func(i int, id string) (string, error)
	// Cgroup, when set, returns the cgroup v2 folder child i's VMM
	// process starts in (ProcessOptions.Cgroup; a sandbox in this
	// process ignores it). Without it the children start in the
	// caller's cgroup, not in the parent's.
	Cgroup func(i int) string
}

// ErrWritableVolume is what Fork's error is (errors.Is) when the sandbox
// has a writable volume (AttachVolume): its children cannot share it.
var ErrWritableVolume = errors.New("a writable volume is attached")

// forkReadyTimeout is how long Fork waits for each of n children's agents:
// the children run all at once, so the wait grows with their number
// (under emulation 32 children took over 2 minutes to answer).
func forkReadyTimeout(n int) time.Duration {
	return 2*time.Minute + time.Duration(n)*15*time.Second
}
