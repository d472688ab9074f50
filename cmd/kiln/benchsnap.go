package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
)

// intList is a flag of comma-separated positive integers.
type intList []int

func (l *intList) String() string {
	if l == nil {
		return ""
	}
	s := make([]string, len(*l))
	for i, n := range *l {
		s[i] = strconv.Itoa(n)
	}
	return strings.Join(s, ",")
}

func (l *intList) Set(v string) error {
	var out intList
	for _, f := range strings.Split(v, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return fmt.Errorf("%q: want comma-separated positive integers", v)
		}
		out = append(out, n)
	}
	*l = out
	return nil
}

// cmdBenchSnapshot runs `kiln bench snapshot`: save time against memory
// size, restore to the first exec beside a cold boot to it, fork of N
// children to all their first execs, and the guest memory (PSS) of a forked
// child beside a standalone VM's.
func cmdBenchSnapshot(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln bench snapshot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kiln bench snapshot [-n RESTORES] [--boots N] [--mem MiB,...] [--base MiB] [--forks N,...] [--pss-fork N] [--cpus N] [--qemu BIN] [--json FILE] [--kvm-mode M]")
		fs.PrintDefaults()
	}
	n := fs.Int("n", bench.DefaultRestores, "restores timed")
	boots := fs.Int("boots", 1, "cold boots timed at --base MiB, for the ratio (the measured sandbox's included)")
	mem := intList(bench.DefaultSaveSizesMiB)
	fs.Var(&mem, "mem", "memory sizes in `MiB` whose save is timed (one cold boot each)")
	base := fs.Int("base", bench.DefaultSnapshotMemoryMiB, "memory in MiB of the sandbox restored, forked and measured")
	forks := intList(bench.DefaultForks)
	fs.Var(&forks, "forks", "fork sizes `N,...` timed, in order, from one running sandbox")
	pssFork := fs.Int("pss-fork", bench.DefaultPSSFork, "the fork whose children's memory is read")
	cpus := fs.Int("cpus", 1, "vCPUs")
	kernel := fs.String("kernel", "", "kernel image; default: the cached Debian kernel")
	agent := fs.String("agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	dir := fs.String("dir", "", "where the snapshots go (kept); default: a temporary directory, removed")
	bootTimeout := fs.Duration("boot-timeout", 5*time.Minute, "how long to wait for each cold-booted guest's agent")
	timeout := fs.Duration("timeout", 0, "stop after this long (0: no limit)")
	qemu := fs.String("qemu", "qemu-system-x86_64", "the peer VMM binary for save and restore (migrate to a file, -incoming); empty: no peer")
	debug := fs.Bool("debug", false, "log VMM events to stderr")
	jsonOut := fs.String("json", "", "write every sample to this results `FILE` (kiln bench report reads it)")
	kvmMode := fs.String("kvm-mode", "", "the KVM mode to record (direct, nested, emulated); default: told from /proc/cpuinfo")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if err := checkKVMMode(*kvmMode); err != nil {
		fmt.Fprintf(stderr, "kiln bench snapshot: %v\n", err)
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kiln bench snapshot: unexpected arguments %q\n", fs.Args())
		return exitUsage
	}
	if *n < 1 || *boots < 1 || *base < 1 || *cpus < 1 || *pssFork < 1 || *bootTimeout <= 0 || *timeout < 0 {
		fmt.Fprintln(stderr, "kiln bench snapshot: -n, --boots, --base, --cpus, --pss-fork and --boot-timeout must be positive")
		return exitUsage
	}
	qpath := ""
	if *qemu != "" {
		p, err := exec.LookPath(*qemu)
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench snapshot: peer VMM: %v (make deps installs qemu-system-x86)\n", err)
			return exitUsage
		}
		qpath = p
	}
	spec, err := bench.SnapshotSpec{
		Kernel: *kernel, Agent: *agent, CPUs: *cpus, SaveSizesMiB: mem, MemoryMiB: *base,
		ColdBoots: *boots, Restores: *n, Forks: forks, PSSFork: *pssFork, Dir: *dir, BootTimeout: *bootTimeout, QEMU: qpath,
		Logger: newLogger(stderr, *debug),
	}.Normalize()
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench snapshot: %v\n", err)
		return exitUsage
	}
	if *timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, *timeout)
		defer cancel()
	}
	fmt.Fprintf(stdout, "snapshot benchmarks: %d vCPU; save at %s MiB; %d cold boots, %d restores and forks of %s from a %d MiB sandbox; PSS after the fork of %d\n",
		*cpus, mem.String(), *boots, *n, forks.String(), *base, *pssFork)
	fmt.Fprintf(stdout, "peer: %s; load average %s\n", orNone(qpath), bench.LoadAverage())
	start := time.Now()
	rep, err := bench.RunSnapshot(ctx, spec, stdout)
	fmt.Fprintf(stdout, "\nload average %s; took %v\n", bench.LoadAverage(), time.Since(start).Round(time.Second))
	printSnapshotReport(stdout, rep)
	if *jsonOut != "" {
		r := snapshotResults(*kvmMode, rep)
		if len(r.Measures) == 0 {
			fmt.Fprintln(stderr, "kiln bench snapshot: nothing measured: no results file written")
			return exitInternal
		}
		if werr := r.WriteFile(*jsonOut); werr != nil {
			fmt.Fprintf(stderr, "kiln bench snapshot: %v\n", werr)
			return exitInternal
		}
		fmt.Fprintf(stdout, "results: %s (KVM %s)\n", *jsonOut, r.KVMMode)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench snapshot: %v\n", err)
		return exitInternal
	}
	for _, f := range rep.Forks {
		if f.Err != "" {
			return exitInternal
		}
	}
	return exitOK
}

