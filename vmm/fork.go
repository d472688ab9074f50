package vmm

import (
	"context"
	"errors"
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
	// Devices returns child i's virtio devices: fresh devices of the
	// parent's types, in its order (each child needs its own host ends:
	// its own vsock socket, its own disk or a read-only one).
	Devices func(i int) ([]virtio.Device, error)
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
// A child can be forked in turn. The first fork of a VM booted by New
// costs no copy; a VM that is already copy-on-write (a child, a restored
// snapshot, a parent forked before) first copies its current memory into a
// new base, skipping zero pages.
func (v *VM) Fork(ctx context.Context, n int, cfg ForkConfig) (_ []*VM, err error) {
	if n < 1 || n > MaxForks {
		return nil, fmt.Errorf("fork: %d children: want 1 to %d", n, MaxForks)
	}
	if cfg.Devices == nil {
		return nil, errors.New("fork: no Devices function")
	}
	if err := v.Pause(ctx); err != nil {
		return nil, fmt.Errorf("fork: %w", err)
	}
	defer func() {
		if rerr := v.Resume(); rerr != nil && err == nil {
			err = fmt.Errorf("fork: resume the parent: %w", rerr)
		}
	}()
	st, err := v.SaveState(ctx)
	if err != nil {
		return nil, fmt.Errorf("fork: %w", err)
	}
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
		devs, err := cfg.Devices(i)
		if err != nil {
			return nil, fmt.Errorf("fork: child %d's devices: %w", i, err)
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
		ccfg := Config{
			CPUs: v.cfg.CPUs, MemoryMiB: v.cfg.MemoryMiB, Devices: devs,
			KVMPath: v.cfg.KVMPath, Logger: log.With("child", i),
		}
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
