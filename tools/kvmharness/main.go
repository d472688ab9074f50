// Command kvmharness runs Kiln's tests so that its KVM tests always run on
// real KVM: directly where this machine has a usable /dev/kvm, otherwise in
// an L1 VM under QEMU's software emulator (TCG), whose -cpu max emulates AMD
// SVM so that the real kvm_amd module loads there. L1 boots the cached Debian
// kernel (make kernel) and sees this machine's root read-only over 9p.
//
// Usage:
//
//	kvmharness [flags] [packages]              run the tests (default ./...)
//	kvmharness -exec [flags] -- CMD [ARG...]   run one command where KVM works
//	kvmharness -busybox-initrd FILE -script S  write a busybox initramfs
//
// Test mode, direct: `go test -count=1 -json` with KILN_KVM_TESTS=require.
// Test mode, tcg: `go test -json` with KILN_KVM_TESTS=outside (KVM tests
// skip), then the test binaries of the packages that define TestKVM... tests
// run their KVM tests in L1 with KILN_KVM_TESTS=require, each test in an L1
// VM of its own, -parallel of them at once (see runUnits). The tests named
// TestKVMWarm... run first, alone, in either mode, so that what they leave
// in the shared folder (KILN_TEST_SHARED, kvmtest.Shared) is there for the
// others. Either way it streams the tests' output, and ends with the
// suite's wall time, its five slowest KVM tests and
//
//	KVM tests: N ran, N passed, N failed, N skipped (mode: direct|tcg)
//	N passed, N failed, N skipped
//
// and exits 1 when a test failed, a KVM test was skipped or none ran.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// Modes.
const (
	modeAuto   = "auto"
	modeDirect = "direct"
	modeTCG    = "tcg"
)

type options struct {
	mode      string
	timeout   time.Duration
	l1Timeout time.Duration
	hangAfter time.Duration
	memMiB    int
	cpus      int
	parallel  int    // L1 VMs at once; 0 until resolved: defaultParallel
	shared    string // the shared folder; "" for a fresh one per run
	qemu      string
	keep      bool
	exec      bool
	initrd    string
	script    string
	// durationsOut, when set, receives each KVM test's L1 time of this
	// run in durations.txt's form.
	durationsOut string
	// run, when set, keeps only the tests it matches (go test -run), here
	// and in L1.
	run *regexp.Regexp
}

// defaultL1CPUs is one: with two, QEMU's multi-threaded emulation of
// nested SVM corrupted guest state under interrupt-heavy load. L2 guests
// triple-faulted while an interrupt was being delivered to them (kvm_exit
// "shutdown" with the vector in exit_int_info), and L1 itself crashed
// running kernel code with a zero GS base (stack guard page hit in
// exc_page_fault) or hung in soft lockups: about every other 100 MiB vsock
// stream in TestKVMAgent. With one vCPU no interrupt crosses emulated CPUs
// and the same stream passed every time, at the same speed (the L2 guest
// has one vCPU there anyway); boots take longer.
const defaultL1CPUs = 1

