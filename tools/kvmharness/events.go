package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"sort"
	"strings"
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

// summary writes the closing lines: the KVM line and the suite line, last.
func (t *tally) summary(w io.Writer, mode string) {
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
