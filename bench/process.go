package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/prometheus/procfs"

	"github.com/kilnvm/kiln/sandbox"
)

// ProcessSpec configures RunProcess: what a VMM process of its own costs a
// sandbox, beside one in the caller's process, and what each confinement
// of that process (seccomp, the jail) adds.
type ProcessSpec struct {
	// Runtime boots the sandbox that is saved, unless Snapshot is given.
	Runtime sandbox.Runtime
	// Snapshot is a sandbox's snapshot to restore every way; empty: one
	// is booted (MemoryMiB) and saved into a temporary folder.
	Snapshot  string
	MemoryMiB int
	// Process starts a VMM process (kiln-vmm), as it runs by default.
	Process sandbox.ProcessOptions
	// Variants are further ways of running the VMM process, measured
	// after the default one (say, with KILN_SECCOMP=off in its Env, or
	// jailed), in order.
	Variants []ProcessVariant
	// Restores, Execs and Forks are how many restores to an answering
	// agent, execs of `true` and forks of one child each way (1, 20 and
	// 3 when zero). Each way's restores alternate with the others', so
	// that a drift in the host's load spreads over all of them.
	Restores, Execs, Forks int
	BootTimeout            time.Duration
}

// ProcessVariant is one named way of running the VMM process.
type ProcessVariant struct {
	Name    string
	Process sandbox.ProcessOptions
}

// ProcessModeResult is one way of running a sandbox's VM.
type ProcessModeResult struct {
	Name     string
	Restores []time.Duration // each Restore to an answering agent
	Execs    []time.Duration // each exec of `true`, to its exit status
	Forks    []time.Duration // each Fork of one child, to its answering agent
	// VMMPSS is the VMM process's PSS less its guest RAM's (out of
	// process only): what the process itself costs.
	VMMPSS uint64
	// GuestPSS is the guest RAM's PSS.
	GuestPSS uint64
}

// Restore is the median of the mode's restores.
func (r ProcessModeResult) Restore() time.Duration { return Percentile(r.Restores, 50) }

// ProcessReport is RunProcess's result: the in-process way first, then the
// default VMM process, then the variants.
type ProcessReport struct {
	Modes []ProcessModeResult
}

// InProcess is the in-process way's result.
func (rep ProcessReport) InProcess() ProcessModeResult { return rep.mode(0) }

// OutOfProcess is the default VMM process's result.
func (rep ProcessReport) OutOfProcess() ProcessModeResult { return rep.mode(1) }

func (rep ProcessReport) mode(i int) ProcessModeResult {
	if i < len(rep.Modes) {
		return rep.Modes[i]
	}
	return ProcessModeResult{}
}

// RunProcess restores one snapshot in this process, in a VMM process and in
// each variant, times restores, execs and forks in each, and measures the
// VMM process's memory beside the guest's.
func RunProcess(ctx context.Context, spec ProcessSpec, progress io.Writer) (ProcessReport, error) {
	var rep ProcessReport
	if progress == nil {
		progress = io.Discard
	}
	if spec.Restores <= 0 {
		spec.Restores = 1
	}
	if spec.Execs <= 0 {
		spec.Execs = 20
	}
	if spec.Forks <= 0 {
		spec.Forks = 3
	}
	if spec.MemoryMiB <= 0 {
		spec.MemoryMiB = 256
	}
	if len(spec.Process.Command) == 0 {
		return rep, errors.New("bench: no VMM process command")
	}
	for i, v := range spec.Variants {
		if v.Name == "" || len(v.Process.Command) == 0 {
			return rep, fmt.Errorf("bench: process variant %d: want a name and a VMM process command", i)
		}
	}
	snap := spec.Snapshot
	if snap == "" {
		dir, err := os.MkdirTemp("", "kiln-bench-process-")
		if err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
		defer os.RemoveAll(dir)
		snap = filepath.Join(dir, "snap")
		sb, err := sandbox.Start(ctx, sandbox.Options{Runtime: spec.Runtime, MemoryMiB: spec.MemoryMiB, BootTimeout: spec.BootTimeout})
		if err != nil {
			return rep, fmt.Errorf("bench: boot: %w", err)
		}
		err = sb.Save(ctx, snap)
		sb.Close(context.Background())
		if err != nil {
			return rep, fmt.Errorf("bench: save: %w", err)
		}
	}
	type way struct {
		name string
		proc *sandbox.ProcessOptions
	}
	def := spec.Process
	ways := []way{{"in-process", nil}, {"VMM process", &def}}
	for _, v := range spec.Variants {
		ways = append(ways, way{v.Name, &v.Process})
	}
	rep.Modes = make([]ProcessModeResult, len(ways))
	for i, w := range ways {
		rep.Modes[i].Name = w.name
	}
	// The restores beyond each way's first, alternating ways.
	for range spec.Restores - 1 {
		for i, w := range ways {
			d, err := timeRestore(ctx, snap, w.proc, spec)
			if err != nil {
				return rep, fmt.Errorf("bench: %s: %w", w.name, err)
			}
			rep.Modes[i].Restores = append(rep.Modes[i].Restores, d)
		}
	}
	for i, w := range ways {
		if err := measureMode(ctx, snap, w.proc, spec, &rep.Modes[i], progress); err != nil {
			return rep, fmt.Errorf("bench: %s: %w", w.name, err)
		}
	}
	return rep, nil
}

