package vmm

import (
	"context"
	"fmt"
	"io"
	"log/slog"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
)

// MaxForks bounds the children of one Fork.
const MaxForks = 1024

// ForkConfig says how to build each child of a Fork.
type ForkConfig struct {
	// Devices returns child i's overrides of the parent's devices (as
	// RestoreConfig.Devices): each child needs host ends of its own, a
	// vsock socket, a tap, a disk (a read-only one may be shared). The
	// parent's devices that child i does not override are opened again
	// from their specs.
	Devices func(i int) ([]virtio.DeviceSpec, error)
	// Console returns child i's console writer; nil discards it.
	Console func(i int) io.Writer
	// Logger is the children's; the parent's when nil.
	Logger *slog.Logger
}

// Fork makes n children of the running VM, each continuing from this very
// moment, without copying the guest's memory: the VM is paused, its memory
// becomes the frozen base that every child maps copy-on-write, and the
// parent itself goes on over a copy-on-write mapping of the same base. The
// parent resumes before Fork returns (also when it fails); the children
// start with Run. Each child gets a new VM generation ID (see
// NewGeneration), so its guest reseeds its RNG.
//
// Fork is one lifecycle operation from the pause to the resume: the
// parent is in the saving state throughout, and a Resume, Pause or save
// meanwhile waits for it. A paused parent is forked too, and stays paused;
// a parent in any other state is refused with a *StateError (ErrState).
// A parent that stops during the fork (Run's context, Close) is not
// resumed; the children are still whole.
//
// A child can be forked in turn. The first fork of a VM booted by New
// costs no copy; a VM that is already copy-on-write (a child, a restored
// snapshot, a parent forked before) first copies its current memory into a
// new base, skipping zero pages.
func (v *VM) Fork(ctx context.Context, n int, cfg ForkConfig) (_ []*VM, err error) {
	if n < 1 || n > MaxForks {
		return nil, fmt.Errorf("fork: %d children: want 1 to %d", n, MaxForks)
	}
	// The whole fork is one lifecycle operation: nothing resumes the
	// parent, or saves it, until the children are built.
	var children []*VM
	err = v.lc.save(ctx, "fork", true, func() error {
		st, err := v.saveState(ctx)
		if err != nil {
			return fmt.Errorf("fork: %w", err)
		}
		children, err = v.fork(st, n, cfg)
		return err
	})
	if err != nil {
		return nil, err
	}
	return children, nil
}

// fork builds Fork's n children from the parent's state st: the parent is
// in the saving state, its vCPUs and devices paused.
func (v *VM) fork(st *State, n int, cfg ForkConfig) (_ []*VM, err error) {
	base, err := v.mem.Freeze()
	if err != nil {
		return nil, fmt.Errorf("fork: %w", err)
	}
	defer unix.Close(base)

	log := cfg.Logger
	if log == nil {
		log = v.log
	}
	var children []*VM
	defer func() {
		if err != nil {
			for _, c := range children {
				c.Close()
			}
		}
	}()
	for i := range n {
		var devs []virtio.DeviceSpec
		if cfg.Devices != nil {
			if devs, err = cfg.Devices(i); err != nil {
				return nil, fmt.Errorf("fork: child %d's devices: %w", i, err)
			}
		}
		fd, err := unix.FcntlInt(uintptr(base), unix.F_DUPFD_CLOEXEC, 0)
		if err != nil {
			return nil, fmt.Errorf("fork: child %d: %w", i, err)
		}
		mem, err := memory.MapFile(fd, st.Layout(), true)
		if err != nil {
			unix.Close(fd)
			return nil, fmt.Errorf("fork: child %d: %w", i, err)
		}
		ccfg := RestoreConfig{Devices: devs, KVMPath: v.cfg.KVMPath, Logger: log.With("child", i), OpenFS: v.cfg.OpenFS, VCPUSeccomp: v.cfg.VCPUSeccomp}
		if cfg.Console != nil {
			ccfg.Console = cfg.Console(i)
		}
		child, err := Restore(ccfg, st, mem)
		if err != nil {
			return nil, fmt.Errorf("fork: child %d: %w", i, err)
		}
		children = append(children, child)
	}
	v.log.Debug("vm forked", "children", n)
	return children, nil
}