func main() {
	ctx, cancel := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	cancel()
	os.Exit(code)
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	var o options
	fs := flag.NewFlagSet("kvmharness", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.mode, "mode", modeAuto, "auto: direct when /dev/kvm is usable, else tcg; direct: this machine's KVM; tcg: KVM inside an emulated L1 VM")
	fs.DurationVar(&o.timeout, "timeout", 30*time.Minute, "timeout of each test binary (go test -timeout), or of the -exec command")
	fs.DurationVar(&o.l1Timeout, "l1-timeout", 75*time.Minute, "time the L1 VM may run before it is killed")
	fs.DurationVar(&o.hangAfter, "l1-hang", 60*time.Second, "kill L1 when its heartbeat has been silent this long (kicking it with a serial break every 6s before), and rerun the unfinished test binaries in a fresh L1, or fail an -exec command (0: never)")
	fs.IntVar(&o.memMiB, "mem", 4096, "L1 memory in MiB")
	fs.IntVar(&o.cpus, "cpus", defaultL1CPUs, "L1 vCPUs (see defaultL1CPUs)")
	fs.IntVar(&o.parallel, "parallel", 0, "L1 VMs running KVM tests at once (0: this machine's CPUs divided by -cpus, as far as memory allows, at least 1)")
	fs.StringVar(&o.shared, "shared", "", "the folder shared by every test and L1 of this run, as "+kvmtest.SharedEnvVar+" (kept; default: a fresh one, removed at the end unless -keep)")
	fs.StringVar(&o.qemu, "qemu", "qemu-system-x86_64", "QEMU binary for the L1 VM")
	fs.BoolVar(&o.keep, "keep", false, "keep the job folder (test binaries, L1 initramfs, outputs)")
	fs.BoolVar(&o.exec, "exec", false, "run the command given after the flags where KVM works, instead of tests")
	fs.StringVar(&o.initrd, "busybox-initrd", "", "write a busybox initramfs running -script to this file (gzip if it ends in .gz) and exit")
	fs.StringVar(&o.script, "script", "", "the /init script for -busybox-initrd")
	fs.StringVar(&o.durationsOut, "durations-out", "", "write each KVM test's L1 seconds of this run to this file (tools/kvmharness/durations.txt's form: the order of later runs)")
	runPattern := fs.String("run", "", "run only the tests this regular expression matches (go test -run's, on top-level names): the plain tests here and the KVM tests in L1")
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *runPattern != "" {
		re, err := regexp.Compile(*runPattern)
		if err != nil {
			fmt.Fprintf(stderr, "kvmharness: -run: %v\n", err)
			return 2
		}
		o.run = re
	}
	log := slog.New(slog.NewTextHandler(stderr, &slog.HandlerOptions{ReplaceAttr: dropTime}))

	if o.initrd != "" {
		if err := writeBusyboxInitrd(o.initrd, o.script); err != nil {
			fmt.Fprintf(stderr, "kvmharness: %v\n", err)
			return 1
		}
		return 0
	}
	if o.memMiB < 256 || o.cpus < 1 || o.parallel < 0 || o.timeout <= 0 || o.l1Timeout <= 0 {
		fmt.Fprintln(stderr, "kvmharness: -mem must be at least 256, -cpus at least 1, -parallel not negative, timeouts positive")
		return 2
	}
	if o.parallel == 0 {
		o.parallel = defaultParallel(runtime.NumCPU(), o.cpus, memAvailableMiB(), o.memMiB)
	}
	mode, err := chooseMode(o.mode, kvmtest.Usable)
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 2
	}
	log.Info("kvmharness", "mode", mode)
	if o.exec && fs.NArg() == 0 {
		fmt.Fprintln(stderr, "kvmharness: -exec needs a command after the flags")
		return 2
	}
	shared, cleanup, err := makeShared(o.shared, o.keep, log)
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 1
	}
	defer cleanup()
	o.shared = shared
	if o.exec {
		return execCommand(ctx, o, mode, fs.Args(), stdout, stderr, log)
	}
	pkgs := fs.Args()
	if len(pkgs) == 0 {
		pkgs = []string{"./..."}
	}
	return runTests(ctx, o, mode, pkgs, stdout, stderr, log)
}

// makeShared returns the absolute path of the shared folder (see
// kvmtest.Shared), creating it: dir when given (kept), else a fresh one
// that the returned cleanup removes unless keep.
func makeShared(dir string, keep bool, log *slog.Logger) (string, func(), error) {
	if dir != "" {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return "", nil, fmt.Errorf("the shared folder: %w", err)
		}
		if err := os.MkdirAll(abs, 0o755); err != nil {
			return "", nil, fmt.Errorf("creating the shared folder: %w", err)
		}
		return abs, func() {}, nil
	}
	dir, err := os.MkdirTemp("", "kiln-test-shared-")
	if err != nil {
		return "", nil, fmt.Errorf("creating the shared folder: %w", err)
	}
	cleanup := func() {
		if keep {
			log.Info("kept the shared folder", "path", dir)
			return
		}
		os.RemoveAll(dir)
	}
	return dir, cleanup, nil
}

