package main

import (
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/sandbox"
)

// TestVMMCommand: --vmm names the kiln-vmm each VMM process runs; without
// it, sandbox.FindVMM's ($KILN_VMM here); the deprecated --kiln runs its
// hidden `kiln vmm`; both at once, or a binary that is not an executable
// file, are refused naming the flag.
func TestVMMCommand(t *testing.T) {
	dir := t.TempDir()
	vmm := filepath.Join(dir, "kiln-vmm")
	if err := os.WriteFile(vmm, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Setenv(sandbox.VMMEnv, vmm)
	for _, c := range []struct {
		name string
		args []string
		env  string // $KILN_VMM
		want []string
		err  string // in the error, when one is wanted
	}{
		{"--vmm", []string{"--vmm", "/bin/true"}, vmm, []string{"/bin/true"}, ""},
		{"default: $KILN_VMM", nil, vmm, []string{vmm}, ""},
		{"--kiln, deprecated", []string{"--kiln", "/bin/true"}, vmm, []string{"/bin/true", "vmm"}, ""},
		{"both", []string{"--vmm", "/bin/true", "--kiln", "/bin/true"}, vmm, nil, "give --vmm"},
		{"--vmm missing", []string{"--vmm", filepath.Join(dir, "none")}, vmm, nil, "(--vmm)"},
		{"--vmm a folder", []string{"--vmm", dir}, vmm, nil, "not an executable file"},
		{"--kiln missing", []string{"--kiln", filepath.Join(dir, "none")}, vmm, nil, "(--kiln)"},
		{"default: none found", nil, filepath.Join(dir, "none"), nil, "$KILN_VMM"},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(sandbox.VMMEnv, c.env)
			cfg, err := parseFlagsWith(append([]string{"--config="}, c.args...), io.Discard, "")
			var got []string
			if err == nil {
				got, err = cfg.vmmCommand()
			}
			if c.err != "" {
				if err == nil || !strings.Contains(err.Error(), c.err) {
					t.Fatalf("%q: %q, %v; want an error with %q", c.args, got, err, c.err)
				}
				return
			}
			if err != nil || !slices.Equal(got, c.want) {
				t.Fatalf("%q: %q, %v; want %q", c.args, got, err, c.want)
			}
		})
	}
}
