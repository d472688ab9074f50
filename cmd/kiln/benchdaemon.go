package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/sandbox"
)

// benchDaemonUsage is kiln bench daemon's synopsis.
const benchDaemonUsage = "usage: kiln bench daemon [--image REF|--images DIR --image REF] [--concurrency 1,10,50] [--samples N] [--pool N] [--rate-for 60s] [--fork 1,8,32] [--checkpoints N] [--mem 128] [--json FILE] [--report-json FILE]"

// benchDaemonArgs is kiln bench daemon's command line.
type benchDaemonArgs struct {
	spec bench.DaemonSpec
	// layout is the OCI layout served on a loopback registry when no
	// images folder is given; image names one of its images or, when it
	// names none, a reference pulled as it is.
	layout string
	image  string
	images string
	// json is the results file (package bench/results); reportJSON the
	// whole report's JSON ("-": stdout).
	json, reportJSON string
	timeout          time.Duration
	debug            bool
}

// parseBenchDaemon parses kiln bench daemon's flags; kiln is this kiln
// binary (kilnd is looked for beside it).
func parseBenchDaemon(args []string, kiln string, stderr io.Writer) (benchDaemonArgs, error) {
	var a benchDaemonArgs
	fs := flag.NewFlagSet("kiln bench daemon", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, benchDaemonUsage)
		fs.PrintDefaults()
	}
	fs.StringVar(&a.image, "image", "busybox", "the template's image: a `NAME` in --layout, else a reference (in --images, or pulled)")
	fs.StringVar(&a.images, "images", "", "images `DIR` holding --image for kilnd and the library path; default: a private folder the image is pulled into")
	fs.StringVar(&a.layout, "layout", "", "OCI layout served on a loopback registry for --image; default: <cache>/test-rootfs/"+bench.DefaultImageLayout+" (make test-rootfs)")
	kilnd := fs.String("kilnd", "", "the kilnd binary; default: kilnd beside kiln")
	fs.StringVar(&a.spec.VMM, "vmm", "", "the kiln-vmm binary kilnd's and the library path's VMM processes run; default: $"+sandbox.VMMEnv+", else kiln-vmm beside kiln, else on $PATH")
	fs.StringVar(&a.spec.Kernel, "kernel", "", "kernel image for kilnd; default: the cached Debian kernel")
	fs.StringVar(&a.spec.Agent, "agent", "", "static kiln-agent binary for kilnd; default: $KILN_AGENT, or kiln-agent beside kiln")
	conc := intList(bench.DefaultDaemonConcurrency)
	fs.Var(&conc, "concurrency", "create burst sizes `N,...`: each burst creates N sandboxes at once")
	fs.IntVar(&a.spec.Samples, "samples", bench.DefaultDaemonSamples, "least creates timed at each concurrency and path (bursts repeat until there are as many); also the pool's creates")
	fs.IntVar(&a.spec.Pool, "pool", bench.DefaultDaemonPool, "warm pool size of a second template whose creates are timed apart (0: none)")
	fs.DurationVar(&a.spec.RateFor, "rate-for", bench.DefaultDaemonRateFor, "how long each path's sustained create, exec and destroy loop runs (0: none)")
	fs.IntVar(&a.spec.RateWorkers, "rate-workers", bench.DefaultDaemonRateWorkers, "loops at once in the sustained run")
	forks := intList(bench.DefaultForks)
	fs.Var(&forks, "fork", "fork sizes `N,...` timed from one running sandbox per path")
	noFork := fs.Bool("no-fork", false, "time no forks")
	fs.IntVar(&a.spec.Checkpoints, "checkpoints", bench.DefaultDaemonCheckpoints, "checkpoints and rollbacks of each kind timed (0: none)")
	fs.IntVar(&a.spec.MemoryMiB, "mem", bench.DefaultDaemonMemoryMiB, "guest memory in `MiB`")
	fs.IntVar(&a.spec.MaxMemoryMiB, "max-memory", 0, "kilnd's --max-memory in `MiB` (0: enough for the largest phase)")
	fs.StringVar(&a.spec.CgroupRoot, "cgroup-root", "", "kilnd's --cgroup-root (`PATH` or none); default: kilnd's own cgroup, or a folder made for the run under /sys/fs/cgroup when this process is in the root cgroup")
	fs.BoolVar(&a.spec.NoLibrary, "no-library", false, "measure kilnd alone")
	fs.DurationVar(&a.spec.OpTimeout, "op-timeout", bench.DefaultDaemonOpTimeout, "bound on one create, fork or rollback with its first exec")
	fs.StringVar(&a.spec.KVMMode, "kvm-mode", "", "the KVM mode to report (direct, nested, emulated); default: told from /proc/cpuinfo")
	fs.StringVar(&a.json, "json", "", "write every sample to this results `FILE` (kiln bench report reads it)")
	fs.StringVar(&a.reportJSON, "report-json", "", "also write the whole report (samples, errors, environment, spec) as JSON to `FILE` (\"-\": to stdout, after the tables)")
	fs.DurationVar(&a.timeout, "timeout", 0, "stop after this long (0: no limit)")
	fs.BoolVar(&a.debug, "debug", false, "log the library path's VMM events to stderr")
	if err := fs.Parse(args); err != nil {
		return a, err
	}
	if fs.NArg() > 0 {
		return a, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if a.image == "" {
		return a, errors.New("--image is empty")
	}
	switch a.spec.KVMMode {
	case "", bench.KVMDirect, bench.KVMNested, bench.KVMEmulated:
	default:
		return a, fmt.Errorf("--kvm-mode %q: want %s, %s or %s", a.spec.KVMMode, bench.KVMDirect, bench.KVMNested, bench.KVMEmulated)
	}
	if a.timeout < 0 {
		return a, fmt.Errorf("--timeout %v is negative", a.timeout)
	}
	if a.spec.Samples < 1 || a.spec.RateWorkers < 1 || a.spec.MemoryMiB < 1 {
		return a, fmt.Errorf("--samples %d, --rate-workers %d, --mem %d: want them positive", a.spec.Samples, a.spec.RateWorkers, a.spec.MemoryMiB)
	}
	if a.spec.OpTimeout <= 0 {
		return a, fmt.Errorf("--op-timeout %v: want a positive duration", a.spec.OpTimeout)
	}
	a.spec.Concurrency, a.spec.Forks = conc, forks
	if *noFork {
		a.spec.Forks = []int{}
	}
	a.spec.Kilnd = *kilnd
	if a.spec.Kilnd == "" {
		a.spec.Kilnd = filepath.Join(filepath.Dir(kiln), "kilnd")
	}
	// Check the numbers now, with a placeholder for what is settled later.
	probe := a.spec
	probe.Image, probe.Images = a.image, "-"
	if probe.VMM == "" {
		probe.VMM = "-" // sandbox.FindVMM's, found when it runs
	}
	if _, err := probe.Normalize(); err != nil {
		return a, err
	}
	return a, nil
}

