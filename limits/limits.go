// Package limits is a sandbox's shape: the defaults and the limits that
// the library (package sandbox), kiln run, kilnd and the containerd shim
// all apply, written here once. It imports nothing of Kiln, so that the
// daemon, which knows no VMM layer, applies the same numbers as the VMM.
//
// They are a sandbox's, not a bare VM's: vmm's own floor (vmm.MinMemoryMiB,
// 16, is what kiln boot needs of any kernel) is lower; the maxima here are
// the machine's (vmm.MaxCPUs and vmm.MaxMemoryMiB are these).
package limits

import "fmt"

const (
	// DefaultCPUs and DefaultMemoryMiB are the shape of a sandbox that
	// asks for none.
	DefaultCPUs      = 1
	DefaultMemoryMiB = 512
	// MinMemoryMiB is the least memory a sandbox boots with: Debian's
	// kernel needs 74 MiB below the MMIO gap, and the agent its share.
	MinMemoryMiB = 128
	// MaxCPUs and MaxMemoryMiB are the most a machine may have: 254 vCPUs
	// (the APIC IDs an x86 MADT names), 1 TiB.
	MaxCPUs      = 254
	MaxMemoryMiB = 1 << 20
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
