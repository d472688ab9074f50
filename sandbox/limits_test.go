package sandbox

import (
	"strings"
	"testing"
)

// TestLimits: the checks take the bounds and refuse one past each, with
// the value and the range in the error; the defaults pass them.
func TestLimits(t *testing.T) {
	for _, c := range []struct {
		name  string
		check func(int) error
		n     int
		err   string // "" for none
	}{
		{"default vCPUs", CheckCPUs, DefaultCPUs, ""},
		{"one vCPU", CheckCPUs, 1, ""},
		{"most vCPUs", CheckCPUs, MaxCPUs, ""},
		{"no vCPUs", CheckCPUs, 0, "0 vCPUs: want 1 to 254"},
		{"negative vCPUs", CheckCPUs, -1, "-1 vCPUs"},
		{"too many vCPUs", CheckCPUs, MaxCPUs + 1, "255 vCPUs: want 1 to 254"},
		{"default memory", CheckMemory, DefaultMemoryMiB, ""},
		{"least memory", CheckMemory, MinMemoryMiB, ""},
		{"most memory", CheckMemory, MaxMemoryMiB, ""},
		{"no memory", CheckMemory, 0, "0 MiB of memory: want 128 to 1048576"},
		{"under the least", CheckMemory, MinMemoryMiB - 1, "127 MiB of memory"},
		{"a bare VM's least", CheckMemory, 16, "16 MiB of memory"},
		{"over the most", CheckMemory, MaxMemoryMiB + 1, "1048577 MiB of memory"},
	} {
		t.Run(c.name, func(t *testing.T) {
			err := c.check(c.n)
			if c.err == "" {
				if err != nil {
					t.Fatalf("%d: %v; want none", c.n, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Fatalf("%d: %v; want an error with %q", c.n, err, c.err)
			}
		})
	}
}
