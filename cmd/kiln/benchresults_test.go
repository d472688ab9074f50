package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
)

// The results files each kiln bench suite builds, from fake comparisons
// (no KVM), and the flags they take.

func ds(ms ...int) []time.Duration {
	out := make([]time.Duration, len(ms))
	for i, v := range ms {
		out[i] = time.Duration(v) * time.Millisecond
	}
	return out
}

// measures indexes r's measures by name, VMM and params ("k=v,k=v",
// sorted), after checking r as a results file.
func measures(t *testing.T, r *results.Run) map[string]results.Measure {
	t.Helper()
	if err := r.Check(); err != nil {
		t.Fatal(err)
	}
	var b bytes.Buffer
	if err := r.Write(&b); err != nil {
		t.Fatal(err)
	}
	if _, err := results.Read(&b); err != nil {
		t.Fatal(err)
	}
	out := map[string]results.Measure{}
	for _, m := range r.Measures {
		k := m.Name + " " + m.VMM
		for _, p := range []string{"concurrency", "cpus", "for", "kernel", "memory_mib", "n", "workers"} {
			if v, ok := m.Params[p]; ok {
				k += " " + p + "=" + v
			}
		}
		if _, dup := out[k]; dup {
			t.Errorf("two measures %s", k)
		}
		out[k] = m
	}
	return out
}

func TestStartResults(t *testing.T) {
	c := bench.StartComparison{
		Kiln: []bench.StartResult{{ColdStart: 2 * time.Second, RTTs: ds(1, 2)}, {ColdStart: 3 * time.Second, RTTs: ds(3)}},
		QEMU: []bench.StartResult{{ColdStart: time.Second, RTTs: ds(4, 5)}},
	}
	r := startResults(results.KVMEmulated, 2, 256, []startSummary{
		{name: "debian 6.1", c: c},
		{name: "minimal", err: errors.New("no kernel")},
	})
	if r.KVMMode != results.KVMEmulated {
		t.Errorf("mode %q", r.KVMMode)
	}
	m := measures(t, r)
	if len(m) != 4 {
		t.Fatalf("measures %v", m)
	}
	cold := m["cold-start kiln cpus=2 kernel=debian 6.1 memory_mib=256"]
	if cold.Unit != results.UnitSeconds || len(cold.Samples) != 2 || cold.Samples[1] != 3 {
		t.Errorf("kiln cold start %+v", cold)
	}
	if q := m["exec-rtt qemu-microvm cpus=2 kernel=debian 6.1 memory_mib=256"]; len(q.Samples) != 2 || q.Samples[0] != 0.004 {
		t.Errorf("qemu exec rtt %+v", q)
	}
	if k := m["exec-rtt kiln cpus=2 kernel=debian 6.1 memory_mib=256"]; len(k.Samples) != 3 {
		t.Errorf("kiln exec rtt %+v", k)
	}
}

