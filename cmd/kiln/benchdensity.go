package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"strconv"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// densityFlags are kiln bench density's flags, parsed and checked.
type densityFlags struct {
	mem, cpus, children, cap int
	steps                    []int
	budgetGiB                float64
	floorMiB, parallel       int
	settle, bootTimeout      time.Duration
	method                   string
	jsonOut, kvmMode         string
	kernel, agent            string
	holdProcs                bool
}

const densityUsage = "usage: kiln bench density [--mem MiB] [--children N] [--cap N] [--steps 1,8,16,32] [--budget-gib G] [--settle D] [--method template|fork] [--parallel N] [--hold-procs=false] [--json FILE] [--kvm-mode M]"

// flagsPrinted is a flag.FlagSet's parse error, which it printed itself.
type flagsPrinted struct{ error }

// parseDensityFlags parses args; a wrong flag is an error that names it
// (printed, with the usage, by the caller).
func parseDensityFlags(args []string, stderr io.Writer) (densityFlags, error) {
	var f densityFlags
	fs := flag.NewFlagSet("kiln bench density", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, densityUsage)
		fs.PrintDefaults()
	}
	fs.IntVar(&f.mem, "mem", bench.DefaultDensityMemoryMiB, "guest memory of the template and every sandbox, in MiB")
	fs.IntVar(&f.cpus, "cpus", 1, "vCPUs of each sandbox")
	fs.IntVar(&f.children, "children", bench.DefaultDensityChildren, "sandboxes to start from the template")
	fs.IntVar(&f.cap, "cap", 0, "stop at this many sandboxes, if fewer than --children (0: no cap)")
	steps := fs.String("steps", "1,8,16,32", "cumulative sandbox `COUNTS` measured on the way (those past the target dropped, the target always last)")
	fs.Float64Var(&f.budgetGiB, "budget-gib", 8, "memory budget, in GiB, the fitting sandboxes are counted in")
	fs.IntVar(&f.floorMiB, "floor-mib", bench.DefaultDensityFloor>>20, "stop before the host's MemAvailable falls under this many MiB")
	fs.DurationVar(&f.settle, "settle", bench.DefaultDensitySettle, "how long the sandboxes idle after each step before they are checked and measured")
	fs.StringVar(&f.method, "method", bench.DensityTemplate, "how sandboxes are made: template (hold the booted parent once, restore every sandbox over that one frozen base) or fork (Sandbox.Fork of the running parent per step; each later step copies its memory into a new base)")
	fs.DurationVar(&f.bootTimeout, "boot-timeout", 5*time.Minute, "how long to wait for the template's agent")
	fs.IntVar(&f.parallel, "parallel", 0, "restores (and checking execs) at once within a step (0: a step's all at once)")
	fs.BoolVar(&f.holdProcs, "hold-procs", true, "the VMM processes' vCPUs keep their Go Ps while in the guest, as kilnd's do (false: $"+vmmproc.HoldProcsEnv+"=false, for the A/B)")
	fs.StringVar(&f.jsonOut, "json", "", "write every sample to this results `FILE` (kiln bench report reads it)")
	fs.StringVar(&f.kvmMode, "kvm-mode", "", "the KVM mode to record (direct, nested, emulated); default: told from /proc/cpuinfo")
	fs.StringVar(&f.kernel, "kernel", "", "kernel image; default: the cached Debian kernel")
	fs.StringVar(&f.agent, "agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	if err := fs.Parse(args); err != nil {
		return f, flagsPrinted{err} // the flag package printed it, and the usage
	}
	if fs.NArg() > 0 {
		return f, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	var err error
	if f.steps, err = bench.ParseDensitySteps(*steps); err != nil {
		return f, fmt.Errorf("--steps: %w", err)
	}
	switch {
	case f.mem < 1:
		return f, fmt.Errorf("--mem %d: want a positive size in MiB", f.mem)
	case f.cpus < 1:
		return f, fmt.Errorf("--cpus %d: want at least 1", f.cpus)
	case f.children < 1 || f.children > 4096:
		return f, fmt.Errorf("--children %d: want 1 to 4096", f.children)
	case f.cap < 0:
		return f, fmt.Errorf("--cap %d: want 0 (none) or more", f.cap)
	case !(f.budgetGiB > 0) || math.IsInf(f.budgetGiB, 0) || f.budgetGiB > 1<<20:
		return f, fmt.Errorf("--budget-gib %v: want a positive size in GiB", f.budgetGiB)
	case f.floorMiB < 1:
		return f, fmt.Errorf("--floor-mib %d: want at least 1", f.floorMiB)
	case f.settle < 0:
		return f, fmt.Errorf("--settle %v: want 0 or more", f.settle)
	case f.parallel < 0:
		return f, fmt.Errorf("--parallel %d: want 0 (all at once) or more", f.parallel)
	case f.bootTimeout <= 0:
		return f, fmt.Errorf("--boot-timeout %v: want a positive duration", f.bootTimeout)
	case f.method != bench.DensityTemplate && f.method != bench.DensityFork:
		return f, fmt.Errorf("--method %q: want %s or %s", f.method, bench.DensityTemplate, bench.DensityFork)
	}
	return f, nil
}

// spec is the bench.DensitySpec the flags ask for, less the runtime and
// the VMM process.
func (f densityFlags) spec() bench.DensitySpec {
	settle := f.settle
	if settle == 0 {
		settle = -1 // DensitySpec: no wait
	}
	return bench.DensitySpec{
		MemoryMiB: f.mem, CPUs: f.cpus, Children: f.children, Cap: f.cap, Steps: f.steps,
		MemoryBudget: uint64(f.budgetGiB * (1 << 30)), Floor: uint64(f.floorMiB) << 20,
		Settle: settle, Method: f.method, BootTimeout: f.bootTimeout, Parallel: f.parallel,
	}
}