// printSnapshotReport prints the summary of what was measured.
func printSnapshotReport(w io.Writer, rep bench.SnapshotReport) {
	ms := func(d time.Duration) string { return d.Round(time.Millisecond).String() }
	fmt.Fprintln(w, "summary:")
	if len(rep.Saves) > 0 {
		fmt.Fprintln(w, "memory  cold boot to exec  save       memory file allocated / logical  guest RSS")
		for _, s := range rep.Saves {
			fmt.Fprintf(w, "%4d MiB  %-17s  %-9s  %7.1f / %.0f MiB %16.1f MiB\n", s.MemoryMiB, ms(s.ColdStart), ms(s.Save),
				bench.MiB(uint64(s.FileAllocated)), bench.MiB(uint64(s.FileSize)), bench.MiB(s.Guest.Rss))
		}
	}
	if len(rep.Restores) > 0 {
		ds := make([]string, len(rep.Restores))
		for i, r := range rep.Restores {
			ds[i] = ms(r.Exec)
		}
		fmt.Fprintf(w, "restore to first exec (%d MiB): median %s of [%s]; restored guest RSS %.1f MiB\n",
			rep.Spec.MemoryMiB, ms(rep.RestoreMedian()), strings.Join(ds, " "), bench.MiB(rep.Restores[0].Guest.Rss))
		cs := make([]string, len(rep.ColdStarts))
		for i, d := range rep.ColdStarts {
			cs[i] = ms(d)
		}
		fmt.Fprintf(w, "cold boot to first exec (%d MiB): median %s of [%s]\n", rep.Spec.MemoryMiB, ms(rep.ColdStart()), strings.Join(cs, " "))
		fmt.Fprintf(w, "ratio restore-to-exec / cold-boot-to-exec: %.3f\n", rep.RestoreRatio())
	}
	if len(rep.CachedRestores) > 0 {
		ds := make([]string, len(rep.CachedRestores))
		for i, r := range rep.CachedRestores {
			ds[i] = ms(r.Exec)
		}
		fmt.Fprintf(w, "cached restore to first exec (%d MiB, the memory copy checked once and kept): median %s of [%s]\n",
			rep.Spec.MemoryMiB, ms(rep.CachedRestoreMedian()), strings.Join(ds, " "))
	}
	if p := rep.Peer; p != nil {
		if len(p.Restores) > 0 {
			ds := make([]string, len(p.Restores))
			for i, d := range p.Restores {
				ds[i] = ms(d)
			}
			fmt.Fprintf(w, "qemu microvm (%d MiB): cold boot to first exec %s; save (migrate to a file) %s, file %.1f MiB; restore (-incoming) to first exec: median %s of [%s]; ratio %.3f\n",
				rep.Spec.MemoryMiB, ms(p.ColdStart), ms(p.Save), bench.MiB(uint64(p.FileAllocated)),
				ms(bench.Median(p.Restores)), strings.Join(ds, " "), p.RestoreRatio())
			fmt.Fprintf(w, "qemu microvm restore: guest running (migration stream loaded) after a median %s\n", ms(bench.Median(p.Running)))
			fmt.Fprintf(w, "restore to first exec, kiln / qemu microvm: %.3f\n",
				safeRatio(float64(rep.RestoreMedian()), float64(bench.Median(p.Restores))))
		}
		if p.Err != "" {
			fmt.Fprintf(w, "qemu microvm: failed: %s\n", p.Err)
		}
	}
	for _, f := range rep.Forks {
		if f.Err != "" {
			fmt.Fprintf(w, "fork of %d: failed: %s\n", f.N, f.Err)
			continue
		}
		fmt.Fprintf(w, "fork of %d: children answering after %s, all first execs after %s (parent memory copied first: %v)\n",
			f.N, ms(f.Fork), ms(f.AllExec), f.Copied)
	}
	if p := rep.PSS; p != nil {
		fmt.Fprintf(w, "guest memory after the fork of %d, each child having answered one exec:\n", p.N)
		fmt.Fprintf(w, "  standalone booted VM (before the fork): PSS %.1f MiB, RSS %.1f MiB\n", bench.MiB(p.Standalone.Pss), bench.MiB(p.Standalone.Rss))
		fmt.Fprintf(w, "  per child: PSS %.1f MiB (%.2f of the standalone VM's), own copies %.1f MiB\n",
			bench.MiB(p.ChildPSS()), safeRatio(float64(p.ChildPSS()), float64(p.Standalone.Pss)), bench.MiB(p.ChildAnonymous()))
		fmt.Fprintf(w, "  parent after the fork: %v\n", p.Parent)
		fmt.Fprintf(w, "  frozen base file %.1f MiB; all guest memory (base once + every VM's copies) %.1f MiB = %.1f MiB per VM over %d VMs (%.2f of a standalone VM's RSS)\n",
			bench.MiB(uint64(p.BaseAllocated)), bench.MiB(p.GuestTotal()), bench.MiB(p.GuestPerVM()), p.N+1,
			safeRatio(float64(p.GuestPerVM()), float64(p.Standalone.Rss)))
		fmt.Fprintf(w, "  whole process (smaps_rollup): PSS %.1f -> %.1f MiB, RSS %.1f -> %.1f MiB (base pages no VM touched since the fork are in no PSS)\n",
			bench.MiB(p.ProcessBefore.Pss), bench.MiB(p.ProcessAfter.Pss), bench.MiB(p.ProcessBefore.Rss), bench.MiB(p.ProcessAfter.Rss))
	}
}

