package sandbox

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestFindVMM: $KILN_VMM first (it must be an executable file; a relative
// one is made absolute), then kiln-vmm on $PATH (none lies beside a test
// binary); the error names what it looked for and where.
func TestFindVMM(t *testing.T) {
	dir := t.TempDir()
	exe := filepath.Join(dir, "my-vmm")
	if err := os.WriteFile(exe, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	plain := filepath.Join(dir, "plain")
	if err := os.WriteFile(plain, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	onPath := t.TempDir()
	if err := os.WriteFile(filepath.Join(onPath, VMMName), []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	t.Chdir(dir)
	for _, c := range []struct {
		name, env, path string
		want            string // the path found, or a part of the error
		isErr           bool
	}{
		{"env", exe, "", exe, false},
		{"env relative", "my-vmm", "", exe, false},
		{"env missing", filepath.Join(dir, "none"), onPath, "$KILN_VMM", true},
		{"env not executable", plain, onPath, "not an executable file", true},
		{"env a folder", dir, onPath, "not an executable file", true},
		{"PATH", "", onPath, filepath.Join(onPath, VMMName), false},
		{"nowhere", "", t.TempDir(), "no kiln-vmm binary: $KILN_VMM is unset, none at ", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Setenv(VMMEnv, c.env)
			t.Setenv("PATH", c.path)
			got, err := FindVMM()
			if c.isErr {
				if err == nil || !strings.Contains(err.Error(), c.want) {
					t.Fatalf("FindVMM = %q, %v; want an error with %q", got, err, c.want)
				}
				if c.env == "" && !strings.Contains(err.Error(), "$PATH") {
					t.Errorf("the error %q does not say $PATH was searched", err)
				}
				return
			}
			if err != nil || got != c.want {
				t.Fatalf("FindVMM = %q, %v; want %q", got, err, c.want)
			}
		})
	}
}