func dropTime(_ []string, a slog.Attr) slog.Attr {
	if a.Key == slog.TimeKey {
		return slog.Attr{}
	}
	return a
}

// chooseMode resolves -mode: auto is direct when usable reports no error.
func chooseMode(mode string, usable func() error) (string, error) {
	switch mode {
	case modeDirect, modeTCG:
		return mode, nil
	case modeAuto:
		if usable() == nil {
			return modeDirect, nil
		}
		return modeTCG, nil
	}
	return "", fmt.Errorf("-mode=%q: want auto, direct or tcg", mode)
}

func writeBusyboxInitrd(path, script string) error {
	if script == "" {
		return errors.New("-busybox-initrd needs -script")
	}
	b, err := initramfs.BusyboxInit(script)
	if err != nil {
		return err
	}
	return b.WriteFile(path, strings.HasSuffix(path, ".gz"))
}

// runTests runs the suite in the given mode and returns the exit status.
func runTests(ctx context.Context, o options, mode string, pkgs []string, stdout, stderr io.Writer, log *slog.Logger) int {
	t := newTally()
	start := time.Now()
	goBin, err := goTool()
	if err != nil {
		t.problem("%v", err)
	} else if mode == modeDirect {
		runDirect(ctx, o, goBin, pkgs, stdout, t)
	} else {
		runTCG(ctx, o, goBin, pkgs, stdout, stderr, t, log)
	}
	t.wall = time.Since(start)
	log.Info("tests done", "elapsed", t.wall.Round(time.Millisecond))
	reasons := t.reasons()
	for _, r := range reasons {
		fmt.Fprintln(stdout, "FAIL: "+r)
	}
	t.summary(stdout, mode)
	if len(reasons) > 0 {
		return 1
	}
	return 0
}

// runDirect runs the suite here, on this machine's KVM: the warm KVM tests
// (warmPrefix) of the packages that have some first, on their own, then
// the rest.
func runDirect(ctx context.Context, o options, goBin string, pkgs []string, stdout io.Writer, t *tally) {
	env := environ(kvmtest.EnvVar+"="+kvmtest.ModeRequire, kvmtest.SharedEnvVar+"="+o.shared)
	args := []string{"-count=1", "-timeout", o.timeout.String()}
	if o.run != nil {
		args = append(args, "-run", o.run.String())
	}
	kpkgs, err := kvmPackages(ctx, goBin, pkgs)
	if err != nil {
		// The run below reports what is broken; it just has no warm phase.
		t.problem("finding the warm KVM tests: %v", err)
	}
	var warm []string
	for _, p := range kpkgs {
		if p.hasWarm() {
			warm = append(warm, p.ImportPath)
		}
	}
	if len(warm) > 0 {
		wargs := append(append(slices.Clone(args), "-run", "^"+warmPrefix), warm...)
		if err := goTestJSON(ctx, goBin, env, wargs, stdout, t, false); err != nil && !t.failing() {
			t.problem("%v", err)
		}
		args = append(args, "-skip", "^"+warmPrefix)
	}
	if err := goTestJSON(ctx, goBin, env, append(args, pkgs...), stdout, t, false); err != nil && !t.failing() {
		t.problem("%v", err)
	}
}