// timeRestore restores snap once, to an answering agent, and closes it.
func timeRestore(ctx context.Context, snap string, proc *sandbox.ProcessOptions, spec ProcessSpec) (time.Duration, error) {
	begin := time.Now()
	sb, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Process: proc, Timeout: spec.BootTimeout})
	if err != nil {
		return 0, err
	}
	d := time.Since(begin)
	return d, sb.Close(context.Background())
}

func measureMode(ctx context.Context, snap string, proc *sandbox.ProcessOptions, spec ProcessSpec, r *ProcessModeResult, progress io.Writer) error {
	begin := time.Now()
	sb, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Process: proc, Timeout: spec.BootTimeout})
	if err != nil {
		return err
	}
	defer sb.Close(context.Background())
	r.Restores = append(r.Restores, time.Since(begin))
	for range spec.Execs {
		begin := time.Now()
		if err := execTrue(ctx, sb.Client()); err != nil {
			return err
		}
		r.Execs = append(r.Execs, time.Since(begin))
	}
	for range spec.Forks {
		begin := time.Now()
		kids, err := sb.Fork(ctx, 1, sandbox.ForkOptions{})
		if err != nil {
			return err
		}
		r.Forks = append(r.Forks, time.Since(begin))
		kids[0].Close(context.Background())
	}
	g, err := GuestUsage(sb)
	if err != nil {
		return err
	}
	r.GuestPSS = g.Pss
	if proc != nil {
		p, err := procfs.NewProc(sb.PID())
		if err != nil {
			return fmt.Errorf("VMM process: %w", err)
		}
		roll, err := p.ProcSMapsRollup()
		if err != nil {
			return fmt.Errorf("VMM process: smaps_rollup: %w", err)
		}
		if roll.Pss > g.Pss {
			r.VMMPSS = roll.Pss - g.Pss
		}
	}
	fmt.Fprintf(progress, "%s: restore median %v, exec median %v, fork median %v, guest PSS %.1f MiB, VMM PSS %.1f MiB\n",
		r.Name, r.Restore().Round(time.Millisecond), Percentile(r.Execs, 50).Round(time.Microsecond),
		Percentile(r.Forks, 50).Round(time.Millisecond), MiB(r.GuestPSS), MiB(r.VMMPSS))
	return nil
}

// Print writes the report as a table: a column per way, and each way's
// ratio to the in-process one.
func (rep ProcessReport) Print(w io.Writer) {
	if len(rep.Modes) == 0 {
		return
	}
	in := rep.Modes[0]
	ratio := func(a, b time.Duration) string {
		if b <= 0 {
			return "-"
		}
		return fmt.Sprintf("(%.2fx)", float64(a)/float64(b))
	}
	row := func(label string, pick func(ProcessModeResult) time.Duration, round time.Duration) {
		fmt.Fprintf(w, "%-24s", label)
		for i, m := range rep.Modes {
			v := pick(m).Round(round)
			if i == 0 {
				fmt.Fprintf(w, " %22v", v)
			} else {
				fmt.Fprintf(w, " %13v %8s", v, ratio(pick(m), pick(in)))
			}
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "%-24s", "")
	for _, m := range rep.Modes {
		fmt.Fprintf(w, " %22s", m.Name)
	}
	fmt.Fprintln(w)
	p := func(q float64, pick func(ProcessModeResult) []time.Duration) func(ProcessModeResult) time.Duration {
		return func(m ProcessModeResult) time.Duration { return Percentile(pick(m), q) }
	}
	restores := func(m ProcessModeResult) []time.Duration { return m.Restores }
	execs := func(m ProcessModeResult) []time.Duration { return m.Execs }
	forks := func(m ProcessModeResult) []time.Duration { return m.Forks }
	row(fmt.Sprintf("restore p50 (n=%d)", len(in.Restores)), p(50, restores), time.Millisecond)
	row("restore p95", p(95, restores), time.Millisecond)
	row(fmt.Sprintf("exec true p50 (n=%d)", len(in.Execs)), p(50, execs), time.Microsecond)
	row("exec true p95", p(95, execs), time.Microsecond)
	row(fmt.Sprintf("fork of 1 p50 (n=%d)", len(in.Forks)), p(50, forks), time.Millisecond)
	fmt.Fprintf(w, "%-24s", "guest RAM PSS (MiB)")
	for _, m := range rep.Modes {
		fmt.Fprintf(w, " %22.1f", MiB(m.GuestPSS))
	}
	fmt.Fprintln(w)
	fmt.Fprintf(w, "%-24s %22s", "VMM process PSS (MiB)", "-")
	for _, m := range rep.Modes[1:] {
		fmt.Fprintf(w, " %22.1f", MiB(m.VMMPSS))
	}
	fmt.Fprintln(w)
}
