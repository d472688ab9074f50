package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/procfs"

	"github.com/kilnvm/kiln/sandbox"
)

// The density benchmark (issue 17): idle sandboxes started from one booted
// template, each in a VMM process of its own, step by step until a count,
// a cap or the host's memory is reached; after each step every sandbox's
// guest RAM PSS and its VMM process's own PSS (the process's PSS less its
// guest RAM's), and the host's MemAvailable drop since before the
// template booted. From them: sandboxes that fit in a memory budget, by
// measurement and, labelled as such, by extrapolation.

// How DensitySpec.Method makes the sandboxes.
const (
	// DensityTemplate holds the booted parent once (Sandbox.Hold: its
	// first hold copies nothing) and starts every step's sandboxes over
	// that one frozen base (sandbox.RestoreFrozen, each in a VMM
	// process): what a daemon's template does, and every sandbox of
	// every step shares one base.
	DensityTemplate = "template"
	// DensityFork forks each step's sandboxes from the running parent
	// (Sandbox.Fork). Only the first fork of a booted sandbox copies
	// nothing: every later step first copies the parent's non-zero
	// pages into a new base, which its children share.
	DensityFork = "fork"
)

// Defaults of DensitySpec.
var (
	// DefaultDensitySteps are the cumulative sandbox counts measured
	// (those below the target, then the target).
	DefaultDensitySteps = []int{1, 8, 16, 32}
)

const (
	DefaultDensityMemoryMiB = 512
	DefaultDensityChildren  = 32
	DefaultDensityBudget    = 8 << 30
	DefaultDensityFloor     = 512 << 20
	DefaultDensitySettle    = 2 * time.Second
	densityHoldID           = "kiln-bench-density"
)

// DensitySpec says what RunDensity measures.
type DensitySpec struct {
	// Runtime boots the template (sandbox.FindRuntime makes one).
	Runtime sandbox.Runtime
	// Process starts each VMM process (kiln-vmm); required.
	Process sandbox.ProcessOptions
	// MemoryMiB and CPUs size the template (DefaultDensityMemoryMiB and
	// 1 when zero).
	MemoryMiB, CPUs int
	// Children is how many sandboxes to start (DefaultDensityChildren
	// when zero); Cap, when set, stops before that (the run reaches
	// min(Children, Cap)).
	Children, Cap int
	// Steps are the cumulative counts measured, ascending; those at or
	// past the target are dropped and the target is always the last
	// (DefaultDensitySteps when nil).
	Steps []int
	// MemoryBudget is the memory the fit is counted in, in bytes
	// (DefaultDensityBudget when zero).
	MemoryBudget uint64
	// Floor is the host's MemAvailable no step may take it under: a
	// step that would is shortened to what fits, and the run stops
	// there (DefaultDensityFloor when zero).
	Floor uint64
	// Settle is how long the sandboxes idle after each step before they
	// are checked and measured (DefaultDensitySettle when zero;
	// negative: no wait).
	Settle time.Duration
	// Method is DensityTemplate (when empty) or DensityFork.
	Method string
	// BootTimeout bounds the template's boot (5 minutes when zero).
	BootTimeout time.Duration
	// Parallel bounds the restores (and the checking execs) in flight at
	// once within a step; 0 runs a step's all at once. A host with few
	// CPUs (an emulated L1 has one) gets through a step of hundreds of
	// sandboxes in waves, where all at once each waits on all the others.
	Parallel int
	// Logger is the sandboxes'; slog.Default() when nil.
	Logger *slog.Logger
}

// Target is the sandbox count the run goes for: min(Children, Cap).
func (s DensitySpec) Target() int {
	if s.Cap > 0 && s.Cap < s.Children {
		return s.Cap
	}
	return s.Children
}

