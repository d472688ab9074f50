package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
	"github.com/kilnvm/kiln/guestkernel"
)

// benchDevicesUsage is kiln bench devices's synopsis.
const benchDevicesUsage = "usage: kiln bench devices [-n RUNS] [--blk-mib 64] [--vsock=true] [--cpus N] [--mem MiB] [--json FILE] [--kvm-mode M]"

// vsockEchoName is the guest echo program kiln bench devices looks for
// beside kiln (make build puts it there).
const vsockEchoName = "kiln-vsockecho"

// benchDevicesArgs is kiln bench devices's command line.
type benchDevicesArgs struct {
	n, blkMiB, cpus, mem int
	vsock, holdProcs     bool
	vsockEcho            string
	qemu                 string
	json                 string
	kvmMode              string
	timeout              time.Duration
}

// parseBenchDevices parses kiln bench devices's flags; kiln is this kiln
// binary (the echo program is looked for beside it).
func parseBenchDevices(args []string, kiln string, stderr io.Writer) (benchDevicesArgs, error) {
	var a benchDevicesArgs
	fs := flag.NewFlagSet("kiln bench devices", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, benchDevicesUsage)
		fs.PrintDefaults()
	}
	fs.IntVar(&a.n, "n", 5, "boots on each VMM per benchmark, alternating")
	fs.IntVar(&a.blkMiB, "blk-mib", bench.DefaultBlkMiB, "size in `MiB` of the disk the guest reads sequentially (0: no disk benchmark)")
	fs.BoolVar(&a.vsock, "vsock", true, "run the vsock echo and round trip benchmark")
	fs.StringVar(&a.vsockEcho, "vsockecho", "", "static build of internal/testguest/vsockecho; default: "+vsockEchoName+" beside kiln")
	fs.IntVar(&a.cpus, "cpus", 1, "vCPUs")
	fs.IntVar(&a.mem, "mem", 512, "memory in `MiB`")
	fs.StringVar(&a.qemu, "qemu", "qemu-system-x86_64", "the peer VMM binary")
	fs.StringVar(&a.json, "json", "", "write every sample to this results `FILE` (kiln bench report reads it)")
	fs.StringVar(&a.kvmMode, "kvm-mode", "", "the KVM mode to record (direct, nested, emulated); default: told from /proc/cpuinfo")
	fs.DurationVar(&a.timeout, "timeout", 0, "stop after this long (0: no limit)")
	fs.BoolVar(&a.holdProcs, "hold-procs", true, holdProcsUsage)
	if err := fs.Parse(args); err != nil {
		return a, err
	}
	if fs.NArg() > 0 {
		return a, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if a.n < 1 || a.cpus < 1 || a.mem < 1 {
		return a, fmt.Errorf("-n %d, --cpus %d, --mem %d: want them positive", a.n, a.cpus, a.mem)
	}
	if a.blkMiB < 0 || a.blkMiB > 1<<20 {
		return a, fmt.Errorf("--blk-mib %d: want 0 (none) to %d", a.blkMiB, 1<<20)
	}
	if a.blkMiB == 0 && !a.vsock {
		return a, errors.New("--blk-mib 0 and --vsock=false: nothing to measure")
	}
	if err := checkKVMMode(a.kvmMode); err != nil {
		return a, err
	}
	if a.timeout < 0 {
		return a, fmt.Errorf("--timeout %v is negative", a.timeout)
	}
	if a.vsock && a.vsockEcho == "" {
		a.vsockEcho = filepath.Join(filepath.Dir(kiln), vsockEchoName)
	}
	if !a.vsock {
		a.vsockEcho = ""
	}
	return a, nil
}

// checkKVMMode checks a --kvm-mode flag ("" is told from /proc/cpuinfo).
func checkKVMMode(m string) error {
	switch m {
	case "", results.KVMDirect, results.KVMNested, results.KVMEmulated:
		return nil
	}
	return fmt.Errorf("--kvm-mode %q: want %s, %s or %s", m, results.KVMDirect, results.KVMNested, results.KVMEmulated)
}

