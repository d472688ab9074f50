package main

import (
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

// TestPlaceVM: kiln run and kiln fork run each VM in a VMM process by
// default, jailed where kilnd would jail (root, a cgo-free kiln), with
// the reason when not; --in-process (or the old --vmm-process=false)
// keeps it here; contradictory flags are errors naming them.
func TestPlaceVM(t *testing.T) {
	noCgo := kvmtest.VMMBinary(t) // kiln, built with CGO_ENABLED=0
	for _, c := range []struct {
		name  string
		args  []string
		euid  int
		self  string
		want  placement
		why   string // in want.why, or in the error when err
		isErr bool
	}{
		{"default, root, no cgo: jailed", nil, 0, noCgo, placement{jail: true}, "", false},
		{"default, not root: VMM process", nil, 1000, noCgo, placement{}, "uid 1000, not root", false},
		{"default, root, unreadable binary: VMM process", nil, 0, "/nonexistent/kiln", placement{}, "cannot tell how", false},
		{"--jail=false: VMM process", []string{"--jail=false"}, 0, noCgo, placement{}, "--jail=false", false},
		{"--jail, root: jailed", []string{"--jail"}, 0, noCgo, placement{jail: true}, "", false},
		{"--jail=auto, root: jailed", []string{"--jail=auto"}, 0, noCgo, placement{jail: true}, "", false},
		{"--jail, not root: error", []string{"--jail"}, 1000, noCgo, placement{}, "--jail: running as uid 1000, not root", true},
		{"--in-process", []string{"--in-process"}, 0, noCgo, placement{inProcess: true}, "", false},
		{"--in-process --jail=false", []string{"--in-process", "--jail=false"}, 0, noCgo, placement{inProcess: true}, "", false},
		{"--vmm-process=false: in process", []string{"--vmm-process=false"}, 0, noCgo, placement{inProcess: true}, "", false},
		{"--vmm-process: the default", []string{"--vmm-process"}, 0, noCgo, placement{jail: true}, "", false},
		{"--vmm-process --jail=false", []string{"--vmm-process", "--jail=false"}, 0, noCgo, placement{}, "--jail=false", false},
		{"--vmm-process, not root", []string{"--vmm-process"}, 1000, noCgo, placement{}, "not root", false},
		{"--jail-ids with a jail", []string{"--jail-ids", "/run/x"}, 0, noCgo, placement{jail: true}, "", false},
		{"--in-process --vmm-process", []string{"--in-process", "--vmm-process"}, 0, noCgo, placement{}, "--in-process and --vmm-process contradict", true},
		{"--in-process --jail", []string{"--in-process", "--jail"}, 0, noCgo, placement{}, "--in-process runs none", true},
		{"--vmm-process=false --jail", []string{"--vmm-process=false", "--jail=true"}, 0, noCgo, placement{}, "--in-process runs none", true},
		{"--in-process --jail-ids", []string{"--in-process", "--jail-ids", "/run/x"}, 0, noCgo, placement{}, "--jail-ids: no jail with --in-process", true},
		{"--jail=false --jail-ids", []string{"--jail=false", "--jail-ids", "/run/x"}, 0, noCgo, placement{}, "--jail-ids: no jail with --jail=false", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			fs := flag.NewFlagSet("kiln run", flag.ContinueOnError)
			fs.SetOutput(io.Discard)
			vf := addVMMFlags(fs)
			if err := fs.Parse(c.args); err != nil {
				t.Fatal(err)
			}
			got, err := placeVM(vf.choice(fs), c.euid, c.self)
			if c.isErr {
				if err == nil || !strings.Contains(err.Error(), c.why) {
					t.Fatalf("placeVM: %+v, %v; want an error with %q", got, err, c.why)
				}
				return
			}
			if err != nil || got.inProcess != c.want.inProcess || got.jail != c.want.jail || !strings.Contains(got.why, c.why) || (c.why == "" && got.why != "") {
				t.Fatalf("placeVM: %+v, %v; want %+v with why %q", got, err, c.want, c.why)
			}
		})
	}
}

// TestVMMFlagsBadInput: kiln run and kiln fork refuse contradictory
// placements and bad --jail words before they boot or restore anything.
func TestVMMFlagsBadInput(t *testing.T) {
	for _, cmd := range []string{"run", "fork"} {
		for _, c := range []struct {
			args []string
			want string
		}{
			{[]string{"--in-process", "--vmm-process"}, "--in-process and --vmm-process contradict each other"},
			{[]string{"--in-process", "--jail"}, "--jail jails a VMM process, and --in-process runs none"},
			{[]string{"--in-process", "--jail-ids", "/tmp"}, "--jail-ids: no jail with --in-process"},
			{[]string{"--jail=sometimes"}, "want auto, true or false"},
		} {
			args := append(append([]string{cmd, "--from", "/nonexistent"}, c.args...), "--", "true")
			code, _, stderr := runKiln(t, args...)
			if code != exitUsage || !strings.Contains(stderr, c.want) {
				t.Errorf("kiln %q: exit code %d, stderr %q; want %d and %q", args, code, stderr, exitUsage, c.want)
			}
		}
	}
}