func TestSnapshotResults(t *testing.T) {
	rep := bench.SnapshotReport{
		Spec:           bench.SnapshotSpec{CPUs: 1, MemoryMiB: 512},
		Saves:          []bench.SaveResult{{MemoryMiB: 256, Save: time.Second}, {MemoryMiB: 512, Save: 2 * time.Second}, {MemoryMiB: 1024, Save: 0}},
		ColdStarts:     ds(9000, 10000),
		Restores:       []bench.RestoreResult{{Exec: time.Second}, {Exec: 1200 * time.Millisecond}},
		CachedRestores: []bench.RestoreResult{{Exec: 100 * time.Millisecond}, {Exec: 90 * time.Millisecond}, {Exec: 95 * time.Millisecond}},
		Forks: []bench.ForkResult{{N: 1, Fork: time.Second, AllExec: 2 * time.Second}, {N: 8, Fork: 3 * time.Second, AllExec: 5 * time.Second},
			{N: 32, Err: "out of memory"}},
		PSS:  &bench.PSSResult{N: 8, Standalone: bench.MemUsage{Pss: 100 << 20}, Children: []bench.MemUsage{{Pss: 10 << 20}, {Pss: 12 << 20}}},
		Peer: &bench.PeerSnapshot{ColdStart: 8 * time.Second, Save: 4 * time.Second, Restores: ds(3000, 3500, 4000)},
	}
	m := measures(t, snapshotResults(results.KVMDirect, rep))
	for k, n := range map[string]int{
		"save kiln cpus=1 memory_mib=256":                      1,
		"save kiln cpus=1 memory_mib=512":                      1,
		"save qemu-microvm cpus=1 memory_mib=512":              1,
		"restore-to-exec kiln cpus=1 memory_mib=512":           2,
		"restore-to-exec qemu-microvm cpus=1 memory_mib=512":   3,
		"restore-cached-to-exec kiln cpus=1 memory_mib=512":    3,
		"cold-boot-to-exec kiln cpus=1 memory_mib=512":         2,
		"cold-boot-to-exec qemu-microvm cpus=1 memory_mib=512": 1,
		"fork-ready kiln cpus=1 memory_mib=512 n=1":            1,
		"fork-exec kiln cpus=1 memory_mib=512 n=8":             1,
		"fork-guest-pss kiln cpus=1 memory_mib=512 n=8":        2,
		"standalone-guest-pss kiln cpus=1 memory_mib=512":      1,
	} {
		if len(m[k].Samples) != n {
			t.Errorf("%s: %d samples, want %d", k, len(m[k].Samples), n)
		}
	}
	if len(m) != 14 {
		t.Errorf("%d measures (the failed fork and the unsaved size must add none): %v", len(m), m)
	}
	if p := m["fork-guest-pss kiln cpus=1 memory_mib=512 n=8"]; p.Unit != results.UnitBytes || p.Samples[1] != 12<<20 {
		t.Errorf("pss %+v", p)
	}
	// No peer, no PSS: Kiln's alone.
	rep.Peer, rep.PSS = nil, nil
	if m := measures(t, snapshotResults(results.KVMDirect, rep)); len(m) != 9 {
		t.Errorf("without a peer: %d measures", len(m))
	}
}

func TestDaemonResults(t *testing.T) {
	ok := func(ms ...int) []bench.DaemonSample {
		var out []bench.DaemonSample
		for _, v := range ms {
			out = append(out, bench.DaemonSample{Total: time.Duration(v) * time.Millisecond})
		}
		return out
	}
	rep := bench.DaemonReport{
		Spec: bench.DaemonSpec{MemoryMiB: 128},
		Sets: []bench.DaemonSet{
			{Op: bench.OpCreate, Path: bench.PathKilnd, Concurrency: 1, Samples: ok(100, 200)},
			{Op: bench.OpCreate, Path: bench.PathLibrary, Concurrency: 1, Samples: ok(50)},
			{Op: bench.OpCreate, Path: bench.PathKilnd, Concurrency: 10, Samples: append(ok(300), bench.DaemonSample{Err: "timeout"})},
			{Op: bench.OpCheckpoint, Path: bench.PathKilnd, Concurrency: 1, Samples: ok(40)},
			{Op: bench.OpRollback, Path: bench.PathKilnd, Concurrency: 1, Samples: []bench.DaemonSample{{Err: "refused"}}},
		},
		Rates: []bench.DaemonRate{{Path: bench.PathKilnd, Workers: 2, For: 30 * time.Second, Elapsed: 40 * time.Second, Completed: 100},
			{Path: bench.PathLibrary, Workers: 2}},
		Forks: []bench.DaemonFork{{Path: bench.PathKilnd, N: 8, Ready: time.Second, AllExec: 2 * time.Second},
			{Path: bench.PathLibrary, N: 8, Ready: 500 * time.Millisecond, AllExec: time.Second}, {Path: bench.PathKilnd, N: 32, Err: "no"}},
	}
	m := measures(t, daemonResults(results.KVMEmulated, rep))
	for k, n := range map[string]int{
		"daemon-create kilnd concurrency=1 memory_mib=128":          2,
		"daemon-create kiln-library concurrency=1 memory_mib=128":   1,
		"daemon-create kilnd concurrency=10 memory_mib=128":         1,
		"daemon-checkpoint kilnd concurrency=1 memory_mib=128":      1,
		"daemon-create-rate kilnd for=30s memory_mib=128 workers=2": 1,
		"daemon-fork-ready kilnd memory_mib=128 n=8":                1,
		"daemon-fork-exec kiln-library memory_mib=128 n=8":          1,
	} {
		if len(m[k].Samples) != n {
			t.Errorf("%s: %d samples, want %d", k, len(m[k].Samples), n)
		}
	}
	if len(m) != 9 {
		t.Errorf("%d measures (failed sets and forks, and a rate that never ran, add none): %v", len(m), m)
	}
	if r := m["daemon-create-rate kilnd for=30s memory_mib=128 workers=2"]; r.Unit != results.UnitPerSecond || r.Samples[0] != 2.5 {
		t.Errorf("rate %+v", r)
	}
	if daemonVMM("other") != "kiln-other" {
		t.Error(daemonVMM("other"))
	}
}