// cmdBenchDaemon is `kiln bench daemon`: kilnd's create-to-first-exec
// latency at several concurrencies, warm-pool creates, a sustained create
// rate, forks, checkpoints and rollbacks, each beside the library path's
// (package sandbox in this process, VMs in VMM processes as kilnd runs
// them) from the same template snapshot.
func cmdBenchDaemon(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	self, err := os.Executable()
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench daemon: %v\n", err)
		return exitInternal
	}
	a, err := parseBenchDaemon(args, self, stderr)
	if errors.Is(err, flag.ErrHelp) {
		return exitOK
	}
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench daemon: %v\n", err)
		return exitUsage
	}
	if _, err := os.Stat(a.spec.Kilnd); err != nil {
		fmt.Fprintf(stderr, "kiln bench daemon: kilnd: %v (make build puts it beside kiln; or --kilnd)\n", err)
		return exitUsage
	}
	if a.spec.VMM == "" {
		if a.spec.VMM, err = sandbox.FindVMM(); err != nil {
			fmt.Fprintf(stderr, "kiln bench daemon: %v (or --vmm)\n", err)
			return exitUsage
		}
	}
	if a.timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, a.timeout)
		defer cancel()
	}
	// Short: kilnd's socket and the sandboxes' sockets live under it.
	scratch, err := os.MkdirTemp("", "kbd-")
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench daemon: %v\n", err)
		return exitInternal
	}
	defer os.RemoveAll(scratch)
	a.spec.Dir = scratch
	a.spec.Logger = newLogger(stderr, a.debug)
	a.spec.Image, a.spec.Images = a.image, a.images
	if a.images == "" {
		reg, ref, err := benchDaemonImage(ctx, a, filepath.Join(scratch, "images"), stdout)
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench daemon: %v\n", err)
			return exitUsage
		}
		if reg != nil {
			// Image roots read their blobs lazily: it serves to the end.
			defer reg.Close()
		}
		a.spec.Image, a.spec.Images = ref, filepath.Join(scratch, "images")
	}
	fmt.Fprintf(stdout, "kiln bench daemon: image %s; %d MiB; concurrency %v, at least %d creates each; pool %d; rate for %v with %d workers; forks %v; %d checkpoints of each kind\n",
		a.spec.Image, a.spec.MemoryMiB, a.spec.Concurrency, a.spec.Samples, a.spec.Pool, a.spec.RateFor, a.spec.RateWorkers, a.spec.Forks, a.spec.Checkpoints)
	rep, err := bench.RunDaemon(ctx, a.spec, stdout)
	fmt.Fprintln(stdout)
	rep.Print(stdout)
	if jerr := writeReportJSON(a.reportJSON, stdout, rep.WriteJSON); jerr != nil {
		fmt.Fprintf(stderr, "kiln bench daemon: %v\n", jerr)
		return exitInternal
	}
	if a.json != "" {
		r := daemonResults(a.spec.KVMMode, rep)
		if len(r.Measures) == 0 {
			fmt.Fprintln(stderr, "kiln bench daemon: nothing measured: no results file written")
			return exitInternal
		}
		if werr := r.WriteFile(a.json); werr != nil {
			fmt.Fprintf(stderr, "kiln bench daemon: %v\n", werr)
			return exitInternal
		}
		fmt.Fprintf(stdout, "results: %s (KVM %s)\n", a.json, r.KVMMode)
	}
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench daemon: %v\n", err)
		return exitInternal
	}
	return exitOK
}

