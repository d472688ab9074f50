package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/report"
	"github.com/kilnvm/kiln/bench/results"
)

// cmdBenchReport runs `kiln bench report`: results files into tables and
// plots.
func cmdBenchReport(_ context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln bench report", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kiln bench report [-o DIR] RESULTS.json...")
		fs.PrintDefaults()
	}
	out := fs.String("o", "bench-report", "folder for tables.md and the SVG plots")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return exitUsage
	}
	var runs []*results.Run
	for _, p := range fs.Args() {
		r, err := results.ReadFile(p)
		if err != nil {
			fmt.Fprintf(stderr, "kiln bench report: %v\n", err)
			return exitUsage
		}
		runs = append(runs, r)
	}
	groups, err := report.Groups(runs)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench report: %v\n", err)
		return exitUsage
	}
	files, err := report.WritePlots(*out, groups)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench report: %v\n", err)
		return exitInternal
	}
	curves, err := report.Curves(groups)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench report: %v\n", err)
		return exitUsage
	}
	curveFiles, err := report.WriteCurves(*out, curves)
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench report: %v\n", err)
		return exitInternal
	}
	f, err := os.Create(filepath.Join(*out, "tables.md"))
	if err != nil {
		fmt.Fprintf(stderr, "kiln bench report: %v\n", err)
		return exitInternal
	}
	report.WriteTables(io.MultiWriter(f, stdout), groups)
	if len(curveFiles) > 0 {
		fmt.Fprintln(f, "\n### Curves: density, fork scaling, concurrency")
		for i, name := range curveFiles {
			fmt.Fprintf(f, "\n%s\n\n![%s](%s)\n", report.CurveTitle(curves[i]), name, name)
		}
		fmt.Fprintln(f, "\n### CDFs")
	}
	for _, name := range files {
		fmt.Fprintf(f, "\n![%s](%s)\n", name, name)
	}
	if err := f.Close(); err != nil {
		fmt.Fprintf(stderr, "kiln bench report: %v\n", err)
		return exitInternal
	}
	fmt.Fprintf(stdout, "\n%d CDF plots, %d curves and tables.md in %s\n", len(files), len(curveFiles), *out)
	return exitOK
}

// newResults starts a results file for this machine (bench.DetectEnv;
// kvmMode, when set, instead of the mode it detects).
func newResults(kvmMode string) *results.Run {
	env := bench.DetectEnv(kvmMode)
	return &results.Run{Version: results.Version, Started: env.Time, Commit: env.Commit, KVMMode: env.KVM,
		Machine: results.Machine{Host: env.Host, CPU: env.CPU, CPUs: env.CPUs, Kernel: env.Kernel, Arch: runtime.GOARCH, HugePages: env.HugePages}}
}
