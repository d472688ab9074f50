package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench/results"
)

func TestCmdBenchReport(t *testing.T) {
	dir := t.TempDir()
	r := newResults(results.KVMEmulated)
	if r.KVMMode != results.KVMEmulated || r.Machine.CPUs < 1 {
		t.Fatalf("newResults = %+v", r)
	}
	p := map[string]string{"kernel": "vmlinux"}
	r.AddDurations("boot-to-userspace", results.VMMKiln, p, []time.Duration{time.Second, 2 * time.Second})
	r.AddDurations("boot-to-userspace", results.VMMQEMU, p, []time.Duration{3 * time.Second})
	for _, n := range []string{"1", "4"} {
		r.AddDurations("fork-ready", results.VMMKiln, map[string]string{"n": n}, []time.Duration{time.Millisecond})
	}
	in := filepath.Join(dir, "run.json")
	if err := r.WriteFile(in); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "report")
	var stdout, stderr bytes.Buffer
	if code := cmdBench(t.Context(), []string{"report", "-o", out, in}, &stdout, &stderr); code != exitOK {
		t.Fatalf("kiln bench report = %d: %s", code, stderr.String())
	}
	tables, err := os.ReadFile(filepath.Join(out, "tables.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"### KVM emulated", "| boot-to-userspace | kernel=vmlinux | qemu-microvm | 1 | 3.00 s", "**0.50**", "emulated-boot-to-userspace-kernel_vmlinux.svg",
		"### Curves", "fork-ready by n, emulated KVM", "emulated-fork-ready-by-n.svg"} {
		if !strings.Contains(string(tables), want) {
			t.Errorf("tables.md lacks %q:\n%s", want, tables)
		}
	}
	for _, f := range []string{"emulated-boot-to-userspace-kernel_vmlinux.svg", "emulated-fork-ready-by-n.svg"} {
		if _, err := os.Stat(filepath.Join(out, f)); err != nil {
			t.Error(err)
		}
	}
	// Bad input: a usage error naming the file, no panic.
	bad := filepath.Join(dir, "bad.json")
	os.WriteFile(bad, []byte(`{"version":9}`), 0o644)
	stderr.Reset()
	if code := cmdBench(t.Context(), []string{"report", bad}, &stdout, &stderr); code != exitUsage || !strings.Contains(stderr.String(), "bad.json") {
		t.Errorf("a bad results file: %d %q", code, stderr.String())
	}
	if code := cmdBench(t.Context(), []string{"report"}, &stdout, &stderr); code != exitUsage {
		t.Errorf("no files: %d", code)
	}
}
