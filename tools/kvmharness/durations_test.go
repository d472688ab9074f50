package main

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestParseDurations(t *testing.T) {
	tests := []struct {
		name, in string
		want     map[string]time.Duration
		err      string
	}{
		{"empty", "", map[string]time.Duration{}, ""},
		{"comments and blanks", "# x\n\nTestKVMA 12.5\n  TestKVMB 3\n", map[string]time.Duration{"TestKVMA": 12500 * time.Millisecond, "TestKVMB": 3 * time.Second}, ""},
		{"three fields", "TestKVMA 1 2\n", nil, "line 1"},
		{"not a number", "TestKVMA x\n", nil, "line 1"},
		{"negative", "# c\nTestKVMA -1\n", nil, "line 2"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := parseDurations(strings.NewReader(tt.in))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err %v, want one naming %q", err, tt.err)
				}
				return
			}
			if err != nil || len(got) != len(tt.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tt.want)
			}
			for k, v := range tt.want {
				if got[k] != v {
					t.Errorf("%s = %v, want %v", k, got[k], v)
				}
			}
		})
	}
}

func TestDurationsRoundTrip(t *testing.T) {
	in := map[string]time.Duration{"TestKVMA": 5 * time.Second, "TestKVMB": 300 * time.Second, "TestKVMC": 5 * time.Second}
	var b bytes.Buffer
	if err := writeDurations(&b, in); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if got := lines[len(lines)-3:]; strings.Join(got, ",") != "TestKVMB 300.0,TestKVMA 5.0,TestKVMC 5.0" {
		t.Fatalf("order: %q", got)
	}
	back, err := parseDurations(&b)
	if err != nil || len(back) != 3 || back["TestKVMB"] != 300*time.Second {
		t.Fatalf("back: %v %v", back, err)
	}
	if _, err := parseDurations(strings.NewReader(expectedDurations)); err != nil {
		t.Fatalf("the embedded durations.txt: %v", err)
	}
}

func TestLongestFirst(t *testing.T) {
	names := []string{"TestKVMShort", "TestKVMNew", "TestKVMLong", "TestKVMSMP", "TestKVMMid"}
	expected := map[string]time.Duration{"TestKVMShort": 10 * time.Second, "TestKVMLong": 400 * time.Second, "TestKVMSMP": 20 * time.Second, "TestKVMMid": 90 * time.Second}
	weight := func(i int) int {
		if names[i] == "TestKVMSMP" {
			return 2
		}
		return 1
	}
	phase := []int{0, 1, 2, 3, 4}
	got := longestFirst(phase, names, weight, expected)
	var order []string
	for _, i := range got {
		order = append(order, names[i])
	}
	// TestKVMNew is unknown (90 s, like TestKVMMid, and before it: ties keep the given order).
	if want := "TestKVMSMP TestKVMLong TestKVMNew TestKVMMid TestKVMShort"; strings.Join(order, " ") != want {
		t.Fatalf("order %q, want %q", order, want)
	}
	if phase[0] != 0 || phase[4] != 4 {
		t.Fatal("longestFirst reordered its input")
	}
}