// cmdBenchDensity is `kiln bench density`: idle sandboxes from one
// template, each in a VMM process of its own, until a count, a cap or the
// host's memory is reached; per-sandbox PSS split into guest RAM and VMM
// process, and how many fit in a budget.
func cmdBenchDensity(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	f, err := parseDensityFlags(args, stderr)
	if err != nil {
		if _, printed := err.(flagsPrinted); !printed {
			fmt.Fprintf(stderr, "kiln bench density: %v\n%s\n", err, densityUsage)
		}
		return exitUsage
	}
	rt, err := sandbox.FindRuntime(f.kernel, f.agent)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench density: %v\n", err)
		return exitUsage
	}
	po, err := findVMMProcess("")
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench density: %v\n", err)
		return exitInternal
	}
	if !f.holdProcs {
		po.Env = append(po.Env, vmmproc.HoldProcsEnv+"=false")
	}
	spec := f.spec()
	spec.Runtime, spec.Process = rt, *po
	fmt.Fprintf(stdout, "VMM processes' vCPUs hold their Ps in the guest: %v\n", f.holdProcs)
	rep, err := bench.RunDensity(ctx, spec, stdout)
	fmt.Fprintln(stdout)
	rep.Print(stdout)
	code := exitOK
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench density: %v\n", err)
		code = exitInternal
	}
	if f.jsonOut != "" && len(rep.Steps) > 0 {
		r := newResults(f.kvmMode)
		addDensityResults(r, rep, f.budgetGiB)
		if werr := r.WriteFile(f.jsonOut); werr != nil {
			fmt.Fprintf(stderr, "kiln bench density: %v\n", werr)
			return exitInternal
		}
		fmt.Fprintf(stdout, "results: %s (KVM %s)\n", f.jsonOut, r.KVMMode)
	}
	return code
}

// addDensityResults appends the report's measures to r: per step, each
// sandbox's guest, VMM and total PSS and guest RSS, the host memory
// used and each sandbox's CPU time per second while idle; then the fit in
// the budget, measured and extrapolated.
func addDensityResults(r *results.Run, rep bench.DensityReport, budgetGiB float64) {
	base := func(extra ...string) map[string]string {
		p := map[string]string{
			"memory_mib": strconv.Itoa(rep.Spec.MemoryMiB),
			"cpus":       strconv.Itoa(rep.Spec.CPUs),
			"create":     rep.Spec.Method,
			"settle":     rep.Spec.Settle.String(),
		}
		for i := 0; i+1 < len(extra); i += 2 {
			p[extra[i]] = extra[i+1]
		}
		return p
	}
	bytes := func(name string, params map[string]string, xs []uint64) {
		s := make([]float64, len(xs))
		for i, x := range xs {
			s[i] = float64(x)
		}
		r.Measures = append(r.Measures, results.Measure{Name: name, VMM: results.VMMKiln, Unit: results.UnitBytes, Params: params, Samples: s})
	}
	for _, st := range rep.Steps {
		var guest, vmm, total, rss []uint64
		for _, m := range st.Sandboxes {
			guest = append(guest, m.Guest.Pss)
			vmm = append(vmm, m.VMMPSS())
			total = append(total, m.TotalPSS())
			rss = append(rss, m.Guest.Rss)
		}
		n := strconv.Itoa(st.Count)
		bytes("density-guest-pss", base("children", n), guest)
		bytes("density-vmm-pss", base("children", n), vmm)
		bytes("density-total-pss", base("children", n), total)
		bytes("density-guest-rss", base("children", n), rss)
		bytes("density-host-used", base("children", n, "what", "MemAvailable drop since before the template booted, template included"), []uint64{st.HostUsed})
		if len(st.IdleCPU) > 0 && st.Idle > 0 {
			idle := make([]float64, len(st.IdleCPU))
			for i, d := range st.IdleCPU {
				idle[i] = d.Seconds() / st.Idle.Seconds()
			}
			r.Measures = append(r.Measures, results.Measure{Name: "density-idle-cpu", VMM: results.VMMKiln, Unit: results.UnitSeconds,
				Params:  base("children", n, "what", "each sandbox's VMM process time on a CPU, its guest's included, per second idle", "window", st.Idle.Round(time.Millisecond).String()),
				Samples: idle})
		}
	}
	fit := rep.Fit()
	budget := strconv.FormatFloat(budgetGiB, 'g', -1, 64)
	r.Measures = append(r.Measures,
		results.Measure{Name: "density-fits", VMM: results.VMMKiln, Unit: results.UnitCount,
			Params:  base("budget_gib", budget, "method", "measured", "bound", fit.Bound, "children", strconv.Itoa(rep.Last().Count)),
			Samples: []float64{float64(fit.Measured)}},
		results.Measure{Name: "density-fits", VMM: results.VMMKiln, Unit: results.UnitCount,
			Params: base("budget_gib", budget, "method", "extrapolated", "children", strconv.Itoa(rep.Last().Count),
				"extrapolation", "budget / (mean guest PSS + mean VMM PSS per sandbox at the last step); not measured",
				"per_sandbox_bytes", strconv.FormatUint(fit.PerSandbox, 10)),
			Samples: []float64{float64(fit.Extrapolated)}},
	)
}
