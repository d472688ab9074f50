package main

import (
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/jail"
)

// --jail: auto jails when kilnd is root and kiln is built without cgo,
// else says why; true makes that an error; false never jails. The flag
// takes auto and bools, alone it is true.
func TestJailMode(t *testing.T) {
	noCgo := kvmtest.VMMBinary(t) // kiln, built with CGO_ENABLED=0
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	selfWhy := jail.Unavailable(0, self) // a test binary: cgo or not, as go test built it
	for _, c := range []struct {
		name   string
		mode   jail.Mode
		euid   int
		kiln   string
		jailed bool
		why    string // in why, or in the error when err
		err    bool
	}{
		{"auto, root, no cgo", jail.ModeAuto, 0, noCgo, true, "", false},
		{"auto, not root", jail.ModeAuto, 1000, noCgo, false, "not root", false},
		{"auto, no such binary", jail.ModeAuto, 0, "/nonexistent/kiln", false, "cannot tell how", false},
		{"true, not root", jail.ModeOn, 1000, noCgo, false, "not root", true},
		{"true, root, no cgo", jail.ModeOn, 0, noCgo, true, "", false},
		{"false", jail.ModeOff, 0, noCgo, false, "--jail=false", false},
	} {
		t.Run(c.name, func(t *testing.T) {
			jailed, why, err := resolveJail(c.mode, c.euid, c.kiln)
			if c.err {
				if err == nil || !strings.Contains(err.Error(), c.why) {
					t.Fatalf("resolve: %v, %q, %v; want an error with %q", jailed, why, err, c.why)
				}
				return
			}
			if err != nil || jailed != c.jailed || !strings.Contains(why, c.why) {
				t.Fatalf("resolve: %v, %q, %v; want %v, %q", jailed, why, err, c.jailed, c.why)
			}
		})
	}
	if selfWhy != "" && !strings.Contains(selfWhy, "CGO_ENABLED=0") {
		t.Errorf("a test binary's reason: %q", selfWhy)
	}

	var m jail.Mode = jail.ModeAuto
	for _, c := range []struct {
		in   string
		want jail.Mode
		ok   bool
	}{{"true", jail.ModeOn, true}, {"0", jail.ModeOff, true}, {"auto", jail.ModeAuto, true}, {"maybe", jail.ModeAuto, false}} {
		if err := m.Set(c.in); (err == nil) != c.ok || (c.ok && m != c.want) {
			t.Errorf("Set(%q): %v, %q", c.in, err, m)
		}
	}
	cfg, err := parseFlags([]string{"--config=", "--jail"}, io.Discard)
	if err != nil || cfg.jail != jail.ModeOn {
		t.Errorf("--jail alone: %q, %v", cfg.jail, err)
	}
	cfg, err = parseFlags([]string{"--config="}, io.Discard)
	if err != nil || cfg.jail != jail.ModeAuto {
		t.Errorf("no --jail: %q, %v", cfg.jail, err)
	}
	// In the config file: a word or a bool.
	for _, c := range []struct {
		line string
		want jail.Mode
		err  string
	}{{`jail = "auto"`, jail.ModeAuto, ""}, {`jail = false`, jail.ModeOff, ""}, {`jail = true`, jail.ModeOn, ""}, {`jail = "sometimes"`, "", "want auto, true or false"}, {`jail = 1`, "", "want a string"}} {
		p := filepath.Join(t.TempDir(), "kilnd.toml")
		if err := os.WriteFile(p, []byte(c.line+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		cfg, err := parseFlagsWith([]string{"--config", p}, io.Discard, "")
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("%s: %v, want an error with %q", c.line, err, c.err)
			}
			continue
		}
		if err != nil || cfg.jail != c.want {
			t.Errorf("%s: %q, %v; want %q", c.line, cfg.jail, err, c.want)
		}
	}
}
