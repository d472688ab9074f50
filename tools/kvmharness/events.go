package main

import (
	"bufio"
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"time"
)

// event is one line of `go test -json` (cmd/test2json) output.
type event struct {
	Action     string
	Package    string
	ImportPath string // build-output and build-fail events (Go 1.24+)
	Test       string
	Output     string
	Elapsed    float64
}

// kvmTest reports whether a test name belongs to a top-level TestKVM... test.
func kvmTest(name string) bool {
	top, _, _ := strings.Cut(name, "/")
	return strings.HasPrefix(top, "TestKVM")
}

// topLevel reports whether name is a top-level test, not a subtest.
func topLevel(name string) bool { return name != "" && !strings.Contains(name, "/") }

// tally counts test results across one or more `go test -json` streams.
type tally struct {
	passed, failed, skipped          int
	kvmPassed, kvmFailed, kvmSkipped int

	failedTests  []string // "pkg TestName"
	flaky        []string // "pkg TestName": failed in L1, passed when run again
	l1Retries    []string // why an L1 VM was replaced by a fresh one
	skippedKVM   []string
	failedPkgs   map[string]bool
	problems     []string // failures that are not test results
	seenPackages map[string]bool

	// durations holds each counted top-level KVM test's elapsed time
	// (test2json's Elapsed), for the slowest-tests report.
	durations []testDuration
	// wall is the suite's wall time; l1Wall that of its L1 phase (tcg),
	// l1Time the sum of its L1 VMs' run times, and l1Parallel how many ran
	// at once at most (0: none ran). summary reports them.
	wall, l1Wall, l1Time time.Duration
	l1Parallel           int
}

// testDuration is how long one test ran.
type testDuration struct {
	name    string // "pkg TestName"
	elapsed time.Duration
}

// slowestShown is how many of the slowest KVM tests summary lists.
const slowestShown = 5

// slowest returns the n longest of ds, longest first (ties by name).
func slowest(ds []testDuration, n int) []testDuration {
	s := slices.Clone(ds)
	slices.SortStableFunc(s, func(a, b testDuration) int {
		if c := cmp.Compare(b.elapsed, a.elapsed); c != 0 {
			return c
		}
		return cmp.Compare(a.name, b.name)
	})
	return s[:min(n, len(s))]
}

// seconds converts test2json's Elapsed (seconds) to a duration.
func seconds(s float64) time.Duration {
	return time.Duration(s * float64(time.Second)).Round(time.Millisecond)
}

func newTally() *tally {
	return &tally{failedPkgs: map[string]bool{}, seenPackages: map[string]bool{}}
}

// add counts one event. With outside set, the events come from the run that
// leaves KVM tests to the L1 VM: their skips and passes there are not counted
// (they run again in L1), their failures are.
func (t *tally) add(ev event, outside bool) {
	pkg := ev.Package
	if pkg == "" {
		pkg = ev.ImportPath
	}
	switch ev.Action {
	case "build-fail":
		t.failedPkgs[pkg] = true
		return
	case "pass", "fail", "skip":
	default:
		return
	}
	if ev.Test == "" {
		t.seenPackages[pkg] = true
		if ev.Action == "fail" {
			t.failedPkgs[pkg] = true
		}
		return
	}
	kvm := kvmTest(ev.Test)
	if outside && kvm && ev.Action != "fail" {
		return
	}
	name := pkg + " " + ev.Test
	switch ev.Action {
	case "pass":
		t.passed++
	case "fail":
		t.failed++
		t.failedTests = append(t.failedTests, name)
	case "skip":
		t.skipped++
	}
	if !kvm || !topLevel(ev.Test) {
		return
	}
	t.durations = append(t.durations, testDuration{name: name, elapsed: seconds(ev.Elapsed)})
	switch ev.Action {
	case "pass":
		t.kvmPassed++
	case "fail":
		t.kvmFailed++
	case "skip":
		t.kvmSkipped++
		t.skippedKVM = append(t.skippedKVM, name)
	}
}

// problem records a failure that no test event shows.
func (t *tally) problem(format string, args ...any) {
	t.problems = append(t.problems, fmt.Sprintf(format, args...))
}

// failing reports whether a test or package failure was counted.
func (t *tally) failing() bool { return t.failed > 0 || len(t.failedPkgs) > 0 }

func (t *tally) kvmRan() int { return t.kvmPassed + t.kvmFailed + t.kvmSkipped }

// reasons lists why the run fails; empty when it passes.
func (t *tally) reasons() []string {
	var r []string
	for _, name := range t.failedTests {
		r = append(r, "failed: "+name)
	}
	pkgs := make([]string, 0, len(t.failedPkgs))
	for p := range t.failedPkgs {
		pkgs = append(pkgs, p)
	}
	sort.Strings(pkgs)
	for _, p := range pkgs {
		r = append(r, "package failed: "+p)
	}
	r = append(r, t.problems...)
	for _, name := range t.skippedKVM {
		r = append(r, "KVM test skipped (KVM tests must run): "+name)
	}
	if t.kvmRan() == 0 {
		r = append(r, "no KVM test ran (tests named TestKVM... that call kvmtest.Require)")
	}
	return r
}

// timings writes the suite's wall time and its slowest KVM tests.
func (t *tally) timings(w io.Writer) {
	if t.wall > 0 {
		l1 := ""
		if t.l1Parallel > 0 {
			l1 = fmt.Sprintf("; KVM tests in L1: %v for %v of L1 VMs, up to %d at once",
				t.l1Wall.Round(100*time.Millisecond), t.l1Time.Round(100*time.Millisecond), t.l1Parallel)
		}
		fmt.Fprintf(w, "Suite wall time: %v%s\n", t.wall.Round(100*time.Millisecond), l1)
	}
	top := slowest(t.durations, slowestShown)
	if len(top) == 0 {
		return
	}
	fmt.Fprintf(w, "Slowest KVM tests:\n")
	for _, d := range top {
		fmt.Fprintf(w, "  %9s  %s\n", d.elapsed.Round(100*time.Millisecond), d.name)
	}
}

// summary writes the timings, the flaky tests, and the closing lines: the
// KVM line and the suite line, last.
func (t *tally) summary(w io.Writer, mode string) {
	t.timings(w)
	for _, r := range t.l1Retries {
		fmt.Fprintf(w, "FLAKY: %s\n", r)
	}
	for _, name := range t.flaky {
		fmt.Fprintf(w, "FLAKY: %s failed in L1, then passed when run again\n", name)
	}
	flaky := ""
	if n := len(t.flaky) + len(t.l1Retries); n > 0 {
		flaky = fmt.Sprintf(", %d flaky", n)
	}
	fmt.Fprintf(w, "KVM tests: %d ran, %d passed, %d failed, %d skipped%s (mode: %s)\n",
		t.kvmRan(), t.kvmPassed, t.kvmFailed, t.kvmSkipped, flaky, mode)
	fmt.Fprintf(w, "%d passed, %d failed, %d skipped\n", t.passed, t.failed, t.skipped)
}

// readEvents decodes `go test -json` lines from r, calling fn for each. A
// line that is not a JSON event is passed on as output, so nothing is lost.
func readEvents(r io.Reader, fn func(event)) error {
	br := bufio.NewReaderSize(r, 64*1024)
	for {
		line, err := br.ReadBytes('\n')
		if len(line) > 0 {
			var ev event
			if jerr := json.Unmarshal(line, &ev); jerr != nil || ev.Action == "" {
				ev = event{Action: "output", Output: string(line)}
			}
			fn(ev)
		}
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}