func TestProcessResults(t *testing.T) {
	rep := bench.ProcessReport{Modes: []bench.ProcessModeResult{
		{Name: "in-process", Restores: ds(10, 20), Execs: ds(1, 2, 3), Forks: ds(30), GuestPSS: 64 << 20},
		{Name: "VMM process", Restores: ds(15), Execs: ds(2), VMMPSS: 8 << 20, GuestPSS: 64 << 20},
		{Name: "no seccomp"},
	}}
	r, err := processResults(results.KVMDirect, 256, rep)
	if err != nil {
		t.Fatal(err)
	}
	m := measures(t, r)
	for k, n := range map[string]int{
		"process-restore kiln-in-process memory_mib=256":    2,
		"process-exec kiln-in-process memory_mib=256":       3,
		"process-fork kiln-in-process memory_mib=256":       1,
		"process-guest-pss kiln-in-process memory_mib=256":  1,
		"process-restore kiln-vmm-process memory_mib=256":   1,
		"process-vmm-pss kiln-vmm-process memory_mib=256":   1,
		"process-guest-pss kiln-vmm-process memory_mib=256": 1,
	} {
		if len(m[k].Samples) != n {
			t.Errorf("%s: %d samples, want %d", k, len(m[k].Samples), n)
		}
	}
	if len(m) != 8 {
		t.Errorf("%d measures: %v", len(m), m)
	}
	if _, err := processResults(results.KVMDirect, 256, bench.ProcessReport{}); err == nil {
		t.Error("an empty report gave a results file")
	}
}

