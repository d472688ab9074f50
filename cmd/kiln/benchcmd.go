package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmm"
)

// cmdBench runs `kiln bench boot` and `kiln bench start`: Kiln beside QEMU
// microvm, same guest.
func cmdBench(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 && args[0] == "snapshot" {
		return cmdBenchSnapshot(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "start" {
		return cmdBenchStart(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "process" {
		return cmdBenchProcess(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "image" {
		return cmdBenchImage(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "daemon" {
		return cmdBenchDaemon(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "report" {
		return cmdBenchReport(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "density" {
		return cmdBenchDensity(ctx, args[1:], stdout, stderr)
	}
	if len(args) > 0 && args[0] == "devices" {
		return cmdBenchDevices(ctx, args[1:], stdout, stderr)
	}
	if len(args) == 0 || args[0] != "boot" {
		fmt.Fprintln(stderr, "usage: kiln bench boot [-n RUNS] [--kernel K] [--cpus N] [--mem MiB] [--json FILE]")
		fmt.Fprintln(stderr, "       kiln bench start [-n RUNS] [--kernel debian|minimal|PATH]... [--execs N] [--cpus N] [--mem MiB] [--json FILE]")
		fmt.Fprintln(stderr, "       kiln bench snapshot [flags]   (kiln bench snapshot -h)")
		fmt.Fprintln(stderr, "       kiln bench process [--execs N] [--forks N] [--mem MiB] [--json FILE]")
		fmt.Fprintln(stderr, "       kiln bench image [flags]      (kiln bench image -h)")
		fmt.Fprintln(stderr, "       kiln bench daemon [flags]     (kiln bench daemon -h)")
		fmt.Fprintln(stderr, "       kiln bench devices [-n RUNS] [--blk-mib 64] [--json FILE]   (kiln bench devices -h)")
		fmt.Fprintln(stderr, "       kiln bench density [--mem 512] [--children 32] [--steps 1,8,16,32] [--budget-gib 8] [--json FILE]   (kiln bench density -h)")
		fmt.Fprintln(stderr, "       kiln bench report [-o DIR] RESULTS.json...")
		return exitUsage
	}
	fs := flag.NewFlagSet("kiln bench boot", flag.ContinueOnError)
	fs.SetOutput(stderr)
	n := fs.Int("n", 5, "boots on each VMM")
	kernel := fs.String("kernel", "", "kernel image; default: the cached Debian kernel")
	cpus := fs.Int("cpus", 1, "vCPUs")
	mem := fs.Int("mem", 256, "memory in MiB")
	qemu := fs.String("qemu", "qemu-system-x86_64", "the peer VMM binary")
	jsonOut := fs.String("json", "", "write every sample to this results `FILE` (kiln bench report reads it)")
	kvmMode := fs.String("kvm-mode", "", "the KVM mode to record (direct, nested, emulated); default: told from /proc/cpuinfo")
	hold := fs.Bool("hold-procs", true, holdProcsUsage)
	if err := fs.Parse(args[1:]); err != nil {
		return exitUsage
	}
	if *kernel == "" {
		k, err := defaultKernel()
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench: %v\n", err)
			return exitUsage
		}
		*kernel = k
	}
	qpath, err := exec.LookPath(*qemu)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench: peer VMM: %v (make deps installs qemu-system-x86)\n", err)
		return exitUsage
	}
	dir, err := os.MkdirTemp("", "kiln-bench-")
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	defer os.RemoveAll(dir)
	initrd := filepath.Join(dir, "initrd.cpio")
	if err := writeBusyboxInitrd(initrd, bench.BootScript); err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	// Both VMMs read the kernel from the same local copy (the bench's
	// temporary folder), in the page cache before the first boot: where
	// the cached kernel lies on a network or 9p file system (as in the
	// test harness's L1) its reads would otherwise time that file system.
	localKernel := filepath.Join(dir, filepath.Base(*kernel))
	if err := copyFile(*kernel, localKernel); err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	s := bench.BootSpec{Kernel: localKernel, Initrd: initrd, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: *cpus, MemoryMiB: *mem, HoldProcs: *hold}
	fmt.Fprintf(stdout, "boot to userspace marker: kernel %s (copied to %s), %d vCPU, %d MiB, %d runs each; %s\n", *kernel, dir, *cpus, *mem, *n, holdProcs(*hold, *cpus))
	c, err := bench.CompareBoot(ctx, qpath, s, *n, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	fmt.Fprintf(stdout, "median: kiln %v, qemu microvm %v, ratio kiln/qemu %.2f\n",
		bench.Median(c.Kiln).Round(time.Millisecond), bench.Median(c.Peer).Round(time.Millisecond), c.Ratio())
	printBootPhases(stdout, c)
	if *jsonOut != "" {
		r := newResults(*kvmMode)
		params := map[string]string{"kernel": filepath.Base(*kernel), "cpus": fmt.Sprint(*cpus), "memory_mib": fmt.Sprint(*mem)}
		r.AddDurations("boot-to-userspace", results.VMMKiln, params, c.Kiln)
		r.AddDurations("boot-to-userspace", results.VMMQEMU, params, c.Peer)
		addBootPhases(r, params, c)
		if err := r.WriteFile(*jsonOut); err != nil {
			fmt.Fprintf(stderr, "kiln bench: %v\n", err)
			return exitInternal
		}
		fmt.Fprintf(stdout, "results: %s (KVM %s)\n", *jsonOut, r.KVMMode)
	}
	return exitOK
}

// copyFile copies the regular file src to dst, leaving a hole wherever a
// whole 4 KiB page of src is zeros (as xz, which extracts a vmlinux, does):
// the copy keeps a kernel's .bss a hole even from a file system that
// reports none (9p), and a loader that skips holes sees them.
func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.Create(dst)
	if err != nil {
		return err
	}
	const page = 4096
	buf := make([]byte, 256*page)
	zero := make([]byte, page)
	var off int64
	for {
		n, rerr := io.ReadFull(in, buf)
		for i := 0; i < n; i += page {
			b := buf[i:min(i+page, n)]
			if bytes.Equal(b, zero[:len(b)]) {
				continue
			}
			if _, err := out.WriteAt(b, off+int64(i)); err != nil {
				out.Close()
				return fmt.Errorf("copy %s to %s: %w", src, dst, err)
			}
		}
		off += int64(n)
		if rerr == io.EOF || rerr == io.ErrUnexpectedEOF {
			break
		}
		if rerr != nil {
			out.Close()
			return fmt.Errorf("copy %s to %s: %w", src, dst, rerr)
		}
	}
	if err := out.Truncate(off); err != nil {
		out.Close()
		return fmt.Errorf("copy %s to %s: %w", src, dst, err)
	}
	return out.Close()
}

// printBootPhases prints the medians of where each VMM's boots spent their
// time.
func printBootPhases(w io.Writer, c bench.BootComparison) {
	ks, kk, kb := bench.PhaseMedians(c.KilnPhases)
	_, qk, qb := bench.PhaseMedians(c.PeerPhases)
	ms := func(d time.Duration) string {
		if d == 0 {
			return "-"
		}
		return d.Round(time.Millisecond).String()
	}
	fmt.Fprintln(w, "phases (medians)          kiln        qemu microvm")
	fmt.Fprintf(w, "  VMM setup (vmm.New)     %-11s (inside its process)\n", ms(ks))
	fmt.Fprintf(w, "  before the kernel clock %-11s %s   (setup, firmware, kernel entry, earliest kernel setup)\n", ms(kb), ms(qb))
	fmt.Fprintf(w, "  kernel clock to /init   %-11s %s   (the guest kernel's own log time)\n", ms(kk), ms(qk))
	fmt.Fprint(w, "kiln's VMM setup by phase (medians):")
	for i, ph := range bench.SetupPhases(vmm.SetupTimes{}) {
		var ds []time.Duration
		for _, p := range c.KilnPhases {
			ds = append(ds, bench.SetupPhases(p.VMM)[i].D)
		}
		fmt.Fprintf(w, " %s %v", ph.Name, bench.Median(ds).Round(100*time.Microsecond))
	}
	fmt.Fprintln(w)
}

// addBootPhases adds the boots' phases to a results file: the guest
// kernel's time to /init and the time before its clock, on both VMMs, and
// Kiln's VMM setup.
func addBootPhases(r *results.Run, params map[string]string, c bench.BootComparison) {
	for _, side := range []struct {
		vmm string
		ps  []bench.BootPhases
	}{{results.VMMKiln, c.KilnPhases}, {results.VMMQEMU, c.PeerPhases}} {
		var kernel, before, setup []time.Duration
		for _, p := range side.ps {
			if b := p.BeforeKernel(); b > 0 {
				kernel, before = append(kernel, p.Kernel), append(before, b)
			}
			if p.Setup > 0 {
				setup = append(setup, p.Setup)
			}
		}
		if len(kernel) > 0 {
			r.AddDurations("boot-kernel-to-init", side.vmm, params, kernel)
			r.AddDurations("boot-before-kernel-clock", side.vmm, params, before)
		}
		if len(setup) > 0 {
			r.AddDurations("boot-vmm-setup", side.vmm, params, setup)
		}
	}
	for i, ph := range bench.SetupPhases(vmm.SetupTimes{}) {
		var ds []time.Duration
		for _, p := range c.KilnPhases {
			if p.Setup > 0 {
				ds = append(ds, bench.SetupPhases(p.VMM)[i].D)
			}
		}
		if len(ds) > 0 {
			r.AddDurations("boot-vmm-setup-phase", results.VMMKiln, withParam(params, "phase", ph.Name), ds)
		}
	}
}

// withParam returns a copy of params with k set to v.
func withParam(params map[string]string, k, v string) map[string]string {
	out := make(map[string]string, len(params)+1)
	for pk, pv := range params {
		out[pk] = pv
	}
	out[k] = v
	return out
}

// writeBusyboxInitrd writes an initramfs whose /init runs script under busybox sh.
func writeBusyboxInitrd(path, script string) error {
	b, err := initramfs.BusyboxInit(script)
	if err != nil {
		return err
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := b.WriteTo(f); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}

// cmdBenchStart runs `kiln bench start`: sandbox cold start (VM creation to
// the first exec's result) and exec round trips, Kiln beside QEMU microvm
// with vhost-vsock, on each kernel.
func cmdBenchStart(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln bench start", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kiln bench start [-n RUNS] [--kernel debian|minimal|PATH]... [--execs N] [--cpus N] [--mem MiB] [--json FILE] [--kvm-mode M]")
		fs.PrintDefaults()
	}
	n := fs.Int("n", 5, "boots on each VMM, per kernel")
	var kernels repeated
	fs.Var(&kernels, "kernel", "kernel `NAME`: debian (the cached Debian kernel, modules in the initramfs), minimal (make guest-kernel) or a kernel image with everything built in; repeatable; default: debian, and minimal when built")
	agent := fs.String("agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	execs := fs.Int("execs", bench.DefaultStartExecs, "execs of true timed on each VM after the first")
	cpus := fs.Int("cpus", 1, "vCPUs")
	mem := fs.Int("mem", 512, "memory in MiB")
	bootTimeout := fs.Duration("boot-timeout", bench.DefaultStartBootTimeout, "how long to wait for each guest's agent")
	qemu := fs.String("qemu", "qemu-system-x86_64", "the peer VMM binary")
	jsonOut := fs.String("json", "", "write every sample to this results `FILE` (kiln bench report reads it)")
	kvmMode := fs.String("kvm-mode", "", "the KVM mode to record (direct, nested, emulated); default: told from /proc/cpuinfo")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kiln bench start: unexpected arguments %q\n", fs.Args())
		return exitUsage
	}
	if *n < 1 || *execs < 1 || *cpus < 1 || *mem < 1 || *bootTimeout <= 0 {
		fmt.Fprintln(stderr, "kiln bench start: -n, --execs, --cpus, --mem and --boot-timeout must be positive")
		return exitUsage
	}
	if err := checkKVMMode(*kvmMode); err != nil {
		fmt.Fprintf(stderr, "kiln bench start: %v\n", err)
		return exitUsage
	}
	qpath, err := exec.LookPath(*qemu)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench start: peer VMM: %v (make deps installs qemu-system-x86)\n", err)
		return exitUsage
	}
	if err := bench.EnsureVhostVsock(); err != nil {
		fmt.Fprintf(stderr, "kiln bench start: %v\n", err)
		return exitUsage
	}
	if *agent == "" {
		if *agent, err = sandbox.FindAgent(); err != nil {
			fmt.Fprintf(stderr, "kiln bench start: %v\n", err)
			return exitUsage
		}
	}
	if len(kernels) == 0 {
		kernels = repeated{bench.KernelDebian}
		if _, _, err := bench.MinimalKernel(); err == nil {
			kernels = append(kernels, bench.KernelMinimal)
		} else {
			fmt.Fprintf(stdout, "minimal kernel skipped: %v\n", err)
		}
	}
	fmt.Fprintf(stdout, "cold start (VM creation to the first exec's result) and exec round trips of true: %d vCPU, %d MiB, %d runs each, %d execs per boot\n",
		*cpus, *mem, *n, *execs)
	fmt.Fprintf(stdout, "agent %s; qemu %s; load average %s\n", *agent, qpath, loadAverage())
	var sums []startSummary
	for _, kernel := range kernels {
		s, err := bench.StartSpecFor(kernel, *agent)
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench start: %v\n", err)
			sums = append(sums, startSummary{name: kernel, err: err})
			continue
		}
		s.CPUs, s.MemoryMiB, s.Execs, s.BootTimeout = *cpus, *mem, *execs, *bootTimeout
		fmt.Fprintf(stdout, "\n== %s\nkernel  %s\ninitrd  %s\ncmdline %s\n", s.Name, s.Kernel, s.Initrd, s.KernelCmdline())
		c, err := bench.CompareStart(ctx, qpath, s, *n, stdout)
		sums = append(sums, startSummary{name: s.Name, c: c, err: err})
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench start: %s: %v\n", s.Name, err)
			continue
		}
		printStartSummary(stdout, c)
		fmt.Fprintf(stdout, "guest /proc/cmdline: kiln %q, qemu %q\n", c.Kiln[0].GuestCmdline, c.QEMU[0].GuestCmdline)
	}
	fmt.Fprintf(stdout, "\nload average %s\nsummary:\n", loadAverage())
	code := exitOK
	for _, sum := range sums {
		if sum.err != nil {
			fmt.Fprintf(stdout, "%s: failed: %v\n", sum.name, sum.err)
			code = exitInternal
			continue
		}
		cold, rtt := sum.c.ColdStart(), sum.c.RTT()
		fmt.Fprintf(stdout, "%s: cold start kiln %v, qemu %v, kiln/qemu %.2f; exec round trip kiln %v, qemu %v, kiln/qemu %.2f\n",
			sum.name, bench.Median(cold.Kiln).Round(time.Millisecond), bench.Median(cold.Peer).Round(time.Millisecond), cold.Ratio(),
			roundRTT(bench.Median(rtt.Kiln)), roundRTT(bench.Median(rtt.Peer)), rtt.Ratio())
	}
	if *jsonOut != "" {
		r := startResults(*kvmMode, *cpus, *mem, sums)
		if len(r.Measures) == 0 {
			fmt.Fprintln(stderr, "kiln bench start: nothing measured: no results file written")
			return exitInternal
		}
		if err := r.WriteFile(*jsonOut); err != nil {
			fmt.Fprintf(stderr, "kiln bench start: %v\n", err)
			return exitInternal
		}
		fmt.Fprintf(stdout, "results: %s (KVM %s)\n", *jsonOut, r.KVMMode)
	}
	return code
}

// startSummary is one kernel's outcome in kiln bench start.
type startSummary struct {
	name string
	c    bench.StartComparison
	err  error
}

// startResults is the results file of kiln bench start: per kernel that
// ran, "cold-start" (one sample per boot) and "exec-rtt" (every exec), on
// Kiln and QEMU microvm.
func startResults(kvmMode string, cpus, mem int, sums []startSummary) *results.Run {
	r := newResults(kvmMode)
	for _, sum := range sums {
		if sum.err != nil {
			continue
		}
		params := map[string]string{"kernel": sum.name, "cpus": fmt.Sprint(cpus), "memory_mib": fmt.Sprint(mem)}
		cold, rtt := sum.c.ColdStart(), sum.c.RTT()
		for _, m := range []struct {
			name string
			c    bench.Comparison
		}{{"cold-start", cold}, {"exec-rtt", rtt}} {
			if len(m.c.Kiln) > 0 {
				r.AddDurations(m.name, results.VMMKiln, params, m.c.Kiln)
			}
			if len(m.c.Peer) > 0 {
				r.AddDurations(m.name, results.VMMQEMU, params, m.c.Peer)
			}
		}
	}
	return r
}

// printStartSummary prints one kernel's medians and ratios.
func printStartSummary(w io.Writer, c bench.StartComparison) {
	cold, rtt := c.ColdStart(), c.RTT()
	ready := bench.Comparison{}
	for _, r := range c.Kiln {
		ready.Kiln = append(ready.Kiln, r.Ready)
	}
	for _, r := range c.QEMU {
		ready.Peer = append(ready.Peer, r.Ready)
	}
	fmt.Fprintf(w, "median cold start: kiln %v, qemu microvm %v, ratio kiln/qemu %.2f (agent ready: kiln %v, qemu %v)\n",
		bench.Median(cold.Kiln).Round(time.Millisecond), bench.Median(cold.Peer).Round(time.Millisecond), cold.Ratio(),
		bench.Median(ready.Kiln).Round(time.Millisecond), bench.Median(ready.Peer).Round(time.Millisecond))
	fmt.Fprintf(w, "exec round trip (%d and %d execs): median kiln %v, qemu microvm %v, ratio kiln/qemu %.2f; p90 kiln %v, qemu %v\n",
		len(rtt.Kiln), len(rtt.Peer), roundRTT(bench.Median(rtt.Kiln)), roundRTT(bench.Median(rtt.Peer)), rtt.Ratio(),
		roundRTT(bench.Percentile(rtt.Kiln, 90)), roundRTT(bench.Percentile(rtt.Peer, 90)))
}

// roundRTT rounds a round trip for printing.
func roundRTT(d time.Duration) time.Duration { return d.Round(10 * time.Microsecond) }

// loadAverage returns the host's 1, 5 and 15 minute load averages, or "?".
func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// cmdBenchProcess is `kiln bench process`: a sandbox in this process and
// one in a VMM process of its own (kiln-vmm), restored from one snapshot:
// exec and fork latency and the VMM process's memory.
func cmdBenchProcess(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln bench process", flag.ContinueOnError)
	fs.SetOutput(stderr)
	execs := fs.Int("execs", 20, "execs of true each way")
	forks := fs.Int("forks", 3, "forks of one child each way")
	restores := fs.Int("restores", 10, "restores to an answering agent each way, alternating ways (for p50/p95)")
	confinement := fs.Bool("confinement", true, "also run a VMM process without its seccomp filter (KILN_SECCOMP=off), to show what the filter adds, and, as root, a jailed one (--jail-ids), to show what the jail adds")
	jailIDs := fs.String("jail-ids", jail.DefaultIDsDir, "with --confinement as root, `DIR` whose jail-ids folder holds the jails' uid locks")
	mem := fs.Int("mem", 256, "guest memory in MiB")
	kernel := fs.String("kernel", "", "kernel image; default: the cached Debian kernel")
	agent := fs.String("agent", "", "static kiln-agent binary; default: $KILN_AGENT, or kiln-agent beside kiln")
	jsonOut := fs.String("json", "", "write every sample to this results `FILE` (kiln bench report reads it)")
	kvmMode := fs.String("kvm-mode", "", "the KVM mode to record (direct, nested, emulated); default: told from /proc/cpuinfo")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(stderr, "kiln bench process: unexpected arguments %q\n", fs.Args())
		return exitUsage
	}
	if err := checkKVMMode(*kvmMode); err != nil {
		fmt.Fprintf(stderr, "kiln bench process: %v\n", err)
		return exitUsage
	}
	rt, err := sandbox.FindRuntime(*kernel, *agent)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench process: %v\n", err)
		return exitUsage
	}
	po, err := findVMMProcess("")
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench process: %v\n", err)
		return exitInternal
	}
	if *restores < 1 || *execs < 1 || *forks < 1 {
		fmt.Fprintln(stderr, "kiln bench process: --restores, --execs and --forks must be at least 1")
		return exitUsage
	}
	spec := bench.ProcessSpec{Runtime: rt, MemoryMiB: *mem, Process: *po, Restores: *restores, Execs: *execs, Forks: *forks}
	if *confinement {
		off := *po
		off.Env = append(slices.Clone(po.Env), "KILN_SECCOMP=off")
		spec.Variants = append(spec.Variants, bench.ProcessVariant{Name: "no seccomp", Process: off})
		if os.Geteuid() == 0 {
			jailed, err := findVMMProcess(*jailIDs)
			if err != nil {
				fmt.Fprintf(stderr, "kiln bench process: --jail-ids: %v\n", err)
				return exitUsage
			}
			spec.Variants = append(spec.Variants, bench.ProcessVariant{Name: "jailed", Process: *jailed})
		}
	}
	rep, err := bench.RunProcess(ctx, spec, stderr)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench process: %v\n", err)
		return exitInternal
	}
	rep.Print(stdout)
	if *jsonOut != "" {
		r, err := processResults(*kvmMode, *mem, rep)
		if err == nil {
			err = r.WriteFile(*jsonOut)
		}
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench process: %v\n", err)
			return exitInternal
		}
		fmt.Fprintf(stdout, "results: %s (KVM %s)\n", *jsonOut, r.KVMMode)
	}
	return exitOK
}

// processVMM is the results' VMM name of a kiln bench process way:
// "kiln-" and its name in lower case, words joined by "-"
// ("kiln-in-process", "kiln-vmm-process", "kiln-no-seccomp").
func processVMM(name string) string {
	return "kiln-" + strings.Join(strings.Fields(strings.ToLower(name)), "-")
}

// processResults is the results file of kiln bench process: per way,
// "process-restore", "process-exec" and "process-fork" in seconds and,
// where measured, "process-vmm-pss" and "process-guest-pss" in bytes.
func processResults(kvmMode string, mem int, rep bench.ProcessReport) (*results.Run, error) {
	r := newResults(kvmMode)
	params := map[string]string{"memory_mib": fmt.Sprint(mem)}
	for _, m := range rep.Modes {
		vmm := processVMM(m.Name)
		for _, x := range []struct {
			name string
			ds   []time.Duration
		}{{"process-restore", m.Restores}, {"process-exec", m.Execs}, {"process-fork", m.Forks}} {
			if len(x.ds) > 0 {
				r.AddDurations(x.name, vmm, params, x.ds)
			}
		}
		for _, x := range []struct {
			name string
			b    uint64
		}{{"process-vmm-pss", m.VMMPSS}, {"process-guest-pss", m.GuestPSS}} {
			if x.b > 0 {
				r.Measures = append(r.Measures, results.Measure{Name: x.name, VMM: vmm, Unit: results.UnitBytes, Params: params, Samples: []float64{float64(x.b)}})
			}
		}
	}
	if len(r.Measures) == 0 {
		return nil, errors.New("nothing measured: no results file written")
	}
	return r, nil
}
