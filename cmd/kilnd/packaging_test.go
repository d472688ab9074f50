package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestUnitFiles runs systemd-analyze verify on packaging/'s units, with
// ExecStart pointed at an executable that exists here (this test binary),
// and fails on anything it says about them.
func TestUnitFiles(t *testing.T) {
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("no systemd-analyze on this host: the units are not verified")
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	for _, name := range []string{"kilnd.service", "kilnd.socket"} {
		b, err := os.ReadFile(filepath.Join("../../packaging", name))
		if err != nil {
			t.Fatal(err)
		}
		s := string(b)
		if name == "kilnd.service" {
			if !strings.Contains(s, "ExecStart=/usr/local/bin/kilnd --config /etc/kiln/kilnd.toml\n") {
				t.Fatalf("kilnd.service: no ExecStart=/usr/local/bin/kilnd --config /etc/kiln/kilnd.toml")
			}
			s = strings.ReplaceAll(s, "/usr/local/bin/kilnd", self)
			for _, want := range []string{"Type=notify\n", "NotifyAccess=main\n", "WatchdogSec=30s\n", "KillMode=process\n",
				"Delegate=yes\n", "Sockets=kilnd.socket\n", "Restart=on-failure\n"} {
				if !strings.Contains(s, "\n"+want) {
					t.Errorf("kilnd.service has no %s", strings.TrimSpace(want))
				}
			}
		}
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(analyze, "verify", "--man=no", filepath.Join(dir, "kilnd.service"), filepath.Join(dir, "kilnd.socket"))
	out, err := cmd.CombinedOutput()
	var about []string
	for _, l := range strings.Split(string(out), "\n") {
		if strings.Contains(l, "kilnd.") {
			about = append(about, l)
		}
	}
	if err != nil || len(about) > 0 {
		t.Fatalf("systemd-analyze verify: %v:\n%s", err, out)
	}
	t.Logf("systemd-analyze verify: ok (%d bytes of output about other units)", len(out))
}

// TestMakeInstall runs make install into a DESTDIR, with stand-ins for the
// built binaries (make -o build: no build), and checks the layout: the
// four binaries side by side, the units with ExecStart at BINDIR, and
// the config file, which a second install keeps.
func TestMakeInstall(t *testing.T) {
	if _, err := exec.LookPath("make"); err != nil {
		t.Skip("no make on this host")
	}
	src, dest := t.TempDir(), t.TempDir()
	bins := map[string]string{}
	for _, name := range []string{"kiln", "kilnd", "kiln-vmm", "kiln-agent"} {
		p := filepath.Join(src, name)
		if err := os.WriteFile(p, []byte("#!/bin/sh\necho "+name+"\n"), 0o700); err != nil {
			t.Fatal(err)
		}
		bins[name] = p
	}
	install := func() string {
		t.Helper()
		cmd := exec.Command("make", "--no-print-directory", "-C", "../..", "-o", "build", "install",
			"DESTDIR="+dest, "PREFIX=/opt/kiln", "KILN="+bins["kiln"], "KILND="+bins["kilnd"], "VMM="+bins["kiln-vmm"], "AGENT="+bins["kiln-agent"])
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("make install: %v\n%s", err, out)
		}
		return string(out)
	}
	install()
	for _, name := range []string{"kiln", "kilnd", "kiln-vmm", "kiln-agent"} {
		p := filepath.Join(dest, "opt/kiln/bin", name)
		fi, err := os.Stat(p)
		if err != nil || fi.Mode().Perm() != 0o755 {
			t.Errorf("%s: %v, %v; want mode 0755", p, fi, err)
			continue
		}
		if b, _ := os.ReadFile(p); !strings.Contains(string(b), "echo "+name) {
			t.Errorf("%s is not the %s given", p, name)
		}
	}
	unit, err := os.ReadFile(filepath.Join(dest, "etc/systemd/system/kilnd.service"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(unit), "\nExecStart=/opt/kiln/bin/kilnd --config /etc/kiln/kilnd.toml\n") {
		t.Errorf("installed kilnd.service's ExecStart is not at PREFIX:\n%s", unit)
	}
	for _, p := range []string{"etc/systemd/system/kilnd.socket", "etc/kiln/kilnd.toml", "etc/tmpfiles.d/kiln.conf"} {
		if fi, err := os.Stat(filepath.Join(dest, p)); err != nil || fi.Mode().Perm() != 0o644 {
			t.Errorf("%s: %v, %v; want mode 0644", p, fi, err)
		}
	}
	shipped, _ := os.ReadFile("../../packaging/kilnd.toml")
	conf := filepath.Join(dest, "etc/kiln/kilnd.toml")
	if b, _ := os.ReadFile(conf); string(b) != string(shipped) {
		t.Error("the installed kilnd.toml is not packaging/kilnd.toml")
	}
	// An operator's edits survive the next install.
	os.WriteFile(conf, []byte("max-sandboxes = 7\n"), 0o644)
	if out := install(); !strings.Contains(out, "keeping") {
		t.Errorf("second make install said nothing of keeping the config:\n%s", out)
	}
	if b, _ := os.ReadFile(conf); string(b) != "max-sandboxes = 7\n" {
		t.Errorf("a second make install replaced the config file: %q", b)
	}
	var leftovers []string
	filepath.Walk(dest, func(p string, fi os.FileInfo, err error) error {
		if err == nil && !fi.IsDir() && strings.HasSuffix(p, ".tmp") {
			leftovers = append(leftovers, p)
		}
		return nil
	})
	if len(leftovers) > 0 {
		t.Errorf("make install left %v", leftovers)
	}
}

// TestTmpfilesConf: systemd-tmpfiles reads packaging/kiln-tmpfiles.conf
// and, over a fake root, writes advise into shmem_enabled.
func TestTmpfilesConf(t *testing.T) {
	tmpfiles, err := exec.LookPath("systemd-tmpfiles")
	if err != nil {
		t.Skip("no systemd-tmpfiles on this host")
	}
	root := t.TempDir()
	sysfs := filepath.Join(root, "sys/kernel/mm/transparent_hugepage/shmem_enabled")
	if err := os.MkdirAll(filepath.Dir(sysfs), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sysfs, []byte("always within_size advise [never] deny force\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	conf, err := filepath.Abs("../../packaging/kiln-tmpfiles.conf")
	if err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(tmpfiles, "--create", "--root="+root, conf).CombinedOutput(); err != nil || len(out) > 0 {
		t.Fatalf("systemd-tmpfiles --create: %v\n%s", err, out)
	}
	// tmpfiles writes without truncating (sysfs takes a write whole).
	if b, _ := os.ReadFile(sysfs); !strings.HasPrefix(string(b), "advise ") {
		t.Errorf("shmem_enabled after systemd-tmpfiles: %q, want advise written", b)
	}
}
