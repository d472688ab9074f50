package main

import (
	"fmt"
	"runtime"

	"github.com/kilnvm/kiln/vmm"
)

// holdProcsUsage is the --hold-procs flag's text, the same in each suite
// that runs Kiln's VM in the bench's own process.
const holdProcsUsage = "run Kiln's vCPUs keeping their Go Ps while in the guest, as kilnd's VMM processes do (vmm.Config.HoldProcs; GOMAXPROCS grows by the vCPUs)"

// holdProcs sizes this process's GOMAXPROCS for one VM of cpus vCPUs
// when hold is set, as a kiln-vmm process does, and says what it did
// for the progress line. The commands that call it run Kiln's VMs one at
// a time; the figure starts from the runtime's default each time, so that
// commands run one after another in one process (the tests) do not add
// up.
func holdProcs(hold bool, cpus int) string {
	if !hold {
		return fmt.Sprintf("vCPUs release their Ps in the guest (GOMAXPROCS %d)", runtime.GOMAXPROCS(0))
	}
	runtime.SetDefaultGOMAXPROCS()
	procs := vmm.ProcsFor(cpus)
	runtime.GOMAXPROCS(procs)
	return fmt.Sprintf("vCPUs hold their Ps in the guest (GOMAXPROCS %d)", procs)
}
