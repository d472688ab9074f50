package main

import (
	"bytes"
	"regexp"
	"strings"
	"testing"
	"time"
)

// closingLines returns the last two lines of a summary, which CI parses.
func closingLines(s string) string {
	lines := strings.SplitAfter(s, "\n")
	if len(lines) < 3 {
		return s
	}
	return strings.Join(lines[len(lines)-3:], "")
}

// closingRE matches a summary's end: the KVM line, then the suite line.
var closingRE = regexp.MustCompile(`(?:^|\n)KVM tests: \d+ ran, \d+ passed, \d+ failed, \d+ skipped(?:, \d+ flaky)? \(mode: \w+\)\n\d+ passed, \d+ failed, \d+ skipped\n$`)

func TestTally(t *testing.T) {
	ev := func(action, test string) event { return event{Action: action, Package: "p", Test: test} }
	tests := []struct {
		name        string
		outside     bool
		events      []event
		wantSummary string
		wantReasons []string
	}{
		{
			name:        "all pass",
			events:      []event{ev("pass", "TestA"), ev("pass", "TestA/sub"), ev("pass", "TestKVMBoot"), ev("pass", "")},
			wantSummary: "KVM tests: 1 ran, 1 passed, 0 failed, 0 skipped (mode: m)\n3 passed, 0 failed, 0 skipped\n",
		},
		{
			name:        "no KVM test",
			events:      []event{ev("pass", "TestA")},
			wantSummary: "KVM tests: 0 ran, 0 passed, 0 failed, 0 skipped (mode: m)\n1 passed, 0 failed, 0 skipped\n",
			wantReasons: []string{"no KVM test ran"},
		},
		{
			name:        "KVM skipped",
			events:      []event{ev("skip", "TestKVMBoot"), ev("skip", "TestOther")},
			wantSummary: "KVM tests: 1 ran, 0 passed, 0 failed, 1 skipped (mode: m)\n0 passed, 0 failed, 2 skipped\n",
			wantReasons: []string{"KVM test skipped (KVM tests must run): p TestKVMBoot"},
		},
		{
			name:        "KVM subtest skip counts in the suite only",
			events:      []event{ev("skip", "TestKVMBoot/case"), ev("pass", "TestKVMBoot")},
			wantSummary: "KVM tests: 1 ran, 1 passed, 0 failed, 0 skipped (mode: m)\n1 passed, 0 failed, 1 skipped\n",
		},
		{
			name:        "failure",
			events:      []event{ev("fail", "TestKVMBoot"), ev("fail", ""), ev("output", "TestKVMBoot")},
			wantSummary: "KVM tests: 1 ran, 0 passed, 1 failed, 0 skipped (mode: m)\n0 passed, 1 failed, 0 skipped\n",
			wantReasons: []string{"failed: p TestKVMBoot", "package failed: p"},
		},
		{
			name:        "outside ignores KVM passes and skips, not failures",
			outside:     true,
			events:      []event{ev("skip", "TestKVMBoot"), ev("pass", "TestKVMOther"), ev("fail", "TestKVMBad"), ev("pass", "TestA")},
			wantSummary: "KVM tests: 1 ran, 0 passed, 1 failed, 0 skipped (mode: m)\n1 passed, 1 failed, 0 skipped\n",
			wantReasons: []string{"failed: p TestKVMBad"},
		},
		{
			name:        "build failure",
			events:      []event{{Action: "build-fail", ImportPath: "q [q.test]"}, ev("pass", "TestKVMBoot")},
			wantSummary: "KVM tests: 1 ran, 1 passed, 0 failed, 0 skipped (mode: m)\n1 passed, 0 failed, 0 skipped\n",
			wantReasons: []string{"package failed: q [q.test]"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ty := newTally()
			for _, e := range tt.events {
				ty.add(e, tt.outside)
			}
			var buf bytes.Buffer
			ty.summary(&buf, "m")
			if got := closingLines(buf.String()); got != tt.wantSummary {
				t.Errorf("summary ends:\n%s\nwant:\n%s", got, tt.wantSummary)
			}
			got := ty.reasons()
			if len(got) != len(tt.wantReasons) {
				t.Fatalf("reasons %q, want %q", got, tt.wantReasons)
			}
			for i := range got {
				if !strings.Contains(got[i], tt.wantReasons[i]) {
					t.Errorf("reason %d = %q, want it to contain %q", i, got[i], tt.wantReasons[i])
				}
			}
		})
	}
}

