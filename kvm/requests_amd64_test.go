package kvm

import (
	"os"
	"regexp"
	"testing"
)

// TestIoctlRequestsComplete checks that IoctlRequests lists every request
// number the package declares (a missing one would be killed by the VMM's
// seccomp filter), and no number twice.
func TestIoctlRequestsComplete(t *testing.T) {
	decl := regexp.MustCompile(`(?m)^\s+(req[A-Z][A-Za-z0-9]*)\s+=`)
	var names []string
	for _, f := range []string{"numbers_amd64.go", "vcpu_state.go"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range decl.FindAllSubmatch(b, -1) {
			names = append(names, string(m[1]))
		}
	}
	src, err := os.ReadFile("requests_amd64.go")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if !regexp.MustCompile(`\b` + n + `\b`).Match(src) {
			t.Errorf("%s is declared but not in IoctlRequests", n)
		}
	}
	got := IoctlRequests()
	if len(got) != len(names) {
		t.Errorf("IoctlRequests has %d numbers, the package declares %d", len(got), len(names))
	}
	seen := map[uintptr]bool{}
	for _, r := range got {
		if seen[r] {
			t.Errorf("request %#x listed twice", r)
		}
		seen[r] = true
	}
}
