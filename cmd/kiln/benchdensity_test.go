package main

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench"
	"github.com/kilnvm/kiln/bench/results"
)

func TestParseDensityFlags(t *testing.T) {
	f, err := parseDensityFlags(nil, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	s := f.spec()
	if s.MemoryMiB != 512 || s.Children != 32 || s.Cap != 0 || !slices.Equal(s.Steps, []int{1, 8, 16, 32}) ||
		s.MemoryBudget != 8<<30 || s.Floor != 512<<20 || s.Settle != 2*time.Second || s.Method != bench.DensityTemplate || s.Parallel != 0 {
		t.Errorf("defaults: %+v", s)
	}
	if !f.holdProcs {
		t.Error("defaults: --hold-procs off")
	}
	f, err = parseDensityFlags([]string{"--mem", "256", "--children", "4", "--steps", "1,2", "--budget-gib", "0.5", "--settle", "0", "--method", "fork", "--cap", "3", "--parallel", "8", "--hold-procs=false"}, &bytes.Buffer{})
	if err != nil {
		t.Fatal(err)
	}
	if f.holdProcs {
		t.Error("--hold-procs=false left it on")
	}
	s = f.spec()
	if s.MemoryMiB != 256 || s.Children != 4 || s.Cap != 3 || !slices.Equal(s.Steps, []int{1, 2}) || s.MemoryBudget != 512<<20 ||
		s.Settle >= 0 || s.Method != bench.DensityFork || s.Parallel != 8 {
		t.Errorf("set: %+v", s)
	}
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--mem", "0"}, "--mem 0"},
		{[]string{"--children", "0"}, "--children 0"},
		{[]string{"--children", "5000"}, "--children 5000"},
		{[]string{"--cap", "-1"}, "--cap -1"},
		{[]string{"--parallel", "-2"}, "--parallel -2"},
		{[]string{"--steps", "8,1"}, "--steps"},
		{[]string{"--steps", "x"}, "--steps"},
		{[]string{"--budget-gib", "0"}, "--budget-gib 0"},
		{[]string{"--budget-gib", "NaN"}, "--budget-gib NaN"},
		{[]string{"--budget-gib", "-2"}, "--budget-gib -2"},
		{[]string{"--floor-mib", "0"}, "--floor-mib 0"},
		{[]string{"--settle", "-1s"}, "--settle -1s"},
		{[]string{"--method", "clone"}, `--method "clone"`},
		{[]string{"--cpus", "0"}, "--cpus 0"},
		{[]string{"extra"}, "unexpected arguments"},
	} {
		if _, err := parseDensityFlags(c.args, &bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error with %q", c.args, err, c.want)
		}
	}
	var stderr bytes.Buffer
	if _, err := parseDensityFlags([]string{"--bogus"}, &stderr); err == nil {
		t.Error("--bogus: no error")
	} else if _, printed := err.(flagsPrinted); !printed || !strings.Contains(stderr.String(), "usage: kiln bench density") {
		t.Errorf("--bogus: %v; stderr %q", err, stderr.String())
	}
}

func TestBenchDensityUsage(t *testing.T) {
	var stdout, stderr bytes.Buffer
	if code := cmdBench(context.Background(), []string{"density", "--steps", "0"}, &stdout, &stderr); code != exitUsage {
		t.Errorf("exit %d, want %d", code, exitUsage)
	}
	if !strings.Contains(stderr.String(), "kiln bench density: --steps") || !strings.Contains(stderr.String(), "usage: kiln bench density") {
		t.Errorf("stderr: %q", stderr.String())
	}
}

func TestAddDensityResults(t *testing.T) {
	spec, err := bench.DensitySpec{Children: 8, Steps: []int{1, 8}}.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	mem := func(guest, process uint64) bench.SandboxMem {
		return bench.SandboxMem{Guest: bench.MemUsage{Pss: guest, Rss: 3 * guest}, ProcessPSS: process}
	}
	rep := bench.DensityReport{Spec: spec, Steps: []bench.DensityStep{
		{Count: 1, Sandboxes: []bench.SandboxMem{mem(10<<20, 30<<20)}, HostUsed: 200 << 20},
		{Count: 2, Sandboxes: []bench.SandboxMem{mem(10<<20, 30<<20), mem(12<<20, 34<<20)}, HostUsed: 260 << 20,
			Idle: 2 * time.Second, IdleCPU: []time.Duration{10 * time.Millisecond, 30 * time.Millisecond}},
	}}
	r := &results.Run{Version: results.Version, KVMMode: results.KVMEmulated}
	addDensityResults(r, rep, 8)
	if err := r.Check(); err != nil {
		t.Fatal(err)
	}
	find := func(name string, params map[string]string) *results.Measure {
		for i, m := range r.Measures {
			ok := m.Name == name
			for k, v := range params {
				ok = ok && m.Params[k] == v
			}
			if ok {
				return &r.Measures[i]
			}
		}
		t.Fatalf("no measure %s %v in %+v", name, params, r.Measures)
		return nil
	}
	g := find("density-guest-pss", map[string]string{"children": "2", "memory_mib": "512"})
	if g.Unit != results.UnitBytes || !slices.Equal(g.Samples, []float64{10 << 20, 12 << 20}) {
		t.Errorf("guest: %+v", g)
	}
	v := find("density-vmm-pss", map[string]string{"children": "2"})
	if !slices.Equal(v.Samples, []float64{20 << 20, 22 << 20}) {
		t.Errorf("vmm: %+v", v)
	}
	if tot := find("density-total-pss", map[string]string{"children": "1"}); !slices.Equal(tot.Samples, []float64{30 << 20}) {
		t.Errorf("total: %+v", tot)
	}
	if h := find("density-host-used", map[string]string{"children": "2"}); !slices.Equal(h.Samples, []float64{260 << 20}) {
		t.Errorf("host used: %+v", h)
	}
	if c := find("density-idle-cpu", map[string]string{"children": "2", "window": "2s"}); c.Unit != results.UnitSeconds || !slices.Equal(c.Samples, []float64{0.005, 0.015}) {
		t.Errorf("idle CPU: %+v", c)
	}
	for _, m := range r.Measures {
		if m.Name == "density-idle-cpu" && m.Params["children"] == "1" {
			t.Errorf("idle CPU of a step that did not measure it: %+v", m)
		}
	}
	m := find("density-fits", map[string]string{"method": "measured", "budget_gib": "8"})
	if m.Unit != results.UnitCount || !slices.Equal(m.Samples, []float64{2}) || m.Params["bound"] != "target" {
		t.Errorf("measured: %+v", m)
	}
	// 8 GiB / (11 MiB guest + 21 MiB VMM, the last step's means).
	e := find("density-fits", map[string]string{"method": "extrapolated"})
	if !slices.Equal(e.Samples, []float64{256}) || !strings.Contains(e.Params["extrapolation"], "not measured") {
		t.Errorf("extrapolated: %+v", e)
	}
	for _, m := range r.Measures {
		if m.Name != strings.ToLower(m.Name) || strings.Contains(m.Name, "_") {
			t.Errorf("measure name %q: want lowercase-hyphenated", m.Name)
		}
	}
}