// runTCG runs the plain suite here and the KVM tests in L1.
func runTCG(ctx context.Context, o options, goBin string, pkgs []string, stdout, stderr io.Writer, t *tally, log *slog.Logger) {
	env := environ(kvmtest.EnvVar+"="+kvmtest.ModeOutside, kvmtest.SharedEnvVar+"="+o.shared)
	args := []string{"-timeout", o.timeout.String()}
	if o.run != nil {
		args = append(args, "-run", o.run.String())
	}
	args = append(args, pkgs...)
	if err := goTestJSON(ctx, goBin, env, args, stdout, t, true); err != nil && !t.failing() {
		t.problem("%v", err)
	}

	kpkgs, err := kvmPackages(ctx, goBin, pkgs)
	if err != nil {
		t.problem("finding KVM tests: %v", err)
		return
	}
	if len(kpkgs) == 0 {
		return
	}
	k, err := guestkernel.Find()
	if err != nil {
		t.problem("L1 needs the guest kernel: %v", err)
		return
	}
	// L1 sees the kernel cache read-only: the guests' modules disk is
	// built here, once, where building it does not take minutes.
	if _, err := k.ModulesDisk(ctx, ""); err != nil {
		t.problem("the guests' modules disk: %v", err)
		return
	}
	cache, err := guestkernel.CacheDir()
	if err != nil {
		t.problem("%v", err)
		return
	}
	job, cleanup, err := makeJob(o.keep, log)
	if err != nil {
		t.problem("%v", err)
		return
	}
	defer cleanup()

	// Each KVM test runs in an L1 of its own: L1 is up in seconds, and
	// under TCG's nested SVM one test's leftovers have frozen the L1 for
	// the next (network namespace clean-up, then an L2 boot).
	var units []testBinary
	for i, p := range kpkgs {
		path := filepath.Join(job, "bin", strconv.Itoa(i)+".test")
		log.Info("building test binary", "package", p.ImportPath)
		if err := buildTestBinary(ctx, goBin, p.ImportPath, path, stderr); err != nil {
			t.problem("%v", err)
			t.failedPkgs[p.ImportPath] = true
			continue
		}
		names, err := listKVMTests(ctx, path, p.Dir)
		if err != nil {
			t.problem("%s: %v", p.ImportPath, err)
			t.failedPkgs[p.ImportPath] = true
			continue
		}
		for j, name := range names {
			if o.run != nil && !o.run.MatchString(name) {
				continue
			}
			id := fmt.Sprintf("%d-%d", i, j)
			units = append(units, testBinary{
				pkg: p, path: path, test: name,
				out: filepath.Join(job, "out", id+".out"),
				rc:  filepath.Join(job, "out", id+".rc"),
				dir: filepath.Join(job, "units", id),
			})
		}
	}
	if len(units) == 0 {
		return
	}
	if err := os.MkdirAll(filepath.Join(job, "out"), 0o755); err != nil {
		t.problem("%v", err)
		return
	}
	env = l1Env(cache, kvmtest.EnvVar+"="+kvmtest.ModeRequire, kvmtest.SharedEnvVar+"="+o.shared)
	l1 := l1Config{
		qemu: o.qemu, kernel: k, memMiB: o.memMiB, timeout: o.l1Timeout, job: job, shared: o.shared,
		workdir: workdirForL1(), console: &lockedWriter{w: stdout}, log: log, hangAfter: o.hangAfter,
	}
	kvmStart := time.Now()
	results := runUnits(ctx, o, l1, env, units, log)
	t.l1Wall, t.l1Parallel = time.Since(kvmStart), min(o.parallel, len(units))
	for _, r := range results {
		t.l1Time += r.l1Time
		t.l1Retries = append(t.l1Retries, r.retries...)
		if r.err != nil {
			t.problem("%s: %v", r.u.name(), r.err)
		}
	}
	for _, r := range results {
		collectL1Results(ctx, goBin, r.u, t)
	}
	if o.durationsOut != "" {
		d := map[string]time.Duration{}
		for _, r := range results {
			if r.err == nil && r.l1Time > 0 {
				d[r.u.test] = r.l1Time
			}
		}
		if err := writeDurationsFile(o.durationsOut, d); err != nil {
			t.problem("%v", err)
		}
	}
}

// writeDurationsFile writes d to path (writeDurations).
func writeDurationsFile(path string, d map[string]time.Duration) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("-durations-out: %w", err)
	}
	if err := writeDurations(f, d); err != nil {
		f.Close()
		return fmt.Errorf("-durations-out %s: %w", path, err)
	}
	return f.Close()
}