// snapshotResults is the results file of kiln bench snapshot, each measure
// with params cpus and memory_mib (the sandbox's size):
//   - "save" per memory size, Kiln's and (at --base) QEMU microvm's
//     migration to a file;
//   - "restore-to-exec" and "cold-boot-to-exec" at --base, Kiln's and
//     QEMU microvm's;
//   - "fork-ready" (children answering) and "fork-exec" (all first execs)
//     per fork size, param n;
//   - "fork-guest-pss" (each child's guest memory PSS, bytes) and
//     "standalone-guest-pss" (the VM's before the fork) for --pss-fork.
func snapshotResults(kvmMode string, rep bench.SnapshotReport) *results.Run {
	r := newResults(kvmMode)
	params := func(mem int, kv ...string) map[string]string {
		p := map[string]string{"cpus": fmt.Sprint(rep.Spec.CPUs), "memory_mib": fmt.Sprint(mem)}
		for i := 0; i+1 < len(kv); i += 2 {
			p[kv[i]] = kv[i+1]
		}
		return p
	}
	base := rep.Spec.MemoryMiB
	// Saves: one sample per size (several where a size repeats).
	var sizes []int
	saves := map[int][]time.Duration{}
	for _, s := range rep.Saves {
		if s.Save <= 0 {
			continue
		}
		if _, ok := saves[s.MemoryMiB]; !ok {
			sizes = append(sizes, s.MemoryMiB)
		}
		saves[s.MemoryMiB] = append(saves[s.MemoryMiB], s.Save)
	}
	for _, mem := range sizes {
		r.AddDurations("save", results.VMMKiln, params(mem), saves[mem])
	}
	p := rep.Peer
	if p != nil && p.Save > 0 {
		r.AddDurations("save", results.VMMQEMU, params(base), []time.Duration{p.Save})
	}
	var restores []time.Duration
	for _, x := range rep.Restores {
		restores = append(restores, x.Exec)
	}
	if len(restores) > 0 {
		r.AddDurations("restore-to-exec", results.VMMKiln, params(base), restores)
	}
	if p != nil && len(p.Restores) > 0 {
		r.AddDurations("restore-to-exec", results.VMMQEMU, params(base), p.Restores)
	}
	if len(rep.CachedRestores) > 0 {
		r.AddDurations("restore-cached-to-exec", results.VMMKiln, params(base), bench.Execs(rep.CachedRestores))
	}
	if len(rep.ColdStarts) > 0 {
		r.AddDurations("cold-boot-to-exec", results.VMMKiln, params(base), rep.ColdStarts)
	}
	if p != nil && p.ColdStart > 0 {
		r.AddDurations("cold-boot-to-exec", results.VMMQEMU, params(base), []time.Duration{p.ColdStart})
	}
	var ns []int
	ready, exec := map[int][]time.Duration{}, map[int][]time.Duration{}
	for _, f := range rep.Forks {
		if f.Err != "" {
			continue
		}
		if _, ok := ready[f.N]; !ok {
			ns = append(ns, f.N)
		}
		ready[f.N] = append(ready[f.N], f.Fork)
		exec[f.N] = append(exec[f.N], f.AllExec)
	}
	for _, n := range ns {
		r.AddDurations("fork-ready", results.VMMKiln, params(base, "n", fmt.Sprint(n)), ready[n])
		r.AddDurations("fork-exec", results.VMMKiln, params(base, "n", fmt.Sprint(n)), exec[n])
	}
	if pss := rep.PSS; pss != nil && len(pss.Children) > 0 {
		var children []float64
		for _, c := range pss.Children {
			children = append(children, float64(c.Pss))
		}
		r.Measures = append(r.Measures,
			results.Measure{Name: "fork-guest-pss", VMM: results.VMMKiln, Unit: results.UnitBytes, Params: params(base, "n", fmt.Sprint(pss.N)), Samples: children},
			results.Measure{Name: "standalone-guest-pss", VMM: results.VMMKiln, Unit: results.UnitBytes, Params: params(base), Samples: []float64{float64(pss.Standalone.Pss)}})
	}
	return r
}

// orNone is s, or "none" when it is empty.
func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// safeRatio is a/b, or 0 when b is 0.
func safeRatio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}