func TestReadEvents(t *testing.T) {
	in := `{"Action":"run","Package":"p","Test":"TestA"}
{"Action":"output","Package":"p","Test":"TestA","Output":"=== RUN   TestA\n"}
not json at all
{"Action":"pass","Package":"p","Test":"TestA","Elapsed":0.5}
{"Action":"pass","Package":"p"}
trailing without newline`
	var got []event
	if err := readEvents(strings.NewReader(in), func(e event) { got = append(got, e) }); err != nil {
		t.Fatal(err)
	}
	want := []event{
		{Action: "run", Package: "p", Test: "TestA"},
		{Action: "output", Package: "p", Test: "TestA", Output: "=== RUN   TestA\n"},
		{Action: "output", Output: "not json at all\n"},
		{Action: "pass", Package: "p", Test: "TestA", Elapsed: 0.5},
		{Action: "pass", Package: "p"},
		{Action: "output", Output: "trailing without newline"},
	}
	if len(got) != len(want) {
		t.Fatalf("got %d events %+v, want %d", len(got), got, len(want))
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("event %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}

func FuzzReadEvents(f *testing.F) {
	f.Add([]byte(`{"Action":"pass","Package":"p","Test":"TestKVMX"}` + "\n"))
	f.Add([]byte("{\"Action\":\"fail\"}\nPASS\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		ty := newTally()
		n := 0
		err := readEvents(bytes.NewReader(in), func(e event) {
			n++
			ty.add(e, n%2 == 0)
		})
		if err != nil {
			t.Fatal(err)
		}
		if ty.kvmPassed > ty.passed || ty.kvmFailed > ty.failed || ty.kvmSkipped > ty.skipped {
			t.Fatalf("KVM counts exceed the suite's: %+v", ty)
		}
		if len(ty.failedTests) != ty.failed {
			t.Fatalf("%d failed tests listed, %d counted", len(ty.failedTests), ty.failed)
		}
		var buf bytes.Buffer
		ty.summary(&buf, "m")
		if !closingRE.MatchString(buf.String()) {
			t.Fatalf("summary does not end with the closing lines:\n%s", buf.String())
		}
	})
}

func TestSlowest(t *testing.T) {
	d := func(name string, s float64) testDuration { return testDuration{name: name, elapsed: seconds(s)} }
	tests := []struct {
		name string
		in   []testDuration
		n    int
		want string
	}{
		{"none", nil, 5, ""},
		{"fewer than n", []testDuration{d("a", 1), d("b", 3)}, 5, "b a"},
		{"the n longest, longest first", []testDuration{d("a", 1), d("b", 7), d("c", 3), d("d", 9), d("e", 0.5), d("f", 4), d("g", 2)}, 5, "d b f c g"},
		{"ties by name", []testDuration{d("z", 2), d("y", 2), d("x", 1)}, 2, "y z"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var names []string
			for _, x := range slowest(tt.in, tt.n) {
				names = append(names, x.name)
			}
			if got := strings.Join(names, " "); got != tt.want {
				t.Errorf("slowest = %q, want %q", got, tt.want)
			}
		})
	}
	in := []testDuration{d("a", 1), d("b", 2)}
	slowest(in, 1)
	if in[0].name != "a" {
		t.Error("slowest reordered its input")
	}
}

func TestSummaryTimings(t *testing.T) {
	ev := func(action, test string, elapsed float64) event {
		return event{Action: action, Package: "p", Test: test, Elapsed: elapsed}
	}
	tests := []struct {
		name     string
		events   []event
		wall     time.Duration
		parallel int
		want     string
	}{
		{
			name: "tcg: wall, parallelism and the five slowest KVM tests",
			events: []event{
				ev("pass", "TestKVMA", 12.3), ev("pass", "TestKVMA/sub", 99), ev("pass", "TestUnit", 500),
				ev("pass", "TestKVMB", 61.25), ev("fail", "TestKVMC", 3), ev("pass", "TestKVMD", 0.04),
				ev("skip", "TestKVME", 0), ev("pass", "TestKVMF", 45), ev("output", "TestKVMG", 1000),
			},
			wall: 3*time.Minute + 2*time.Second + 345*time.Millisecond, parallel: 2,
			want: "Suite wall time: 3m2.3s; KVM tests in L1: 2m30s for 4m50s of L1 VMs, up to 2 at once\n" +
				"Slowest KVM tests:\n" +
				"     1m1.3s  p TestKVMB\n" +
				"        45s  p TestKVMF\n" +
				"      12.3s  p TestKVMA\n" +
				"         3s  p TestKVMC\n" +
				"         0s  p TestKVMD\n" +
				"FLAKY: L1 hung; reran p TestKVMC\n" +
				"KVM tests: 6 ran, 4 passed, 1 failed, 1 skipped, 1 flaky (mode: m)\n" +
				"6 passed, 1 failed, 1 skipped\n",
		},
		{
			name:   "direct: no L1 count",
			events: []event{ev("pass", "TestKVMA", 1.5)},
			wall:   10 * time.Second,
			want: "Suite wall time: 10s\n" +
				"Slowest KVM tests:\n" +
				"       1.5s  p TestKVMA\n" +
				"KVM tests: 1 ran, 1 passed, 0 failed, 0 skipped (mode: m)\n" +
				"1 passed, 0 failed, 0 skipped\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ty := newTally()
			for _, e := range tt.events {
				ty.add(e, false)
			}
			if tt.parallel > 0 {
				ty.l1Retries = []string{"L1 hung; reran p TestKVMC"}
			}
			ty.wall, ty.l1Parallel = tt.wall, tt.parallel
			if tt.parallel > 0 {
				ty.l1Wall, ty.l1Time = 150*time.Second, 290*time.Second
			}
			var buf bytes.Buffer
			ty.summary(&buf, "m")
			if buf.String() != tt.want {
				t.Errorf("summary:\n%s\nwant:\n%s", buf.String(), tt.want)
			}
			if !closingRE.MatchString(buf.String()) {
				t.Error("the closing lines are not last")
			}
		})
	}
}