// Normalize fills in the defaults and checks the spec.
func (s DensitySpec) Normalize() (DensitySpec, error) {
	if s.MemoryMiB == 0 {
		s.MemoryMiB = DefaultDensityMemoryMiB
	}
	if s.CPUs == 0 {
		s.CPUs = 1
	}
	if s.Children == 0 {
		s.Children = DefaultDensityChildren
	}
	if s.MemoryBudget == 0 {
		s.MemoryBudget = DefaultDensityBudget
	}
	if s.Floor == 0 {
		s.Floor = DefaultDensityFloor
	}
	if s.Settle == 0 {
		s.Settle = DefaultDensitySettle
	}
	if s.Settle < 0 {
		s.Settle = 0
	}
	if s.Method == "" {
		s.Method = DensityTemplate
	}
	if s.BootTimeout <= 0 {
		s.BootTimeout = 5 * time.Minute
	}
	switch {
	case s.MemoryMiB < 1 || s.CPUs < 1:
		return s, fmt.Errorf("bench: density: %d MiB, %d vCPUs: want both positive", s.MemoryMiB, s.CPUs)
	case s.Children < 1 || s.Children > 4096:
		return s, fmt.Errorf("bench: density: %d children: want 1 to 4096", s.Children)
	case s.Cap < 0:
		return s, fmt.Errorf("bench: density: cap %d: want 0 (none) or more", s.Cap)
	case s.Method != DensityTemplate && s.Method != DensityFork:
		return s, fmt.Errorf("bench: density: method %q: want %s or %s", s.Method, DensityTemplate, DensityFork)
	}
	steps, err := densitySteps(s.Steps, s.Target())
	if err != nil {
		return s, err
	}
	s.Steps = steps
	return s, nil
}

// densitySteps checks steps (DefaultDensitySteps when nil) and fits them
// to target: those at or past it dropped, target last.
func densitySteps(steps []int, target int) ([]int, error) {
	if steps == nil {
		steps = DefaultDensitySteps
	}
	var out []int
	for i, n := range steps {
		if n < 1 {
			return nil, fmt.Errorf("bench: density: step %d: want at least 1", n)
		}
		if i > 0 && n <= steps[i-1] {
			return nil, fmt.Errorf("bench: density: steps %v: want them ascending (cumulative counts)", steps)
		}
		if n < target {
			out = append(out, n)
		}
	}
	return append(out, target), nil
}

// ParseDensitySteps parses "1,8,16,32".
func ParseDensitySteps(s string) ([]int, error) {
	var out []int
	for f := range strings.SplitSeq(s, ",") {
		f = strings.TrimSpace(f)
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("steps %q: %q is not a count of at least 1", s, f)
		}
		if len(out) > 0 && n <= out[len(out)-1] {
			return nil, fmt.Errorf("steps %q: want ascending cumulative counts", s)
		}
		out = append(out, n)
	}
	return out, nil
}

// SandboxMem is one sandbox's memory: its guest RAM and its VMM process.
type SandboxMem struct {
	// Guest is the guest RAM's smaps (PSS, RSS, own copies).
	Guest MemUsage
	// ProcessPSS and ProcessRSS are the VMM process's smaps_rollup.
	ProcessPSS, ProcessRSS uint64
	// VMM is the VMM process's PSS beside the guest's RAM by kind, and
	// its Go runtime's own account.
	VMM VMMMemory
}

// VMMPSS is what the VMM process costs beyond its guest RAM: its PSS less
// the guest RAM's.
func (m SandboxMem) VMMPSS() uint64 {
	if m.ProcessPSS < m.Guest.Pss {
		return 0
	}
	return m.ProcessPSS - m.Guest.Pss
}

// TotalPSS is the guest's PSS and the VMM's: the process's PSS.
func (m SandboxMem) TotalPSS() uint64 { return m.Guest.Pss + m.VMMPSS() }

// MemStats are the mean, median and largest of per-sandbox figures.
type MemStats struct {
	Mean, Median, Max uint64
}

