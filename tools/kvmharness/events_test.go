package main

import (
	"bytes"
	"strings"
	"testing"
)

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
			if buf.String() != tt.wantSummary {
				t.Errorf("summary:\n%s\nwant:\n%s", buf.String(), tt.wantSummary)
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
		lines := strings.Split(strings.TrimSuffix(buf.String(), "\n"), "\n")
		if len(lines) != 2 {
			t.Fatalf("summary has %d lines", len(lines))
		}
	})
}
