package bench

import (
	"bytes"
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

const mib = 1 << 20

func TestDensitySteps(t *testing.T) {
	for _, c := range []struct {
		steps  []int
		target int
		want   []int
		err    string
	}{
		{nil, 32, []int{1, 8, 16, 32}, ""},
		{nil, 10, []int{1, 8, 10}, ""},
		{nil, 1, []int{1}, ""},
		{nil, 40, []int{1, 8, 16, 32, 40}, ""},
		{[]int{4}, 4, []int{4}, ""},
		{[]int{2, 5, 9}, 6, []int{2, 5, 6}, ""},
		{[]int{4, 2}, 8, nil, "ascending"},
		{[]int{3, 3}, 8, nil, "ascending"},
		{[]int{0, 4}, 8, nil, "at least 1"},
	} {
		got, err := densitySteps(c.steps, c.target)
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Errorf("densitySteps(%v, %d): %v, want an error with %q", c.steps, c.target, err, c.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, c.want) {
			t.Errorf("densitySteps(%v, %d) = %v, %v; want %v", c.steps, c.target, got, err, c.want)
		}
	}
}

func TestParseDensitySteps(t *testing.T) {
	for _, c := range []struct {
		in   string
		want []int
		err  bool
	}{
		{"1,8,16,32", []int{1, 8, 16, 32}, false},
		{" 2, 4 ", []int{2, 4}, false},
		{"7", []int{7}, false},
		{"", nil, true},
		{"1,,2", nil, true},
		{"a", nil, true},
		{"0,1", nil, true},
		{"-1", nil, true},
		{"3,3", nil, true},
		{"8,1", nil, true},
	} {
		got, err := ParseDensitySteps(c.in)
		if (err != nil) != c.err || !slices.Equal(got, c.want) {
			t.Errorf("ParseDensitySteps(%q) = %v, %v; want %v (error: %v)", c.in, got, err, c.want, c.err)
		}
	}
}

func TestDensityNormalize(t *testing.T) {
	s, err := DensitySpec{}.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	if s.MemoryMiB != 512 || s.CPUs != 1 || s.Children != 32 || s.Target() != 32 || s.MemoryBudget != 8<<30 ||
		s.Floor != 512*mib || s.Settle != 2*time.Second || s.Method != DensityTemplate || !slices.Equal(s.Steps, []int{1, 8, 16, 32}) {
		t.Errorf("defaults: %+v", s)
	}
	s, err = DensitySpec{Children: 32, Cap: 12, Settle: -1}.Normalize()
	if err != nil || s.Target() != 12 || !slices.Equal(s.Steps, []int{1, 8, 12}) || s.Settle != 0 {
		t.Errorf("cap 12: %+v, %v", s, err)
	}
	s, err = DensitySpec{Children: 4, Cap: 12}.Normalize()
	if err != nil || s.Target() != 4 || !slices.Equal(s.Steps, []int{1, 4}) {
		t.Errorf("cap above children: %+v, %v", s, err)
	}
	for _, c := range []struct {
		spec DensitySpec
		err  string
	}{
		{DensitySpec{Method: "clone"}, "method"},
		{DensitySpec{Cap: -1}, "cap"},
		{DensitySpec{Children: -3}, "children"},
		{DensitySpec{Children: 5000}, "children"},
		{DensitySpec{MemoryMiB: -1}, "MiB"},
		{DensitySpec{Steps: []int{8, 1}}, "ascending"},
	} {
		if _, err := c.spec.Normalize(); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("Normalize(%+v): %v, want an error with %q", c.spec, err, c.err)
		}
	}
}

func TestSandboxMemSplit(t *testing.T) {
	for _, c := range []struct {
		guestPSS, processPSS uint64
		vmm, total           uint64
	}{
		{10 * mib, 31 * mib, 21 * mib, 31 * mib},
		{0, 20 * mib, 20 * mib, 20 * mib},
		{10 * mib, 10 * mib, 0, 10 * mib},
		// smaps and smaps_rollup are read apart: the guest may grow in
		// between; the VMM's share never goes negative.
		{12 * mib, 11 * mib, 0, 12 * mib},
	} {
		m := SandboxMem{Guest: MemUsage{Pss: c.guestPSS}, ProcessPSS: c.processPSS}
		if m.VMMPSS() != c.vmm || m.TotalPSS() != c.total {
			t.Errorf("guest %d, process %d: VMM %d, total %d; want %d, %d", c.guestPSS, c.processPSS, m.VMMPSS(), m.TotalPSS(), c.vmm, c.total)
		}
	}
}