// memStatsOf summarizes xs (zero when empty); the median of an even count
// is the mean of the middle two.
func memStatsOf(xs []uint64) MemStats {
	if len(xs) == 0 {
		return MemStats{}
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	var sum uint64
	for _, x := range s {
		sum += x
	}
	st := MemStats{Mean: sum / uint64(len(s)), Max: s[len(s)-1]}
	if n := len(s); n%2 == 1 {
		st.Median = s[n/2]
	} else {
		st.Median = (s[n/2-1] + s[n/2]) / 2
	}
	return st
}

// DensityStep is the state after one step: every sandbox started so far.
type DensityStep struct {
	// Count is how many sandboxes run (the template not counted).
	Count int
	// Start is how long the step's new sandboxes took to answer.
	Start time.Duration
	// Sandboxes are each sandbox's memory, oldest first, measured once
	// each had idled Settle and answered an exec of true.
	Sandboxes []SandboxMem
	// Template is the template's (the parent's) memory at the same time.
	Template SandboxMem
	// MemAvailable is the host's then; HostUsed its drop since before
	// the template booted (0 if it rose).
	MemAvailable, HostUsed uint64
	// Idle is how long the sandboxes idled before they were checked: the
	// window IdleCPU covers (0 when the step did not settle).
	Idle time.Duration
	// IdleCPU is each sandbox's VMM process's time on a CPU over Idle,
	// its guest's included, oldest first: what an idle sandbox costs the
	// host's CPUs (nil when not measured).
	IdleCPU []time.Duration
}

// IdleCPUShare is the sandboxes' mean and largest CPU use while idle, as
// a fraction of one CPU (0 when not measured).
func (s DensityStep) IdleCPUShare() (mean, most float64) {
	if s.Idle <= 0 || len(s.IdleCPU) == 0 {
		return 0, 0
	}
	var sum time.Duration
	for _, d := range s.IdleCPU {
		sum += d
		most = max(most, d.Seconds()/s.Idle.Seconds())
	}
	return sum.Seconds() / float64(len(s.IdleCPU)) / s.Idle.Seconds(), most
}

func (s DensityStep) pick(f func(SandboxMem) uint64) MemStats {
	xs := make([]uint64, len(s.Sandboxes))
	for i, m := range s.Sandboxes {
		xs[i] = f(m)
	}
	return memStatsOf(xs)
}

// Guest summarizes the sandboxes' guest RAM PSS.
func (s DensityStep) Guest() MemStats {
	return s.pick(func(m SandboxMem) uint64 { return m.Guest.Pss })
}

// GuestRSS summarizes the sandboxes' guest RAM RSS.
func (s DensityStep) GuestRSS() MemStats {
	return s.pick(func(m SandboxMem) uint64 { return m.Guest.Rss })
}

// VMM summarizes the sandboxes' VMM process PSS less guest RAM.
func (s DensityStep) VMM() MemStats { return s.pick(SandboxMem.VMMPSS) }

// Total summarizes the sandboxes' whole PSS (guest and VMM).
func (s DensityStep) Total() MemStats { return s.pick(SandboxMem.TotalPSS) }

// HostPerSandbox is HostUsed shared out over the sandboxes (the
// template's cost, the kernel's and any other change in the host's
// memory included).
func (s DensityStep) HostPerSandbox() uint64 {
	if s.Count == 0 {
		return 0
	}
	return s.HostUsed / uint64(s.Count)
}

// DensityFit is how many sandboxes fit in a memory budget.
type DensityFit struct {
	Budget uint64
	// Measured is the most sandboxes a step ran while the host's memory
	// used (DensityStep.HostUsed, the template's included) stayed within
	// the budget; 0 when none did.
	Measured int
	// Bound says what Measured is: "budget" when a later step went past
	// the budget (the count lies between Measured and that step's),
	// else a lower bound: "target" (every step fit), "host memory" (the
	// host's memory floor stopped the run) or "error".
	Bound string
	// PerSandbox is the last step's mean guest PSS plus mean VMM PSS,
	// and Extrapolated Budget / PerSandbox: an extrapolation, not a
	// measurement (the template and the kernel's own memory left out).
	PerSandbox   uint64
	Extrapolated int
}

// extrapolate is budget / perSandbox, 0 when perSandbox is.
func extrapolate(budget, perSandbox uint64) int {
	if perSandbox == 0 {
		return 0
	}
	return int(budget / perSandbox)
}

// DensityReport is what RunDensity measured.
type DensityReport struct {
	Spec DensitySpec
	// MemTotal and MemAvailable are the host's before the template
	// booted.
	MemTotal, MemAvailable uint64
	// Template is the parent's memory as a standalone booted VM after
	// its first exec, before any sandbox was made from it.
	Template SandboxMem
	// Steps are after each step, in order.
	Steps []DensityStep
	// Stopped says why the run ended before the target ("" when it
	// reached it).
	Stopped string
	// Leaked are VMM processes found running after everything was
	// closed (killed then); none is expected.
	Leaked []int
}

// Last is the last step measured, nil when none was.
func (r DensityReport) Last() *DensityStep {
	if len(r.Steps) == 0 {
		return nil
	}
	return &r.Steps[len(r.Steps)-1]
}

// Fit counts the sandboxes that fit in the spec's memory budget.
func (r DensityReport) Fit() DensityFit {
	f := DensityFit{Budget: r.Spec.MemoryBudget, Bound: "target"}
	switch {
	case strings.HasPrefix(r.Stopped, "host memory"):
		f.Bound = "host memory"
	case r.Stopped != "":
		f.Bound = "error"
	}
	for _, s := range r.Steps {
		if s.HostUsed > f.Budget {
			f.Bound = "budget"
			break
		}
		f.Measured = s.Count
	}
	if l := r.Last(); l != nil {
		f.PerSandbox = l.Guest().Mean + l.VMM().Mean
		f.Extrapolated = extrapolate(f.Budget, f.PerSandbox)
	}
	return f
}

// ParseMeminfo reads /proc/meminfo's form into bytes by field ("MemTotal",
// "MemAvailable", ...); a field in kB is converted, one without a unit
// (HugePages_Total) kept as it is.
func ParseMeminfo(r io.Reader) (map[string]uint64, error) {
	out := map[string]uint64{}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		key, val, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		f := strings.Fields(val)
		if len(f) == 0 || len(f) > 2 {
			return nil, fmt.Errorf("meminfo: %s: %q", key, val)
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("meminfo: %s: %w", key, err)
		}
		if len(f) == 2 {
			if f[1] != "kB" {
				return nil, fmt.Errorf("meminfo: %s: unit %q, want kB", key, f[1])
			}
			n <<= 10
		}
		out[strings.TrimSpace(key)] = n
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("meminfo: %w", err)
	}
	for _, k := range []string{"MemTotal", "MemAvailable"} {
		if _, ok := out[k]; !ok {
			return nil, fmt.Errorf("meminfo: no %s", k)
		}
	}
	return out, nil
}

