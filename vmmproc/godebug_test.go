package vmmproc

import (
	"slices"
	"testing"
)

func TestWithGODEBUG(t *testing.T) {
	for _, c := range []struct {
		name    string
		in, out []string
	}{
		{"none", []string{"A=1"}, []string{"A=1", "GODEBUG=disablethp=1"}},
		{"empty", []string{"GODEBUG="}, []string{"GODEBUG=disablethp=1"}},
		{"the parent's come after, so they win", []string{"GODEBUG=disablethp=0,gctrace=1"}, []string{"GODEBUG=disablethp=1,disablethp=0,gctrace=1"}},
		{"the last entry is the one used", []string{"GODEBUG=a=1", "B=2", "GODEBUG=b=1"}, []string{"GODEBUG=a=1", "B=2", "GODEBUG=disablethp=1,b=1"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			if got := withGODEBUG(slices.Clone(c.in)); !slices.Equal(got, c.out) {
				t.Errorf("withGODEBUG(%q) = %q, want %q", c.in, got, c.out)
			}
		})
	}
}