// daemonVMM is the results' VMM name of a kiln bench daemon path: "kilnd"
// for kilnd, "kiln-library" for the library path.
func daemonVMM(path string) string {
	switch path {
	case bench.PathKilnd:
		return "kilnd"
	case bench.PathLibrary:
		return "kiln-library"
	}
	return "kiln-" + path
}

// daemonResults is the results file of kiln bench daemon, its measures
// named "daemon-" and the operation, on VMMs "kilnd" and "kiln-library"
// (daemonVMM), with param memory_mib:
//   - "daemon-create", "daemon-create-pool", "daemon-checkpoint",
//     "daemon-rollback", ... (each set's successful samples, seconds),
//     param concurrency;
//   - "daemon-create-rate" (sandboxes created, answering an exec and
//     destroyed per second of the sustained run: one sample per path),
//     params workers and for;
//   - "daemon-fork-ready" and "daemon-fork-exec" per fork, param n.
func daemonResults(kvmMode string, rep bench.DaemonReport) *results.Run {
	r := newResults(kvmMode)
	mem := fmt.Sprint(rep.Spec.MemoryMiB)
	for _, set := range rep.Sets {
		var ds []time.Duration
		for _, x := range set.Samples {
			if x.Err == "" {
				ds = append(ds, x.Total)
			}
		}
		if len(ds) == 0 {
			continue
		}
		r.AddDurations("daemon-"+set.Op, daemonVMM(set.Path), map[string]string{"concurrency": fmt.Sprint(set.Concurrency), "memory_mib": mem}, ds)
	}
	for _, rate := range rep.Rates {
		if rate.Elapsed <= 0 {
			continue
		}
		r.Measures = append(r.Measures, results.Measure{Name: "daemon-create-rate", VMM: daemonVMM(rate.Path), Unit: results.UnitPerSecond,
			Params:  map[string]string{"workers": fmt.Sprint(rate.Workers), "for": rate.For.String(), "memory_mib": mem},
			Samples: []float64{rate.PerSecond()}})
	}
	type forkKey struct {
		path string
		n    int
	}
	var keys []forkKey
	ready, exec := map[forkKey][]time.Duration{}, map[forkKey][]time.Duration{}
	for _, f := range rep.Forks {
		if f.Err != "" {
			continue
		}
		k := forkKey{f.Path, f.N}
		if _, ok := ready[k]; !ok {
			keys = append(keys, k)
		}
		ready[k] = append(ready[k], f.Ready)
		exec[k] = append(exec[k], f.AllExec)
	}
	for _, k := range keys {
		p := map[string]string{"n": fmt.Sprint(k.n), "memory_mib": mem}
		r.AddDurations("daemon-fork-ready", daemonVMM(k.path), p, ready[k])
		r.AddDurations("daemon-fork-exec", daemonVMM(k.path), p, exec[k])
	}
	return r
}