// hostMemory returns the host's MemTotal and MemAvailable in bytes.
func hostMemory() (total, avail uint64, err error) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, 0, fmt.Errorf("bench: %w", err)
	}
	defer f.Close()
	m, err := ParseMeminfo(f)
	if err != nil {
		return 0, 0, fmt.Errorf("bench: %w", err)
	}
	return m["MemTotal"], m["MemAvailable"], nil
}

// stepSize is how many of want new sandboxes, each estimated to cost
// perSandbox, fit while keeping avail above floor.
func stepSize(want int, avail, floor, perSandbox uint64) int {
	if avail <= floor {
		return 0
	}
	if perSandbox == 0 {
		return want
	}
	return int(min(uint64(want), (avail-floor)/perSandbox))
}

// sandboxMem measures sb: its guest RAM and its VMM process.
func sandboxMem(sb *sandbox.Sandbox) (SandboxMem, error) {
	var m SandboxMem
	g, err := GuestUsage(sb)
	if err != nil {
		return m, err
	}
	m.Guest = g
	p, err := procfs.NewProc(sb.PID())
	if err != nil {
		return m, fmt.Errorf("bench: VMM process %d: %w", sb.PID(), err)
	}
	roll, err := p.ProcSMapsRollup()
	if err != nil {
		return m, fmt.Errorf("bench: VMM process %d: smaps_rollup: %w", sb.PID(), err)
	}
	m.ProcessPSS, m.ProcessRSS = roll.Pss, roll.Rss
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pid, ranges, err := sb.GuestMemory(ctx)
	if err != nil {
		return m, fmt.Errorf("bench: %w", err)
	}
	if m.VMM, err = vmmMemory(ctx, sb, pid, ranges); err != nil {
		return m, err
	}
	return m, nil
}

// kidsOnCPU reads each sandbox's VMM process's time on a CPU so far,
// oldest first.
func (d *densityRun) kidsOnCPU() ([]time.Duration, error) {
	out := make([]time.Duration, len(d.kids))
	for i, k := range d.kids {
		t, err := processOnCPU("/proc", k.PID())
		if err != nil {
			return nil, err
		}
		out[i] = t
	}
	return out, nil
}

// densityRun holds a run's sandboxes.
type densityRun struct {
	spec     DensitySpec
	progress io.Writer
	parent   *sandbox.Sandbox
	frozen   *sandbox.Frozen
	kids     []*sandbox.Sandbox
	pids     []int
}

func (d *densityRun) logf(format string, args ...any) {
	fmt.Fprintf(d.progress, format+"\n", args...)
}

