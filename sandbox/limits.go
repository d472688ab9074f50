package sandbox

import (
	"fmt"

	"github.com/kilnvm/kiln/vmm"
)

// A sandbox's shape: the defaults and the limits that the library, kiln
// run, kilnd and the containerd shim all apply, written here once. They
// are a sandbox's, not a bare VM's: vmm's own limits (vmm.MinMemoryMiB,
// 16, is what kiln boot needs of any kernel) are the machine's floor and
// ceiling, and the maxima here are the same.
const (
	// DefaultCPUs and DefaultMemoryMiB are the shape of a sandbox that
	// asks for none.
	DefaultCPUs      = 1
	DefaultMemoryMiB = 512
	// MinMemoryMiB is the least memory a sandbox boots with: Debian's
	// kernel needs 74 MiB below the MMIO gap, and the agent its share.
	MinMemoryMiB = 128
	// MaxCPUs and MaxMemoryMiB are the most a sandbox may have: the
	// VMM's.
	MaxCPUs      = vmm.MaxCPUs
	MaxMemoryMiB = vmm.MaxMemoryMiB
)

// CheckCPUs refuses a vCPU count a sandbox cannot have (1 to MaxCPUs).
// Callers name what gave it: "--cpus: " + the error.
func CheckCPUs(n int) error {
	if n < 1 || n > MaxCPUs {
		return fmt.Errorf("%d vCPUs: want 1 to %d", n, MaxCPUs)
	}
	return nil
}

// CheckMemory refuses a memory size in MiB a sandbox cannot have
// (MinMemoryMiB to MaxMemoryMiB).
func CheckMemory(mib int) error {
	if mib < MinMemoryMiB || mib > MaxMemoryMiB {
		return fmt.Errorf("%d MiB of memory: want %d to %d", mib, MinMemoryMiB, MaxMemoryMiB)
	}
	return nil
}