// runUnits runs the units in L1 VMs, o.parallel at a time (a unit whose L1
// needs more vCPUs than -cpus takes more than one place: unitSlots): the
// warm tests first, the others as places free up, longest first. l1 is
// every L1's configuration but for what runUnitInL1 sets. It returns one
// result per unit, in the units' order.
func runUnits(ctx context.Context, o options, l1 l1Config, env []string, units []testBinary, log *slog.Logger) []unitResult {
	results := make([]unitResult, len(units))
	for i, u := range units {
		results[i].u = u
	}
	names := make([]string, len(units))
	for i, u := range units {
		names[i] = u.test
	}
	weight := func(i int) int { return unitSlots(unitCPUs(o.cpus, units[i].test), o.cpus, o.parallel) }
	expected, err := parseDurations(strings.NewReader(expectedDurations))
	if err != nil {
		log.Warn("ignoring tools/kvmharness/durations.txt", "err", err)
	}
	order := unitOrder(names, weight, expected)
	log.Info("running KVM tests in L1", "tests", len(order), "at_once", min(o.parallel, len(order)))
	runPool(ctx, order, o.parallel, weight, func(i int) {
		results[i] = runUnitInL1(ctx, o, l1, env, units[i], log)
	})
	return results
}

// unitCPUs is the vCPUs of the L1 that runs test: -cpus, or more for a
// test that needs them (smpL1CPUs).
func unitCPUs(cpus int, test string) int { return max(cpus, smpL1CPUs(test)) }

// unitResult is what running one unit in L1 came to.
type unitResult struct {
	u       testBinary    // the unit, with the output paths of its last run
	retries []string      // why an L1 of it was replaced by a fresh one
	err     error         // why it did not finish in L1, if it did not
	l1Time  time.Duration // how long its L1 VMs ran, boots included
}

// lockedWriter serializes the writes of L1 VMs running at once, so that
// each console line (one Write) stays whole.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// runUnitInL1 runs u in a fresh L1 VM, and once more in another when that
// L1 hangs or dies before u finishes (L1's kernel occasionally does under
// TCG's nested SVM). Its L1 has u.dir for its own files (run.sh, done,
// heartbeat, initramfs) and prefixes its console lines with u's test name.
func runUnitInL1(ctx context.Context, o options, l1 l1Config, env []string, u testBinary, log *slog.Logger) unitResult {
	r := unitResult{u: u}
	log = log.With("test", u.test)
	l1.unit, l1.cpus, l1.log = u.dir, unitCPUs(o.cpus, u.test), log
	l1.prefix = "L1 " + u.test + "| "
	if err := os.MkdirAll(u.dir, 0o755); err != nil {
		r.err = fmt.Errorf("creating its L1 folder: %w", err)
		return r
	}
	for attempt := 1; attempt <= l1Attempts; attempt++ {
		if attempt > 1 {
			r.u = r.u.attempt(attempt)
		}
		os.Remove(filepath.Join(u.dir, "done"))
		os.Remove(filepath.Join(u.dir, heartbeatFile))
		script := testJobScript(u.dir, env, []testBinary{r.u}, o.timeout)
		if err := os.WriteFile(filepath.Join(u.dir, "run.sh"), []byte(script), 0o755); err != nil {
			r.err = fmt.Errorf("writing its job script: %w", err)
			return r
		}
		start := time.Now()
		l1err := runL1(ctx, l1)
		r.l1Time += time.Since(start)
		if l1err == nil {
			r.err = nil
			return r
		}
		_, statErr := os.Stat(r.u.rc)
		if statErr != nil && attempt < l1Attempts && ctx.Err() == nil {
			r.retries = append(r.retries, fmt.Sprintf("%v; reran %s in a fresh L1", l1err, u.name()))
			log.Warn("L1 failed; running the test again in a fresh L1", "err", l1err)
			continue
		}
		r.err = l1err
		return r
	}
	return r
}

// smpL1CPUs returns the L1 vCPUs a KVM test that boots Linux on several
// vCPUs needs, or 0 for the others (they keep -cpus, defaultL1CPUs: see
// there for why). Under a one-vCPU L1, TestKVMBootCommand's two-vCPU
// Linux guest froze L1 in two runs of three under QEMU 7.2, and once in
// four whole-suite runs under QEMU 10 (host load about 4), though 21
// quieter trials passed; with two it never has. The emulator is at fault,
// not Kiln (docs/bench.md, "Two vCPUs under emulated nested SVM"), so this
// stays until an emulator stops freezing.
func smpL1CPUs(test string) int {
	switch test {
	case "TestKVMBootCommand":
		return 2
	}
	return 0
}