// start makes n more sandboxes, each in a VMM process of its own.
func (d *densityRun) start(ctx context.Context, n int) error {
	if d.spec.Method == DensityFork {
		kids, err := d.parent.Fork(ctx, n, sandbox.ForkOptions{})
		if err != nil {
			return err
		}
		d.add(kids...)
		return nil
	}
	// As Fork does: all at once, each waited for as long as the others
	// share the CPUs.
	wave := n
	if p := d.spec.Parallel; p > 0 && p < n {
		wave = p
	}
	timeout := 2*time.Minute + time.Duration(wave)*15*time.Second
	kids := make([]*sandbox.Sandbox, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	slots := make(chan struct{}, wave)
	base := len(d.kids)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots <- struct{}{}
			defer func() { <-slots }()
			proc := d.spec.Process
			kids[i], errs[i] = sandbox.RestoreFrozen(ctx, d.frozen, sandbox.RestoreOptions{
				Process: &proc, Timeout: timeout, Logger: d.spec.Logger,
				Hostname: fmt.Sprintf("density-%d", base+i),
			})
		}()
	}
	wg.Wait()
	for _, k := range kids {
		if k != nil {
			d.add(k)
		}
	}
	return errors.Join(errs...)
}

func (d *densityRun) add(kids ...*sandbox.Sandbox) {
	for _, k := range kids {
		d.kids = append(d.kids, k)
		d.pids = append(d.pids, k.PID())
	}
}