// cmdBenchDevices is `kiln bench devices`: a guest's sequential read of a
// virtio-blk disk, and vsock echo throughput and round trips, on Kiln and on
// QEMU microvm, alternating boot by boot.
func cmdBenchDevices(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench devices: %v\n", err)
		return exitInternal
	}
	a, err := parseBenchDevices(args, self, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench devices: %v\n", err)
		return exitUsage
	}
	qpath, err := exec.LookPath(a.qemu)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench devices: peer VMM: %v (make deps installs qemu-system-x86)\n", err)
		return exitUsage
	}
	k, err := guestkernel.Find()
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench devices: %v\n", err)
		return exitUsage
	}
	if a.vsockEcho != "" {
		if _, err := os.Stat(a.vsockEcho); err != nil {
			fmt.Fprintf(stderr, "kiln bench devices: the guest echo program: %v (make build puts %s beside kiln; or --vsockecho, or --vsock=false)\n", err, vsockEchoName)
			return exitUsage
		}
		if err := bench.EnsureVhostVsock(); err != nil {
			fmt.Fprintf(stderr, "kiln bench devices: %v\n", err)
			return exitUsage
		}
	}
	if a.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, a.timeout)
		defer cancel()
	}
	dir, err := os.MkdirTemp("", "kiln-bench-devices-")
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench devices: %v\n", err)
		return exitInternal
	}
	defer os.RemoveAll(dir)
	spec := bench.DevicesSpec{Kernel: k, VsockEcho: a.vsockEcho, QEMU: qpath, Runs: a.n, BlkMiB: a.blkMiB, CPUs: a.cpus, MemoryMiB: a.mem, Dir: dir, HoldProcs: a.holdProcs}
	fmt.Fprintf(stdout, "device benchmarks: kernel %s, %d vCPU, %d MiB, %d runs each, alternating; disk %d MiB; vsock %v\n",
		k.Version, a.cpus, a.mem, a.n, a.blkMiB, a.vsock)
	fmt.Fprintf(stdout, "qemu %s; load average %s; %s\n", qpath, loadAverage(), holdProcs(a.holdProcs, a.cpus))
	start := time.Now()
	c, runErr := bench.RunDevices(ctx, spec, stdout)
	fmt.Fprintf(stdout, "\nload average %s; took %v\n", loadAverage(), time.Since(start).Round(time.Second))
	printDevicesSummary(stdout, c)
	if a.json != "" {
		r, err := devicesResults(a.kvmMode, spec.Params(), c)
		if err == nil && len(r.Measures) > 0 {
			err = r.WriteFile(a.json)
		}
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench devices: %v\n", err)
			return exitInternal
		}
		if len(r.Measures) > 0 {
			fmt.Fprintf(stdout, "results: %s (KVM %s)\n", a.json, r.KVMMode)
		}
	}
	if runErr != nil {
		fmt.Fprintf(stderr, "kiln bench devices: %v\n", runErr)
		return exitInternal
	}
	return exitOK
}

// devicesResults is the results file of c.
func devicesResults(kvmMode string, params map[string]string, c bench.DevicesComparison) (*results.Run, error) {
	r := newResults(kvmMode)
	return r, c.Results(r, params)
}

// printDevicesSummary prints the medians and Kiln's ratios to QEMU's.
func printDevicesSummary(w io.Writer, c bench.DevicesComparison) {
	if blk := c.Blk(); len(blk.Kiln) > 0 && len(blk.Peer) > 0 {
		k, q := bench.BlkMiBps(c.BlkMiB, bench.Median(blk.Kiln)), bench.BlkMiBps(c.BlkMiB, bench.Median(blk.Peer))
		fmt.Fprintf(w, "blk sequential read of %d MiB: median kiln %.1f MiB/s, qemu microvm %.1f MiB/s, throughput kiln/qemu %.2f (higher: kiln faster)\n",
			c.BlkMiB, k, q, safeRatio(k, q))
	}
	if echo := c.Echo(); len(echo.Kiln) > 0 && len(echo.Peer) > 0 {
		k, q := bench.VsockResult{Echo: bench.Median(echo.Kiln)}.MiBps(), bench.VsockResult{Echo: bench.Median(echo.Peer)}.MiBps()
		fmt.Fprintf(w, "vsock echo of %d MiB: median kiln %.2f MiB/s, qemu microvm %.2f MiB/s, throughput kiln/qemu %.2f (higher: kiln faster)\n",
			bench.VsockEchoBytes>>20, k, q, safeRatio(k, q))
	}
	if rtt := c.RTT(); len(rtt.Kiln) > 0 && len(rtt.Peer) > 0 {
		fmt.Fprintf(w, "vsock round trip (%d and %d): median kiln %v, qemu microvm %v, kiln/qemu %.2f (lower: kiln faster); p90 kiln %v, qemu %v\n",
			len(rtt.Kiln), len(rtt.Peer), roundRTT(bench.Median(rtt.Kiln)), roundRTT(bench.Median(rtt.Peer)), rtt.Ratio(),
			roundRTT(bench.Percentile(rtt.Kiln, 90)), roundRTT(bench.Percentile(rtt.Peer, 90)))
	}
}
