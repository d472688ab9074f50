package vmm

import (
	"context"
	"fmt"
	"os"
)

// Freeze is the first half of a fork whose children live in other
// processes: the VM is paused and saved, its memory becomes a frozen base
// (memory.Freeze) over which the VM itself goes on copy-on-write, and the
// VM resumes (a paused VM stays paused). It returns the state and the
// base, which the caller hands to each child's process (SCM_RIGHTS): a
// child maps it copy-on-write (memory.MapFile) and restores over it
// (Restore), so that children in other processes share the pages none of
// them wrote, as Fork's children do. The caller owns the base and closes
// it once every child has mapped it. Freeze is one lifecycle operation,
// like Fork.
func (v *VM) Freeze(ctx context.Context) (_ *State, _ *os.File, err error) {
	var st *State
	var base *os.File
	err = v.lc.save(ctx, "freeze", true, func() error {
		s, err := v.saveState(ctx)
		if err != nil {
			return fmt.Errorf("freeze: %w", err)
		}
		fd, err := v.mem.Freeze()
		if err != nil {
			return fmt.Errorf("freeze: %w", err)
		}
		st, base = s, os.NewFile(uintptr(fd), "kiln-frozen-ram")
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	return st, base, nil
}