// execAll runs true in every sandbox, Parallel at a time (all at once
// without it).
func (d *densityRun) execAll(ctx context.Context) error {
	errs := make([]error, len(d.kids))
	var wg sync.WaitGroup
	wave := len(d.kids)
	if p := d.spec.Parallel; p > 0 && p < wave {
		wave = p
	}
	slots := make(chan struct{}, max(wave, 1))
	for i, k := range d.kids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slots <- struct{}{}
			defer func() { <-slots }()
			if err := snapExecTrue(ctx, k); err != nil {
				errs[i] = fmt.Errorf("sandbox %d: %w", i, err)
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// closeAll closes every sandbox and the template, then looks for a VMM
// process left running (this process's child still alive), kills it and
// says so.
func (d *densityRun) closeAll() (leaked []int, err error) {
	err = closeAll(d.kids)
	if d.frozen != nil {
		err = errors.Join(err, d.frozen.Close())
	}
	if d.parent != nil {
		err = errors.Join(err, d.parent.Close(context.Background()))
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, pid := range d.pids {
		for ownLiveChild(pid) && time.Now().Before(deadline) {
			time.Sleep(100 * time.Millisecond)
		}
		if ownLiveChild(pid) {
			leaked = append(leaked, pid)
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
	if len(leaked) > 0 {
		err = errors.Join(err, fmt.Errorf("bench: density: VMM processes %v still ran after Close (killed)", leaked))
	}
	return leaked, err
}

// ownLiveChild says whether pid is a process of this one's, not a zombie.
func ownLiveChild(pid int) bool {
	p, err := procfs.NewProc(pid)
	if err != nil {
		return false
	}
	st, err := p.Stat()
	if err != nil {
		return false
	}
	return st.PPID == os.Getpid() && st.State != "Z" && st.State != "X"
}

// RunDensity boots the template, makes sandboxes from it step by step and
// measures them, printing each step to progress (nil: nowhere). Whatever
// happens, every sandbox is closed before it returns; a failure returns
// what was measured so far.
func RunDensity(ctx context.Context, spec DensitySpec, progress io.Writer) (rep DensityReport, err error) {
	if spec, err = spec.Normalize(); err != nil {
		return rep, err
	}
	if len(spec.Process.Command) == 0 {
		return rep, errors.New("bench: density: no VMM process command")
	}
	if progress == nil {
		progress = io.Discard
	}
	rep.Spec = spec
	d := &densityRun{spec: spec, progress: progress}
	defer func() {
		leaked, cerr := d.closeAll()
		rep.Leaked = leaked
		if cerr != nil {
			err = errors.Join(err, cerr)
		}
	}()
	if rep.MemTotal, rep.MemAvailable, err = hostMemory(); err != nil {
		return rep, err
	}
	target := spec.Target()
	d.logf("density: %d MiB template, %d vCPU, %s, up to %d sandboxes in steps %v, settle %v; host MemTotal %.0f MiB, MemAvailable %.0f MiB, floor %.0f MiB; load average %s",
		spec.MemoryMiB, spec.CPUs, spec.Method, target, spec.Steps, spec.Settle,
		MiB(rep.MemTotal), MiB(rep.MemAvailable), MiB(spec.Floor), LoadAverage())

	begin := time.Now()
	proc := spec.Process
	d.parent, err = sandbox.Start(ctx, sandbox.Options{
		Runtime: spec.Runtime, CPUs: spec.CPUs, MemoryMiB: spec.MemoryMiB,
		BootTimeout: spec.BootTimeout, Process: &proc, Logger: spec.Logger,
	})
	if err != nil {
		return rep, fmt.Errorf("bench: density: boot the template: %w", err)
	}
	d.pids = append(d.pids, d.parent.PID())
	if err := snapExecTrue(ctx, d.parent); err != nil {
		return rep, fmt.Errorf("bench: density: the template's first %w", err)
	}
	if rep.Template, err = sandboxMem(d.parent); err != nil {
		return rep, err
	}
	d.logf("template booted and answered in %v: guest %v; VMM process PSS %.1f MiB less guest RAM",
		time.Since(begin).Round(time.Millisecond), rep.Template.Guest, MiB(rep.Template.VMMPSS()))
	if spec.Method == DensityTemplate {
		if err := d.parent.Hold(ctx, densityHoldID); err != nil {
			return rep, fmt.Errorf("bench: density: hold the template: %w", err)
		}
		if d.frozen, err = d.parent.Frozen(ctx, densityHoldID); err != nil {
			return rep, fmt.Errorf("bench: density: %w", err)
		}
	}

	// Before any step the estimate is the template's whole PSS (a
	// standalone VM's, far above a clone's); then what the last step
	// measured, with a margin.
	estimate := rep.Template.TotalPSS()
	for _, want := range spec.Steps {
		_, avail, err := hostMemory()
		if err != nil {
			return rep, err
		}
		n := stepSize(want-len(d.kids), avail, spec.Floor, estimate)
		if n < want-len(d.kids) {
			rep.Stopped = fmt.Sprintf("host memory: MemAvailable %.0f MiB, floor %.0f MiB, about %.1f MiB per sandbox: %d more fit of %d",
				MiB(avail), MiB(spec.Floor), MiB(estimate), n, want-len(d.kids))
			d.logf("stopping: %s", rep.Stopped)
			if n == 0 {
				break
			}
		}
		begin := time.Now()
		err = d.start(ctx, n)
		took := time.Since(begin)
		if err != nil {
			rep.Stopped = "error"
			return rep, fmt.Errorf("bench: density: start %d sandboxes (to %d): %w", n, len(d.kids)+n, err)
		}
		d.logf("forked %d/%d (%d new, %s) in %v", len(d.kids), target, n, spec.Method, took.Round(time.Millisecond))
		step := DensityStep{Count: len(d.kids), Start: took}
		if spec.Settle > 0 {
			before, cpuErr := d.kidsOnCPU()
			idleFrom := time.Now()
			select {
			case <-ctx.Done():
				return rep, fmt.Errorf("bench: density: %w", ctx.Err())
			case <-time.After(spec.Settle):
			}
			after, err := d.kidsOnCPU()
			step.Idle = time.Since(idleFrom)
			if cpuErr = errors.Join(cpuErr, err); cpuErr != nil {
				d.logf("  idle CPU not measured: %v", cpuErr)
			} else {
				for i := range after {
					step.IdleCPU = append(step.IdleCPU, after[i]-before[i])
				}
			}
		}
		if err := d.execAll(ctx); err != nil {
			rep.Stopped = "error"
			return rep, fmt.Errorf("bench: density: after %d sandboxes: %w", len(d.kids), err)
		}
		for i, k := range d.kids {
			m, err := sandboxMem(k)
			if err != nil {
				rep.Stopped = "error"
				return rep, fmt.Errorf("bench: density: sandbox %d: %w", i, err)
			}
			step.Sandboxes = append(step.Sandboxes, m)
		}
		if step.Template, err = sandboxMem(d.parent); err != nil {
			return rep, err
		}
		if _, step.MemAvailable, err = hostMemory(); err != nil {
			return rep, err
		}
		if step.MemAvailable < rep.MemAvailable {
			step.HostUsed = rep.MemAvailable - step.MemAvailable
		}
		rep.Steps = append(rep.Steps, step)
		g, v := step.Guest(), step.VMM()
		cpuMean, cpuMax := step.IdleCPUShare()
		d.logf("  %d sandboxes idle %v, each answered exec true: guest PSS mean %.1f MiB (max %.1f), VMM PSS mean %.1f MiB (max %.1f); host used %.0f MiB (%.1f MiB per sandbox), MemAvailable %.0f MiB; idle CPU per sandbox %.2f%% of a CPU (max %.2f%%)",
			step.Count, spec.Settle, MiB(g.Mean), MiB(g.Max), MiB(v.Mean), MiB(v.Max),
			MiB(step.HostUsed), MiB(step.HostPerSandbox()), MiB(step.MemAvailable), 100*cpuMean, 100*cpuMax)
		estimate = max(step.Total().Mean, step.HostPerSandbox()) * 5 / 4
		if rep.Stopped != "" {
			break
		}
		if step.MemAvailable < spec.Floor {
			rep.Stopped = fmt.Sprintf("host memory: MemAvailable %.0f MiB under the floor %.0f MiB", MiB(step.MemAvailable), MiB(spec.Floor))
			d.logf("stopping: %s", rep.Stopped)
			break
		}
	}
	return rep, nil
}

// Print writes the report's table: a row per step, then the fit.
func (r DensityReport) Print(w io.Writer) {
	fmt.Fprintf(w, "density: %d MiB guests (%s), %d vCPU; MiB per sandbox, mean / median / max\n",
		r.Spec.MemoryMiB, r.Spec.Method, r.Spec.CPUs)
	fmt.Fprintf(w, "%10s %22s %22s %22s %10s %12s %10s %12s\n",
		"sandboxes", "guest RAM PSS", "VMM process PSS", "guest + VMM PSS", "guest RSS", "host used", "per sbx", "idle CPU %")
	ms := func(s MemStats) string {
		return fmt.Sprintf("%.1f / %.1f / %.1f", MiB(s.Mean), MiB(s.Median), MiB(s.Max))
	}
	for _, s := range r.Steps {
		idle := "-"
		if mean, _ := s.IdleCPUShare(); len(s.IdleCPU) > 0 {
			idle = fmt.Sprintf("%.2f", 100*mean)
		}
		fmt.Fprintf(w, "%10d %22s %22s %22s %10.1f %12.0f %10.1f %12s\n", s.Count, ms(s.Guest()), ms(s.VMM()), ms(s.Total()),
			MiB(s.GuestRSS().Mean), MiB(s.HostUsed), MiB(s.HostPerSandbox()), idle)
	}
	fmt.Fprintf(w, "template (standalone, before any clone): guest PSS %.1f MiB, VMM PSS %.1f MiB", MiB(r.Template.Guest.Pss), MiB(r.Template.VMMPSS()))
	if l := r.Last(); l != nil {
		fmt.Fprintf(w, "; after the last step: guest PSS %.1f MiB, VMM PSS %.1f MiB", MiB(l.Template.Guest.Pss), MiB(l.Template.VMMPSS()))
	}
	fmt.Fprintln(w)
	if l := r.Last(); l != nil && len(l.Sandboxes) > 0 {
		printVMMMemory(w, l.Count, l.Sandboxes)
	}
	if r.Stopped != "" {
		fmt.Fprintf(w, "stopped before %d: %s\n", r.Spec.Target(), r.Stopped)
	}
	f := r.Fit()
	gib := float64(f.Budget) / (1 << 30)
	switch f.Bound {
	case "budget":
		fmt.Fprintf(w, "fits in %.4g GiB, measured: %d sandboxes (host memory used, template included; the next step went past it)\n", gib, f.Measured)
	default:
		fmt.Fprintf(w, "fits in %.4g GiB, measured: at least %d sandboxes (host memory used, template included, stayed within it; run ended at the %s)\n", gib, f.Measured, f.Bound)
	}
	fmt.Fprintf(w, "fits in %.4g GiB, EXTRAPOLATED (not measured): %d sandboxes = %.4g GiB / (%.1f MiB guest PSS + %.1f MiB VMM PSS per sandbox)\n",
		gib, f.Extrapolated, gib, MiB(f.PerSandbox-r.lastVMM()), MiB(r.lastVMM()))
	if len(r.Leaked) > 0 {
		fmt.Fprintf(w, "LEAK: VMM processes %v still ran after Close (killed)\n", r.Leaked)
	}
}

func (r DensityReport) lastVMM() uint64 {
	if l := r.Last(); l != nil {
		return l.VMM().Mean
	}
	return 0
}
