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
// sandbox, beside one in the caller's process.
type ProcessSpec struct {
	// Runtime boots the sandbox that is saved, unless Snapshot is given.
	Runtime sandbox.Runtime
	// Snapshot is a sandbox's snapshot to restore both ways; empty: one
	// is booted (MemoryMiB) and saved into a temporary folder.
	Snapshot  string
	MemoryMiB int
	// Process starts a VMM process (`kiln vmm`).
	Process sandbox.ProcessOptions
	// Execs and Forks are how many execs of `true` and forks of one
	// child each way (20 and 3 when zero).
	Execs, Forks int
	BootTimeout  time.Duration
}

// ProcessModeResult is one way of running a sandbox's VM.
type ProcessModeResult struct {
	Restore time.Duration   // Restore to an answering agent
	Execs   []time.Duration // each exec of `true`, to its exit status
	Forks   []time.Duration // each Fork of one child, to its answering agent
	// VMMPSS is the VMM process's PSS less its guest RAM's (out of
	// process only): what the process itself costs.
	VMMPSS uint64
	// GuestPSS is the guest RAM's PSS.
	GuestPSS uint64
}

// ProcessReport is RunProcess's result.
type ProcessReport struct {
	InProcess, OutOfProcess ProcessModeResult
}

// RunProcess restores one snapshot in this process and in a VMM process,
// and times execs and forks in each, and measures the VMM process's
// memory beside the guest's.
func RunProcess(ctx context.Context, spec ProcessSpec, progress io.Writer) (ProcessReport, error) {
	var rep ProcessReport
	if progress == nil {
		progress = io.Discard
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
	var err error
	if rep.InProcess, err = measureMode(ctx, snap, nil, spec, progress); err != nil {
		return rep, fmt.Errorf("bench: in-process: %w", err)
	}
	proc := spec.Process
	if rep.OutOfProcess, err = measureMode(ctx, snap, &proc, spec, progress); err != nil {
		return rep, fmt.Errorf("bench: out-of-process: %w", err)
	}
	return rep, nil
}

func measureMode(ctx context.Context, snap string, proc *sandbox.ProcessOptions, spec ProcessSpec, progress io.Writer) (ProcessModeResult, error) {
	var r ProcessModeResult
	who := "in-process"
	if proc != nil {
		who = "out-of-process"
	}
	begin := time.Now()
	sb, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Process: proc, Timeout: spec.BootTimeout})
	if err != nil {
		return r, err
	}
	defer sb.Close(context.Background())
	r.Restore = time.Since(begin)
	for range spec.Execs {
		begin := time.Now()
		if err := execTrue(ctx, sb.Client()); err != nil {
			return r, err
		}
		r.Execs = append(r.Execs, time.Since(begin))
	}
	for range spec.Forks {
		begin := time.Now()
		kids, err := sb.Fork(ctx, 1, sandbox.ForkOptions{})
		if err != nil {
			return r, err
		}
		r.Forks = append(r.Forks, time.Since(begin))
		kids[0].Close(context.Background())
	}
	g, err := GuestUsage(sb)
	if err != nil {
		return r, err
	}
	r.GuestPSS = g.Pss
	if proc != nil {
		p, err := procfs.NewProc(sb.PID())
		if err != nil {
			return r, fmt.Errorf("VMM process: %w", err)
		}
		roll, err := p.ProcSMapsRollup()
		if err != nil {
			return r, fmt.Errorf("VMM process: smaps_rollup: %w", err)
		}
		if roll.Pss > g.Pss {
			r.VMMPSS = roll.Pss - g.Pss
		}
	}
	fmt.Fprintf(progress, "%s: restore %v, exec median %v, fork median %v, guest PSS %.1f MiB, VMM PSS %.1f MiB\n",
		who, r.Restore.Round(time.Millisecond), Percentile(r.Execs, 50).Round(time.Microsecond),
		Percentile(r.Forks, 50).Round(time.Millisecond), MiB(r.GuestPSS), MiB(r.VMMPSS))
	return r, nil
}

// Print writes the report as a table, with the out-of-process over
// in-process ratios.
func (rep ProcessReport) Print(w io.Writer) {
	in, out := rep.InProcess, rep.OutOfProcess
	ratio := func(a, b time.Duration) string {
		if b <= 0 {
			return "-"
		}
		return fmt.Sprintf("%.2f", float64(a)/float64(b))
	}
	fmt.Fprintf(w, "%-28s %14s %14s %8s\n", "", "in-process", "VMM process", "ratio")
	fmt.Fprintf(w, "%-28s %14v %14v %8s\n", "restore to agent", in.Restore.Round(time.Millisecond), out.Restore.Round(time.Millisecond), ratio(out.Restore, in.Restore))
	fmt.Fprintf(w, "%-28s %14v %14v %8s\n", "exec true (median)", Percentile(in.Execs, 50).Round(time.Microsecond), Percentile(out.Execs, 50).Round(time.Microsecond), ratio(Percentile(out.Execs, 50), Percentile(in.Execs, 50)))
	fmt.Fprintf(w, "%-28s %14v %14v %8s\n", "exec true (p95)", Percentile(in.Execs, 95).Round(time.Microsecond), Percentile(out.Execs, 95).Round(time.Microsecond), ratio(Percentile(out.Execs, 95), Percentile(in.Execs, 95)))
	fmt.Fprintf(w, "%-28s %14v %14v %8s\n", "fork of 1 (median)", Percentile(in.Forks, 50).Round(time.Millisecond), Percentile(out.Forks, 50).Round(time.Millisecond), ratio(Percentile(out.Forks, 50), Percentile(in.Forks, 50)))
	fmt.Fprintf(w, "%-28s %14.1f %14.1f\n", "guest RAM PSS (MiB)", MiB(in.GuestPSS), MiB(out.GuestPSS))
	fmt.Fprintf(w, "%-28s %14s %14.1f\n", "VMM process PSS (MiB)", "-", MiB(out.VMMPSS))
}