func TestDevicesResultsFile(t *testing.T) {
	c := bench.DevicesComparison{BlkMiB: 64, BlkKiln: ds(2000), BlkQEMU: ds(1000),
		VsockKiln: []bench.VsockResult{{Echo: time.Second, RTTs: ds(2, 3)}}, VsockQEMU: []bench.VsockResult{{Echo: 500 * time.Millisecond, RTTs: ds(1)}}}
	r, err := devicesResults(results.KVMNested, map[string]string{"cpus": "1", "memory_mib": "512", "kernel": "6.1"}, c)
	if err != nil {
		t.Fatal(err)
	}
	if r.KVMMode != results.KVMNested {
		t.Errorf("mode %q", r.KVMMode)
	}
	m := measures(t, r)
	if b := m["blk-seq-read kiln cpus=1 kernel=6.1 memory_mib=512"]; b.Unit != results.UnitBytesPerSecond || b.Samples[0] != 32<<20 {
		t.Errorf("blk %+v", b)
	}
	if e := m["vsock-echo qemu-microvm cpus=1 kernel=6.1 memory_mib=512"]; e.Samples[0] != 2*bench.VsockEchoBytes {
		t.Errorf("echo %+v", e)
	}
	if len(m) != 6 {
		t.Errorf("%d measures", len(m))
	}
	var out bytes.Buffer
	printDevicesSummary(&out, c)
	for _, want := range []string{"median kiln 32.0 MiB/s, qemu microvm 64.0 MiB/s, throughput kiln/qemu 0.50", "throughput kiln/qemu 0.50 (higher: kiln faster)",
		"vsock round trip (2 and 1): median kiln 2.5ms"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
}

func TestParseBenchDevices(t *testing.T) {
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, a benchDevicesArgs)
		err   string
	}{
		{name: "defaults", check: func(t *testing.T, a benchDevicesArgs) {
			if a.n != 5 || a.blkMiB != 64 || !a.vsock || a.vsockEcho != "/opt/kiln/bin/kiln-vsockecho" || a.cpus != 1 || a.mem != 512 ||
				a.json != "" || a.kvmMode != "" || a.qemu != "qemu-system-x86_64" {
				t.Errorf("defaults %+v", a)
			}
		}},
		{name: "set", args: []string{"--n", "3", "--blk-mib", "16", "--json", "d.json", "--kvm-mode", "emulated", "--vsockecho", "/e", "--mem", "256"},
			check: func(t *testing.T, a benchDevicesArgs) {
				if a.n != 3 || a.blkMiB != 16 || a.json != "d.json" || a.kvmMode != results.KVMEmulated || a.vsockEcho != "/e" || a.mem != 256 {
					t.Errorf("parsed %+v", a)
				}
			}},
		{name: "blk only", args: []string{"--vsock=false"}, check: func(t *testing.T, a benchDevicesArgs) {
			if a.vsock || a.vsockEcho != "" || a.blkMiB != 64 {
				t.Errorf("parsed %+v", a)
			}
		}},
		{name: "vsock only", args: []string{"--blk-mib", "0"}, check: func(t *testing.T, a benchDevicesArgs) {
			if !a.vsock || a.blkMiB != 0 {
				t.Errorf("parsed %+v", a)
			}
		}},
		{name: "nothing", args: []string{"--blk-mib", "0", "--vsock=false"}, err: "nothing to measure"},
		{name: "zero runs", args: []string{"-n", "0"}, err: "want them positive"},
		{name: "zero mem", args: []string{"--mem", "0"}, err: "want them positive"},
		{name: "negative disk", args: []string{"--blk-mib", "-1"}, err: "--blk-mib -1"},
		{name: "bad kvm mode", args: []string{"--kvm-mode", "fast"}, err: `--kvm-mode "fast"`},
		{name: "stray argument", args: []string{"now"}, err: "unexpected arguments"},
		{name: "negative timeout", args: []string{"--timeout", "-1s"}, err: "--timeout"},
		{name: "unknown flag", args: []string{"--disk", "1"}, err: "flag provided but not defined"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, err := parseBenchDevices(tt.args, "/opt/kiln/bin/kiln", io.Discard)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Fatalf("err = %v, want %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, a)
		})
	}
	if _, err := parseBenchDevices([]string{"-h"}, "/k", io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("-h: %v", err)
	}
}

// TestBenchJSONFlags: every suite takes --json and --kvm-mode, and refuses
// a bad mode or stray arguments as a usage error before it needs KVM.
func TestBenchJSONFlags(t *testing.T) {
	out := filepath.Join(t.TempDir(), "r.json")
	for _, args := range [][]string{
		{"start", "--json", out, "--kvm-mode", "fast"},
		{"snapshot", "--json", out, "--kvm-mode", "fast"},
		{"process", "--json", out, "--kvm-mode", "fast"},
		{"daemon", "--json", out, "--kvm-mode", "fast"},
		{"devices", "--json", out, "--kvm-mode", "fast"},
		{"process", "--json", out, "stray"},
		{"devices", "--json", out, "stray"},
	} {
		var stdout, stderr bytes.Buffer
		if code := cmdBench(t.Context(), args, &stdout, &stderr); code != exitUsage {
			t.Errorf("kiln bench %q = %d, want %d (usage): %s", args, code, exitUsage, stderr.String())
		} else if !strings.Contains(stderr.String(), "fast") && !strings.Contains(stderr.String(), "unexpected") {
			t.Errorf("kiln bench %q: %q names neither the mode nor the argument", args, stderr.String())
		}
	}
}

func TestParseBenchDaemonReportJSON(t *testing.T) {
	a, err := parseBenchDaemon([]string{"--json", "r.json", "--report-json", "-"}, "/opt/kiln/bin/kiln", io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if a.json != "r.json" || a.reportJSON != "-" {
		t.Errorf("json %q, report-json %q", a.json, a.reportJSON)
	}
}