// listKVMTests returns the KVM tests the test binary at path defines, in
// its order (go test's -test.list runs none of them).
func listKVMTests(ctx context.Context, path, dir string) ([]string, error) {
	cmd := exec.CommandContext(ctx, path, "-test.list", "^TestKVM")
	cmd.Dir = dir
	cmd.Env = environ(kvmtest.EnvVar + "=" + kvmtest.ModeOutside)
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("listing KVM tests: %w", err)
	}
	var names []string
	for _, line := range strings.Split(string(out), "\n") {
		if line = strings.TrimSpace(line); strings.HasPrefix(line, "TestKVM") {
			names = append(names, line)
		}
	}
	if len(names) == 0 {
		return nil, errors.New("the test binary lists no KVM test")
	}
	return names, nil
}

// l1Attempts is how many L1 VMs one KVM test may take: the first, and one
// more when that L1 hung or died before the test finished.
const l1Attempts = 2

func collectL1Results(ctx context.Context, goBin string, b testBinary, t *tally) {
	pkg := b.pkg.ImportPath
	if _, err := os.Stat(b.out); err != nil {
		t.problem("%s: did not run in L1", b.name())
		t.failedPkgs[pkg] = true
		return
	}
	// A binary whose failed tests were run again: those tests count as
	// they did the second time (and as flaky when they passed then).
	retried := map[string]bool{}
	retryRC, retryErr := os.ReadFile(b.retryRC())
	if retryErr == nil {
		if err := test2json(ctx, goBin, pkg, b.retryOut(), func(ev event) {
			if top, _, _ := strings.Cut(ev.Test, "/"); top != "" {
				retried[top] = true
			}
		}); err != nil {
			t.problem("%s: reading its L1 retry results: %v", pkg, err)
		}
	}
	failedBefore := t.failed
	firstFailed := map[string]bool{}
	if err := test2json(ctx, goBin, pkg, b.out, func(ev event) {
		top, _, _ := strings.Cut(ev.Test, "/")
		if retryErr == nil && ev.Test == "" && ev.Action != "output" {
			return // the package's result is the retry's
		}
		if retried[top] {
			if ev.Action == "fail" && top == ev.Test {
				firstFailed[top] = true
			}
			return
		}
		t.add(ev, false)
	}); err != nil {
		t.problem("%s: reading its L1 results: %v", pkg, err)
	}
	if retryErr == nil {
		retryFailedBefore := t.failed
		if err := test2json(ctx, goBin, pkg, b.retryOut(), func(ev event) {
			if ev.Action == "pass" && topLevel(ev.Test) && firstFailed[ev.Test] {
				t.flaky = append(t.flaky, pkg+" "+ev.Test)
			}
			t.add(ev, false)
		}); err != nil {
			t.problem("%s: reading its L1 retry results: %v", pkg, err)
		}
		if rc := strings.TrimSpace(string(retryRC)); rc != "0" && t.failed == retryFailedBefore {
			t.problem("%s: the test binary exited with status %s in L1 when retried", pkg, rc)
			t.failedPkgs[pkg] = true
		}
		return
	}
	data, err := os.ReadFile(b.rc)
	if err != nil {
		t.problem("%s: did not finish in L1", b.name())
		t.failedPkgs[pkg] = true
		return
	}
	if rc := strings.TrimSpace(string(data)); rc != "0" && t.failed == failedBefore {
		t.problem("%s: the test binary exited with status %s in L1", pkg, rc)
		t.failedPkgs[pkg] = true
	}
}

// makeJob creates the job folder L1 shares read-write. It lives in the
// temporary folder, which L1 covers with its own tmpfs, so tests in L1 never
// see it unless they look at its path.
func makeJob(keep bool, log *slog.Logger) (string, func(), error) {
	job, err := os.MkdirTemp("", "kiln-kvmharness-")
	if err != nil {
		return "", nil, fmt.Errorf("creating the job folder: %w", err)
	}
	if err := os.MkdirAll(filepath.Join(job, "bin"), 0o755); err != nil {
		return "", nil, err
	}
	cleanup := func() {
		if keep {
			log.Info("kept the job folder", "path", job)
			return
		}
		os.RemoveAll(job)
	}
	return job, cleanup, nil
}