func TestMemStatsOf(t *testing.T) {
	for _, c := range []struct {
		in   []uint64
		want MemStats
	}{
		{nil, MemStats{}},
		{[]uint64{5}, MemStats{5, 5, 5}},
		{[]uint64{9, 1, 5}, MemStats{5, 5, 9}},
		{[]uint64{4, 1, 3, 10}, MemStats{4, 3, 10}},
	} {
		in := slices.Clone(c.in)
		if got := memStatsOf(c.in); got != c.want {
			t.Errorf("memStatsOf(%v) = %+v, want %+v", c.in, got, c.want)
		}
		if !slices.Equal(in, c.in) {
			t.Errorf("memStatsOf changed its argument: %v", c.in)
		}
	}
}

// step makes a DensityStep of n sandboxes each of guest and process PSS.
func step(n int, guest, process, hostUsed uint64) DensityStep {
	s := DensityStep{Count: n, HostUsed: hostUsed}
	for range n {
		s.Sandboxes = append(s.Sandboxes, SandboxMem{Guest: MemUsage{Pss: guest}, ProcessPSS: process})
	}
	return s
}

func TestDensityFit(t *testing.T) {
	spec := DensitySpec{MemoryBudget: 1 << 30}
	for _, c := range []struct {
		name         string
		steps        []DensityStep
		stopped      string
		measured     int
		bound        string
		perSandbox   uint64
		extrapolated int
	}{
		{"none", nil, "", 0, "target", 0, 0},
		{"all fit", []DensityStep{step(1, 10*mib, 30*mib, 200*mib), step(8, 10*mib, 30*mib, 500*mib)}, "", 8, "target", 30 * mib, 34},
		{"budget", []DensityStep{step(8, 10*mib, 32*mib, 600*mib), step(16, 10*mib, 32*mib, 1100*mib), step(32, 10*mib, 32*mib, 2000*mib)},
			"", 8, "budget", 32 * mib, 32},
		{"first step past", []DensityStep{step(4, 100*mib, 356*mib, 2<<30)}, "", 0, "budget", 356 * mib, 2},
		{"host memory", []DensityStep{step(3, 10*mib, 26*mib, 100*mib)}, "host memory: MemAvailable 600 MiB", 3, "host memory", 26 * mib, 39},
		{"error", []DensityStep{step(3, 10*mib, 26*mib, 100*mib)}, "error", 3, "error", 26 * mib, 39},
	} {
		r := DensityReport{Spec: spec, Steps: c.steps, Stopped: c.stopped}
		f := r.Fit()
		if f.Measured != c.measured || f.Bound != c.bound || f.PerSandbox != c.perSandbox || f.Extrapolated != c.extrapolated || f.Budget != 1<<30 {
			t.Errorf("%s: %+v; want measured %d (%s), %d B per sandbox, extrapolated %d", c.name, f, c.measured, c.bound, c.perSandbox, c.extrapolated)
		}
	}
	if extrapolate(8<<30, 0) != 0 || extrapolate(8<<30, 32*mib) != 256 || extrapolate(8<<30, 31*mib) != 264 {
		t.Error("extrapolate")
	}
}

func TestDensityStepHostPerSandbox(t *testing.T) {
	if got := step(8, 0, 0, 800*mib).HostPerSandbox(); got != 100*mib {
		t.Errorf("HostPerSandbox = %d", got)
	}
	if got := (DensityStep{HostUsed: 5}).HostPerSandbox(); got != 0 {
		t.Errorf("HostPerSandbox of none = %d", got)
	}
}

const meminfoSample = `MemTotal:        4026112 kB
MemFree:         3500000 kB
MemAvailable:    3712340 kB
Buffers:               0 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
`

