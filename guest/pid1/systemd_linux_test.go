package pid1

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// mkroot makes a root at a temporary folder: dirs, files (path -> content,
// executable), links (path -> target).
func mkroot(t *testing.T, dirs []string, files map[string]string, links map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for p, c := range files {
		if err := os.WriteFile(filepath.Join(root, p), []byte(c), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for p, target := range links {
		if err := os.Symlink(target, filepath.Join(root, p)); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

func TestInstallAgentService(t *testing.T) {
	agentBin := filepath.Join(t.TempDir(), "agent")
	if err := os.WriteFile(agentBin, []byte("AGENT"), 0o755); err != nil {
		t.Fatal(err)
	}
	// Debian's merged /usr: /sbin -> usr/sbin, /usr/sbin/init ->
	// /lib/systemd/systemd, /lib -> usr/lib.
	merged := func(t *testing.T) string {
		return mkroot(t, []string{"usr/sbin", "usr/lib/systemd", "etc"},
			map[string]string{"usr/lib/systemd/systemd": "ELF"},
			map[string]string{"sbin": "usr/sbin", "lib": "usr/lib", "usr/sbin/init": "/lib/systemd/systemd"})
	}
	tests := []struct {
		name    string
		root    func(t *testing.T) string
		wantErr string
	}{
		{"merged usr", merged, ""},
		{"plain", func(t *testing.T) string {
			return mkroot(t, []string{"sbin"}, map[string]string{"sbin/init": "ELF"}, nil)
		}, ""},
		{"no init", func(t *testing.T) string { return mkroot(t, []string{"sbin", "etc"}, nil, nil) }, "the image has no /sbin/init"},
		{"no sbin", func(t *testing.T) string { return mkroot(t, []string{"etc"}, nil, nil) }, "the image has no /sbin/init"},
		{"dangling", func(t *testing.T) string {
			return mkroot(t, []string{"sbin"}, nil, map[string]string{"sbin/init": "/lib/systemd/systemd"})
		}, "the image has no /sbin/init"},
		{"escape stays inside", func(t *testing.T) string {
			// ../../../.. from the root is the root: the host's files
			// are never reached.
			return mkroot(t, []string{"sbin"}, nil, map[string]string{"sbin/init": "../../../../../bin/sh"})
		}, "the image has no /sbin/init"},
		{"loop", func(t *testing.T) string {
			return mkroot(t, []string{"sbin"}, nil, map[string]string{"sbin/init": "/sbin/init"})
		}, "too many levels"},
		{"directory", func(t *testing.T) string { return mkroot(t, []string{"sbin/init"}, nil, nil) }, "not an executable file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			root := tt.root(t)
			cfg := &ImageConfig{Env: []string{"A=b"}, WorkingDir: "/w"}
			err := InstallAgentService(root, agentBin, cfg, "box")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("InstallAgentService = %v, want an error containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			read := func(p string) string {
				b, err := os.ReadFile(filepath.Join(root, p))
				if err != nil {
					t.Fatal(err)
				}
				return string(b)
			}
			if got := read(AgentServiceBinary); got != "AGENT" {
				t.Errorf("agent copy %q", got)
			}
			var back ImageConfig
			if err := json.Unmarshal([]byte(read(AgentServiceConfig)), &back); err != nil || back.WorkingDir != "/w" || len(back.Env) != 1 {
				t.Errorf("config %+v, %v", back, err)
			}
			unit := read(AgentServiceUnit)
			for _, want := range []string{"DefaultDependencies=no", "ExecStart=" + AgentServiceBinary + " " + AgentServiceArg, "Delegate=yes"} {
				if !strings.Contains(unit, want) {
					t.Errorf("unit lacks %q:\n%s", want, unit)
				}
			}
			if l, err := os.Readlink(filepath.Join(root, "etc/systemd/system/sysinit.target.wants/kiln-agent.service")); err != nil || l != AgentServiceUnit {
				t.Errorf("wants link %q, %v", l, err)
			}
			for u := range MaskedUnits {
				if l, err := os.Readlink(filepath.Join(root, "etc/systemd/system", u)); err != nil || l != "/dev/null" {
					t.Errorf("%s: mask %q, %v", u, l, err)
				}
			}
			if got := read("/etc/hostname"); got != "box\n" {
				t.Errorf("/etc/hostname %q", got)
			}
			// Twice (a second install over the first) works too.
			if err := InstallAgentService(root, agentBin, nil, ""); err != nil {
				t.Errorf("second install: %v", err)
			}
		})
	}
}

func TestCheckInit(t *testing.T) {
	for _, tt := range []struct {
		v  string
		ok bool
	}{{"", true}, {"agent", true}, {"systemd", true}, {"openrc", false}, {"Systemd", false}} {
		if err := CheckInit(tt.v); (err == nil) != tt.ok {
			t.Errorf("CheckInit(%q) = %v", tt.v, err)
		}
	}
	if got := ParseCmdline("quiet kiln.init=systemd kiln.root=9p:x").Init; got != "systemd" {
		t.Errorf("kiln.init parsed as %q", got)
	}
}

func FuzzResolveIn(f *testing.F) {
	f.Add("/sbin/init", "../../etc")
	f.Add("a/../../b", "/x/y")
	f.Fuzz(func(t *testing.T, p, target string) {
		root := t.TempDir()
		if err := os.MkdirAll(filepath.Join(root, "sbin"), 0o755); err != nil {
			t.Fatal(err)
		}
		if strings.ContainsRune(target, 0) || target == "" {
			return
		}
		if err := os.Symlink(target, filepath.Join(root, "sbin", "l")); err != nil {
			return
		}
		got, err := resolveIn(root, "/sbin/l/"+p)
		if err != nil {
			return
		}
		if rel, rerr := filepath.Rel(root, got); rerr != nil || strings.HasPrefix(rel, "..") {
			t.Fatalf("resolveIn(%q) = %q: outside the root %s", p, got, root)
		}
	})
}