// execCommand runs argv directly or in L1 and returns its exit status.
func execCommand(ctx context.Context, o options, mode string, argv []string, stdout, stderr io.Writer, log *slog.Logger) int {
	if mode == modeDirect {
		ctx, cancel := context.WithTimeout(ctx, o.timeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
		cmd.Env = environ(kvmtest.SharedEnvVar + "=" + o.shared)
		cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, stdout, stderr
		cmd.WaitDelay = 5 * time.Second
		start := time.Now()
		err := cmd.Run()
		fmt.Fprintf(stderr, "kvmharness: %s took %v (mode: direct)\n", argv[0], time.Since(start).Round(time.Millisecond))
		var exitErr *exec.ExitError
		switch {
		case errors.Is(ctx.Err(), context.DeadlineExceeded):
			fmt.Fprintf(stderr, "kvmharness: %s did not finish within %v: killed it\n", argv[0], o.timeout)
			return 124
		case errors.As(err, &exitErr):
			return exitErr.ExitCode()
		case err != nil:
			fmt.Fprintf(stderr, "kvmharness: %v\n", err)
			return 127
		}
		return 0
	}
	k, err := guestkernel.Find()
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: L1 needs the guest kernel: %v\n", err)
		return 1
	}
	if _, err := k.ModulesDisk(ctx, ""); err != nil { // see runTCG
		fmt.Fprintf(stderr, "kvmharness: the guests' modules disk: %v\n", err)
		return 1
	}
	cache, err := guestkernel.CacheDir()
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 1
	}
	wd, err := os.Getwd()
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 1
	}
	job, cleanup, err := makeJob(o.keep, log)
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 1
	}
	defer cleanup()
	script := execJobScript(job, wd, l1Env(cache, kvmtest.SharedEnvVar+"="+o.shared), argv)
	if err := os.WriteFile(filepath.Join(job, "run.sh"), []byte(script), 0o755); err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 1
	}
	start := time.Now()
	err = runL1(ctx, l1Config{
		qemu: o.qemu, kernel: k, memMiB: o.memMiB, cpus: o.cpus, timeout: o.l1Timeout,
		job: job, shared: o.shared, workdir: workdirForL1(), console: stdout, log: log, hangAfter: o.hangAfter,
	})
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 1
	}
	rc, err := readExitStatus(filepath.Join(job, "rc"))
	if err != nil {
		fmt.Fprintf(stderr, "kvmharness: %v\n", err)
		return 1
	}
	inL1 := "?"
	if d, err := l1Duration(filepath.Join(job, "time")); err == nil {
		inL1 = d.Round(time.Millisecond).String()
	}
	fmt.Fprintf(stderr, "kvmharness: %s took %s in L1, %v with L1's boot (mode: tcg)\n",
		argv[0], inL1, time.Since(start).Round(time.Millisecond))
	return rc
}

func readExitStatus(path string) (int, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, fmt.Errorf("the command's exit status: %w", err)
	}
	rc, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		return 0, fmt.Errorf("the command's exit status %q: %w", data, err)
	}
	return rc, nil
}

// l1Duration reads "START END" uptimes in seconds.
func l1Duration(path string) (time.Duration, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	f := strings.Fields(string(data))
	if len(f) != 2 {
		return 0, fmt.Errorf("%s: want two uptimes, got %q", path, data)
	}
	a, err1 := strconv.ParseFloat(f[0], 64)
	b, err2 := strconv.ParseFloat(f[1], 64)
	if err := errors.Join(err1, err2); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	return time.Duration((b - a) * float64(time.Second)), nil
}

// workdirForL1 is the working directory when L1 would not see it through
// its root share (see l1Config.workdir), else "".
func workdirForL1() string {
	wd, err := os.Getwd()
	if err != nil || !coveredByTmpfs(wd) {
		return ""
	}
	return wd
}