func TestParseMeminfo(t *testing.T) {
	m, err := ParseMeminfo(strings.NewReader(meminfoSample))
	if err != nil {
		t.Fatal(err)
	}
	if m["MemTotal"] != 4026112<<10 || m["MemAvailable"] != 3712340<<10 || m["HugePages_Total"] != 0 || m["Hugepagesize"] != 2<<20 {
		t.Errorf("ParseMeminfo: %v", m)
	}
	for _, c := range []struct{ in, err string }{
		{"MemTotal: 1 kB\n", "no MemAvailable"},
		{"MemAvailable: 1 kB\n", "no MemTotal"},
		{"MemTotal: 1 MB\nMemAvailable: 1 kB\n", "unit"},
		{"MemTotal: x kB\nMemAvailable: 1 kB\n", "MemTotal"},
		{"MemTotal:\nMemAvailable: 1 kB\n", "MemTotal"},
		{"MemTotal: 1 kB extra\nMemAvailable: 1 kB\n", "MemTotal"},
	} {
		if _, err := ParseMeminfo(strings.NewReader(c.in)); err == nil || !strings.Contains(err.Error(), c.err) {
			t.Errorf("ParseMeminfo(%q): %v, want an error with %q", c.in, err, c.err)
		}
	}
	if _, avail, err := hostMemory(); err != nil || avail == 0 {
		t.Errorf("hostMemory: %d, %v", avail, err)
	}
}

func TestStepSize(t *testing.T) {
	for _, c := range []struct {
		want                     int
		avail, floor, perSandbox uint64
		n                        int
	}{
		{8, 4096 * mib, 512 * mib, 32 * mib, 8},
		{8, 800 * mib, 512 * mib, 64 * mib, 4},
		{8, 520 * mib, 512 * mib, 64 * mib, 0},
		{8, 500 * mib, 512 * mib, 64 * mib, 0},
		{8, 512 * mib, 512 * mib, 0, 0},
		{8, 600 * mib, 512 * mib, 0, 8},
	} {
		if got := stepSize(c.want, c.avail, c.floor, c.perSandbox); got != c.n {
			t.Errorf("stepSize(%d, %d MiB, %d MiB, %d MiB) = %d, want %d", c.want, c.avail/mib, c.floor/mib, c.perSandbox/mib, got, c.n)
		}
	}
}

func TestDensityPrint(t *testing.T) {
	spec, _ := DensitySpec{Children: 8}.Normalize()
	r := DensityReport{Spec: spec, Steps: []DensityStep{step(1, 10*mib, 30*mib, 200*mib), step(8, 10*mib, 30*mib, 500*mib)}}
	var b bytes.Buffer
	r.Print(&b)
	out := b.String()
	for _, want := range []string{
		"at least 8 sandboxes", "EXTRAPOLATED (not measured): 273 sandboxes",
		"10.0 MiB guest PSS + 20.0 MiB VMM PSS",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("Print lacks %q:\n%s", want, out)
		}
	}
}

func TestDensityIdleCPU(t *testing.T) {
	tests := []struct {
		name       string
		step       DensityStep
		mean, most float64
	}{
		{"not measured", DensityStep{Idle: 2 * time.Second}, 0, 0},
		{"no window", DensityStep{IdleCPU: []time.Duration{time.Second}}, 0, 0},
		{"two", DensityStep{Idle: 2 * time.Second, IdleCPU: []time.Duration{20 * time.Millisecond, 60 * time.Millisecond}}, 0.02, 0.03},
	}
	for _, tt := range tests {
		mean, most := tt.step.IdleCPUShare()
		if math.Abs(mean-tt.mean) > 1e-9 || math.Abs(most-tt.most) > 1e-9 {
			t.Errorf("%s: IdleCPUShare = %v, %v; want %v, %v", tt.name, mean, most, tt.mean, tt.most)
		}
	}
	spec, _ := DensitySpec{Children: 2}.Normalize()
	s := step(2, 10*mib, 30*mib, 200*mib)
	s.Idle, s.IdleCPU = time.Second, []time.Duration{5 * time.Millisecond, 15 * time.Millisecond}
	var b bytes.Buffer
	DensityReport{Spec: spec, Steps: []DensityStep{s}}.Print(&b)
	if !strings.Contains(b.String(), "idle CPU %") || !strings.Contains(b.String(), " 1.00\n") {
		t.Errorf("Print lacks the idle CPU column (1.00%%):\n%s", b.String())
	}
}

func TestRunDensityRefuses(t *testing.T) {
	if _, err := RunDensity(t.Context(), DensitySpec{}, nil); err == nil || !strings.Contains(err.Error(), "VMM process") {
		t.Errorf("RunDensity without a VMM process command: %v", err)
	}
	if _, err := RunDensity(t.Context(), DensitySpec{Method: "x"}, nil); err == nil || !strings.Contains(err.Error(), "method") {
		t.Errorf("RunDensity with a bad method: %v", err)
	}
}
