package shim

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// installFrom makes what the installer image holds: the binaries and a
// kernel in the cache layout.
func installFrom(t *testing.T) string {
	t.Helper()
	from := t.TempDir()
	for _, p := range []string{"bin", "kernel/6.1.0-test/modules"} {
		if err := os.MkdirAll(filepath.Join(from, p), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, b := range []string{"containerd-shim-kiln-v2", "kiln-agent", "kiln", "kiln-vmm"} {
		if err := os.WriteFile(filepath.Join(from, "bin", b), []byte("#!/bin/sh\necho "+b+"\n"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(from, "kernel/6.1.0-test/vmlinuz"), []byte("kernel"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("6.1.0-test", filepath.Join(from, "kernel/current")); err != nil {
		t.Fatal(err)
	}
	src, err := os.ReadFile("../packaging/kubernetes/containerd-kiln.toml")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(from, "containerd-kiln.toml"), src, 0o644); err != nil {
		t.Fatal(err)
	}
	return from
}

func runInstall(t *testing.T, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("../packaging/kubernetes/install.sh", args...)
	cmd.Env = append(os.Environ(), env...)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

// TestInstallScript runs the node installer into a scratch root: the
// files land where the shim and containerd look, containerd (Debian's)
// reads the result and knows the runtime, a second run changes nothing,
// and a node without KVM is refused.
func TestInstallScript(t *testing.T) {
	from := installFrom(t)
	skip := []string{"KILN_INSTALL_SKIP_NODE_CHECKS=1"}

	t.Run("refuses a node without kvm", func(t *testing.T) {
		root := t.TempDir()
		out, err := runInstall(t, nil, "--root", root, "--from", from, "--no-restart")
		if err == nil || !strings.Contains(out, "/dev/kvm") {
			t.Fatalf("install on a node without /dev/kvm: %v, %s; want a refusal naming /dev/kvm", err, out)
		}
		if _, err := os.Stat(filepath.Join(root, "usr/local/bin/containerd-shim-kiln-v2")); err == nil {
			t.Error("a refused install still wrote the shim")
		}
	})
	t.Run("refuses an incomplete source", func(t *testing.T) {
		bad := t.TempDir()
		out, err := runInstall(t, skip, "--root", t.TempDir(), "--from", bad, "--no-restart")
		if err == nil || !strings.Contains(out, "containerd-shim-kiln-v2") {
			t.Fatalf("install from an empty folder: %v, %s", err, out)
		}
	})

	root := t.TempDir()
	cfgDir := filepath.Join(root, "etc/containerd")
	if err := os.MkdirAll(cfgDir, 0o755); err != nil {
		t.Fatal(err)
	}
	// A node's own config: the import goes before its first table.
	orig := "version = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\"]\n  sandbox_image = \"registry.k8s.io/pause:3.9\"\n"
	if err := os.WriteFile(filepath.Join(cfgDir, "config.toml"), []byte(orig), 0o644); err != nil {
		t.Fatal(err)
	}
	for run := 1; run <= 2; run++ {
		if out, err := runInstall(t, skip, "--root", root, "--from", from, "--no-restart"); err != nil {
			t.Fatalf("install (run %d): %v\n%s", run, err, out)
		}
	}
	for _, p := range []string{"usr/local/bin/containerd-shim-kiln-v2", "usr/local/bin/kiln-agent", "usr/local/bin/kiln", "usr/local/bin/kiln-vmm", "var/lib/kiln/kernel/6.1.0-test/vmlinuz", "etc/kiln/shim.toml"} {
		if _, err := os.Stat(filepath.Join(root, p)); err != nil {
			t.Errorf("after install: %v", err)
		}
	}
	if v, err := os.Readlink(filepath.Join(root, "var/lib/kiln/kernel/current")); err != nil || v != "6.1.0-test" {
		t.Errorf("kernel/current -> %q, %v", v, err)
	}
	// The shim's config as installed parses, and points at the kernel.
	b, err := os.ReadFile(filepath.Join(root, "etc/kiln/shim.toml"))
	if err != nil {
		t.Fatal(err)
	}
	c, err := ParseConfig("shim.toml", b)
	if err != nil || c.Cache != "/var/lib/kiln" {
		t.Errorf("installed shim.toml: %+v, %v", c, err)
	}
	cfg, err := os.ReadFile(filepath.Join(cfgDir, "config.toml"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(cfg), "BEGIN kiln runtime"); n != 1 || !strings.HasPrefix(string(cfg), orig) {
		t.Errorf("config.toml after two runs (%d kiln blocks, want 1, after the node's own text):\n%s", n, cfg)
	}
	dump := containerdDump(t, filepath.Join(cfgDir, "config.toml"))
	if !strings.Contains(dump, "registry.k8s.io/pause:3.9") {
		t.Errorf("the node's own sandbox_image is gone from containerd's config")
	}
	wantRuntime(t, dump)

	// A node without a config.toml: containerd's defaults and the runtime.
	fresh := t.TempDir()
	if out, err := runInstall(t, skip, "--root", fresh, "--from", from, "--no-restart"); err != nil {
		t.Fatalf("install on a node without config.toml: %v\n%s", err, out)
	}
	dump = containerdDump(t, filepath.Join(fresh, "etc/containerd/config.toml"))
	wantRuntime(t, dump)
	if !strings.Contains(dump, "sandbox_image") || !strings.Contains(dump, `runtimes.runc]`) {
		t.Errorf("containerd's defaults (sandbox_image, the runc runtime) missing from the fresh node's config:\n%s", dump)
	}

	// A node that defines runtime kiln itself is refused, untouched.
	own := t.TempDir()
	ownCfg := "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.kiln]\n  runtime_type = \"io.containerd.runc.v2\"\n"
	os.MkdirAll(filepath.Join(own, "etc/containerd"), 0o755)
	os.WriteFile(filepath.Join(own, "etc/containerd/config.toml"), []byte(ownCfg), 0o644)
	if out, err := runInstall(t, skip, "--root", own, "--from", from, "--no-restart"); err == nil || !strings.Contains(out, "defines the runtime kiln itself") {
		t.Errorf("install over a node's own runtime kiln: %v, %s; want a refusal", err, out)
	}
	if b, _ := os.ReadFile(filepath.Join(own, "etc/containerd/config.toml")); string(b) != ownCfg {
		t.Errorf("a refused install changed config.toml:\n%s", b)
	}
}

// containerdDump is containerd's own reading of a config file (Debian's
// containerd: config dump merges it with the defaults).
func containerdDump(t *testing.T, cfg string) string {
	t.Helper()
	containerd, err := exec.LookPath("containerd")
	if err != nil {
		t.Fatalf("containerd: %v (make deps installs Debian's containerd)", err)
	}
	out, err := exec.Command(containerd, "--config", cfg, "config", "dump").CombinedOutput()
	if err != nil {
		t.Fatalf("containerd config dump: %v\n%s", err, out)
	}
	return string(out)
}

func wantRuntime(t *testing.T, dump string) {
	t.Helper()
	i := strings.Index(dump, `[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.kiln]`)
	if i < 0 {
		t.Fatalf("containerd's merged config has no runtimes.kiln:\n%s", dump)
	}
	sect := dump[i:]
	if j := strings.Index(sect[1:], "\n  ["); j > 0 {
		sect = sect[:j+1]
	}
	for _, want := range []string{`runtime_type = "` + RuntimeName + `"`, `"io.kiln.*"`} {
		if !strings.Contains(sect, want) {
			t.Errorf("runtimes.kiln in containerd's config lacks %s:\n%s", want, sect)
		}
	}
}
