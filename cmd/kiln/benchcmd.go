package main

import (
	"context"
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
	if len(args) == 0 || args[0] != "boot" {
		fmt.Fprintln(stderr, "usage: kiln bench boot [-n RUNS] [--kernel K] [--cpus N] [--mem MiB] [--json FILE]")
		fmt.Fprintln(stderr, "       kiln bench start [-n RUNS] [--kernel debian|minimal|PATH]... [--execs N] [--cpus N] [--mem MiB]")
		fmt.Fprintln(stderr, "       kiln bench snapshot [flags]   (kiln bench snapshot -h)")
		fmt.Fprintln(stderr, "       kiln bench process [--execs N] [--forks N] [--mem MiB]")
		fmt.Fprintln(stderr, "       kiln bench image [flags]      (kiln bench image -h)")
		fmt.Fprintln(stderr, "       kiln bench daemon [flags]     (kiln bench daemon -h)")
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
	if err := writeBusyboxInitrd(initrd, "echo "+bench.Marker+"\npoweroff -f\n"); err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	s := bench.BootSpec{Kernel: *kernel, Initrd: initrd, Cmdline: vmm.DefaultCmdline + " quiet", CPUs: *cpus, MemoryMiB: *mem}
	fmt.Fprintf(stdout, "boot to userspace marker: kernel %s, %d vCPU, %d MiB, %d runs each\n", *kernel, *cpus, *mem, *n)
	c, err := bench.CompareBoot(ctx, qpath, s, *n, stdout)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench: %v\n", err)
		return exitInternal
	}
	fmt.Fprintf(stdout, "median: kiln %v, qemu microvm %v, ratio kiln/qemu %.2f\n",
		bench.Median(c.Kiln).Round(time.Millisecond), bench.Median(c.Peer).Round(time.Millisecond), c.Ratio())
	if *jsonOut != "" {
		r := newResults(*kvmMode)
		params := map[string]string{"kernel": filepath.Base(*kernel), "cpus": fmt.Sprint(*cpus), "memory_mib": fmt.Sprint(*mem)}
		r.AddDurations("boot-to-userspace", results.VMMKiln, params, c.Kiln)
		r.AddDurations("boot-to-userspace", results.VMMQEMU, params, c.Peer)
		if err := r.WriteFile(*jsonOut); err != nil {
			fmt.Fprintf(stderr, "kiln bench: %v\n", err)
			return exitInternal
		}
		fmt.Fprintf(stdout, "results: %s (KVM %s)\n", *jsonOut, r.KVMMode)
	}
	return exitOK
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
		fmt.Fprintln(stderr, "usage: kiln bench start [-n RUNS] [--kernel debian|minimal|PATH]... [--execs N] [--cpus N] [--mem MiB]")
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
	type summary struct {
		name string
		c    bench.StartComparison
		err  error
	}
	var sums []summary
	for _, kernel := range kernels {
		s, err := bench.StartSpecFor(kernel, *agent)
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench start: %v\n", err)
			sums = append(sums, summary{name: kernel, err: err})
			continue
		}
		s.CPUs, s.MemoryMiB, s.Execs, s.BootTimeout = *cpus, *mem, *execs, *bootTimeout
		fmt.Fprintf(stdout, "\n== %s\nkernel  %s\ninitrd  %s\ncmdline %s\n", s.Name, s.Kernel, s.Initrd, s.KernelCmdline())
		c, err := bench.CompareStart(ctx, qpath, s, *n, stdout)
		sums = append(sums, summary{name: s.Name, c: c, err: err})
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
	return code
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
// one in a VMM process of its own (kiln vmm), restored from one snapshot:
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
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	rt, err := sandbox.FindRuntime(*kernel, *agent)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench process: %v\n", err)
		return exitUsage
	}
	po, err := vmmProcess("")
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
			jailed, err := vmmProcess(*jailIDs)
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
	return exitOK
}
