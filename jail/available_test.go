package jail

import (
	"debug/buildinfo"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestUnavailable: a jail needs root and a binary built without cgo; the
// reason names what is missing.
func TestUnavailable(t *testing.T) {
	dir := t.TempDir()
	src := filepath.Join(dir, "main.go")
	if err := os.WriteFile(src, []byte("package main\n\nfunc main() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	build := func(name, cgo string) string {
		out := filepath.Join(dir, name)
		cmd := exec.Command("go", "build", "-o", out, src)
		cmd.Env = append(os.Environ(), "CGO_ENABLED="+cgo, "GOFLAGS=-buildvcs=false")
		cmd.Dir = dir
		if b, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("go build (CGO_ENABLED=%s): %v\n%s", cgo, err, b)
		}
		return out
	}
	noCgo := build("nocgo", "0")
	withCgo := build("cgo", "1")
	if bi, err := buildinfo.ReadFile(withCgo); err != nil || !strings.Contains(bi.String(), "CGO_ENABLED=1") {
		withCgo = "" // no C toolchain here: go build made it without cgo
	}
	notGo := filepath.Join(dir, "script")
	if err := os.WriteFile(notGo, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		euid int
		path string
		want string // "" or in the reason
	}{
		{"root, no cgo", 0, noCgo, ""},
		{"not root, no cgo", 1000, noCgo, "uid 1000, not root"},
		{"not root, no such binary", 1000, "/nonexistent/kiln", "not root"},
		{"root, cgo", 0, withCgo, "not built with CGO_ENABLED=0"},
		{"root, no such binary", 0, "/nonexistent/kiln", "cannot tell how /nonexistent/kiln was built"},
		{"root, not a Go binary", 0, notGo, "cannot tell how"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.path == "" {
				t.Skip("no cgo toolchain on this machine")
			}
			got := Unavailable(c.euid, c.path)
			if c.want == "" && got != "" || c.want != "" && !strings.Contains(got, c.want) {
				t.Fatalf("Unavailable(%d, %s) = %q, want %q", c.euid, c.path, got, c.want)
			}
		})
	}
}
