package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestSWEScript checks the command line TestKVMSWE runs its steps with in
// a guest: arguments pass through sh unchanged, each step runs in its own
// folder, and the first step that fails ends it with its exit code.
func TestSWEScript(t *testing.T) {
	dir := t.TempDir()
	if err := os.Mkdir(dir+"/sub", 0o755); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name  string
		steps []sweStep
		out   string
		code  int
	}{
		{"quotes and spaces", []sweStep{{argv: []string{"printf", "%s|", "it's", "a b", `"$HOME"`, ""}, dir: "."}}, `it's|a b|"$HOME"||`, 0},
		{"folders", []sweStep{{argv: []string{"pwd"}, dir: "sub"}, {argv: []string{"sh", "-c", "basename $PWD"}, dir: "."}}, dir + "/sub\n" + filepath.Base(dir) + "\n", 0},
		{"stops at a failure", []sweStep{{argv: []string{"echo", "one"}, dir: "."}, {argv: []string{"sh", "-c", "exit 3"}, dir: "."}, {argv: []string{"echo", "never"}, dir: "."}}, "one\n", 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			cmd := exec.Command("sh", "-c", script(tt.steps))
			cmd.Dir = dir
			out, err := cmd.Output()
			code := 0
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				code = ee.ExitCode()
			} else if err != nil {
				t.Fatal(err)
			}
			if string(out) != tt.out || code != tt.code {
				t.Errorf("script %q: %q, exit %d; want %q, exit %d", script(tt.steps), out, code, tt.out, tt.code)
			}
		})
	}
}

// TestSWENormalize checks that only pytest's run time is taken out of
// its output.
func TestSWENormalize(t *testing.T) {
	for _, tt := range []struct{ in, want string }{
		{"1 failed, 1 passed in 0.12s\n", "1 failed, 1 passed in Ns\n"},
		{"2 passed in 13.05s", "2 passed in Ns"},
		{"no time here: in 5 seconds", "no time here: in 5 seconds"},
		{"built in 3sec", "built in 3sec"},
	} {
		if got := normalize(tt.in); got != tt.want {
			t.Errorf("normalize(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