// benchDaemonImage puts a.image into the images folder dir: from a
// loopback registry serving a.layout when the image is one of its names,
// else pulled by its reference. It returns the registry (nil without one),
// which must serve until the run ends, and the reference.
func benchDaemonImage(ctx context.Context, a benchDaemonArgs, dir string, progress io.Writer) (*bench.LoopbackRegistry, string, error) {
	layout := a.layout
	if layout == "" {
		cache, err := guestkernel.CacheDir()
		if err != nil {
			return nil, "", err
		}
		layout = filepath.Join(cache, "test-rootfs", bench.DefaultImageLayout)
	}
	var reg *bench.LoopbackRegistry
	ref := a.image
	if _, err := os.Stat(layout); err == nil {
		if reg, err = bench.ServeLayout(layout, "kiln/bench"); err != nil {
			return nil, "", err
		}
		if r, ok := reg.Refs[a.image]; ok {
			ref = r
		} else {
			reg.Close()
			reg = nil
		}
	} else if a.layout != "" {
		return nil, "", fmt.Errorf("--layout: %w", err)
	}
	fail := func(err error) (*bench.LoopbackRegistry, string, error) {
		if reg != nil {
			reg.Close()
		}
		return nil, "", err
	}
	im, err := image.NewRoots(image.Options{}).Images(dir)
	if err != nil {
		return fail(err)
	}
	start := time.Now()
	if _, err := im.Pull(ctx, ref, image.PullOptions{}); err != nil {
		return fail(fmt.Errorf("pull %s: %w (make test-rootfs builds the test images)", ref, err))
	}
	fmt.Fprintf(progress, "pulled %s into %s in %v (not timed below)\n", ref, dir, time.Since(start).Round(time.Millisecond))
	return reg, ref, nil
}

// writeReportJSON writes a report with write to path: nowhere when path
// is empty, to stdout after the tables when it is "-".
func writeReportJSON(path string, stdout io.Writer, write func(io.Writer) error) error {
	switch path {
	case "":
		return nil
	case "-":
		fmt.Fprintln(stdout, "\nJSON:")
		return write(stdout)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = write(f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}
