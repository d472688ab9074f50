package sandbox

import "github.com/kilnvm/kiln/limits"

// A sandbox's shape: package limits writes it once (so that the daemon,
// which imports no VMM layer, shares it); these are its names here.
const (
	DefaultCPUs      = limits.DefaultCPUs
	DefaultMemoryMiB = limits.DefaultMemoryMiB
	MinMemoryMiB     = limits.MinMemoryMiB
	MaxCPUs          = limits.MaxCPUs
	MaxMemoryMiB     = limits.MaxMemoryMiB
)

// CheckCPUs refuses a vCPU count a sandbox cannot have (limits.CheckCPUs).
func CheckCPUs(n int) error { return limits.CheckCPUs(n) }

// CheckMemory refuses a memory size in MiB a sandbox cannot have
// (limits.CheckMemory).
func CheckMemory(mib int) error { return limits.CheckMemory(mib) }
