package results

import (
	"bytes"
	"math"
	"strings"
	"testing"
	"time"
)

func sample() *Run {
	r := &Run{Version: Version, Started: time.Date(2026, 12, 5, 12, 0, 0, 0, time.UTC), KVMMode: KVMEmulated,
		Machine: Machine{Host: "h", CPUs: 2, Kernel: "6.1", Arch: "amd64"}, Commit: "abc"}
	r.AddDurations("boot", VMMKiln, map[string]string{"kernel": "debian"}, []time.Duration{100 * time.Millisecond, 120 * time.Millisecond})
	r.AddDurations("boot", VMMQEMU, map[string]string{"kernel": "debian"}, []time.Duration{150 * time.Millisecond})
	return r
}

func TestRoundTrip(t *testing.T) {
	var b bytes.Buffer
	if err := sample().Write(&b); err != nil {
		t.Fatal(err)
	}
	r, err := Read(&b)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Measures) != 2 || r.Measures[0].Samples[1] != 0.12 || r.Measures[1].VMM != VMMQEMU || r.Measures[0].Params["kernel"] != "debian" {
		t.Errorf("read back %+v", r)
	}
}

func TestReadRefuses(t *testing.T) {
	for _, tc := range []struct {
		name string
		edit func(*Run)
		raw  string
		want string
	}{
		{name: "version", edit: func(r *Run) { r.Version = 2 }, want: "version 2"},
		{name: "mode", edit: func(r *Run) { r.KVMMode = "fast" }, want: "kvm_mode"},
		{name: "unit", edit: func(r *Run) { r.Measures[0].Unit = "ms" }, want: `unit "ms"`},
		{name: "no samples", edit: func(r *Run) { r.Measures[0].Samples = nil }, want: "no samples"},
		{name: "negative", edit: func(r *Run) { r.Measures[0].Samples[0] = -1 }, want: "sample 0"},
		{name: "no name", edit: func(r *Run) { r.Measures[0].Name = "" }, want: "name"},
		{name: "unknown field", raw: `{"version":1,"kvm_mode":"direct","measures":[],"extra":1}`, want: "unknown field"},
		{name: "two values", raw: `{"version":1,"kvm_mode":"direct","measures":[]} {}`, want: "more than one"},
		{name: "not json", raw: `[`, want: "results:"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			raw := tc.raw
			if tc.edit != nil {
				r := sample()
				tc.edit(r)
				if err := r.Write(&bytes.Buffer{}); err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("Write = %v, want an error with %q", err, tc.want)
				}
				// Read checks the same, on a file written by someone else.
				var b strings.Builder
				b.WriteString(`{"version":` + map[bool]string{true: "2", false: "1"}[r.Version == 2] + `,"kvm_mode":"` + r.KVMMode + `","measures":[`)
				m := r.Measures[0]
				s := "[]"
				if len(m.Samples) > 0 {
					s = "[" + strings.TrimSuffix(strings.Repeat("0.1,", len(m.Samples)), ",") + "]"
					if m.Samples[0] < 0 {
						s = "[-1]"
					}
				}
				b.WriteString(`{"name":"` + m.Name + `","vmm":"` + m.VMM + `","unit":"` + m.Unit + `","samples":` + s + `}]}`)
				raw = b.String()
			}
			if _, err := Read(strings.NewReader(raw)); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Read(%s) = %v, want an error with %q", raw, err, tc.want)
			}
		})
	}
	r := sample()
	r.Measures[0].Samples[0] = math.NaN()
	if err := r.Check(); err == nil {
		t.Error("a NaN sample passed")
	}
}

// FuzzRead: a results file is untrusted input: Read refuses it or returns
// a run that passes Check, never a panic.
func FuzzRead(f *testing.F) {
	var b bytes.Buffer
	sample().Write(&b)
	f.Add(b.Bytes())
	f.Add([]byte(`{"version":1,"kvm_mode":"direct","measures":[{"name":"x","vmm":"kiln","unit":"s","samples":[1e308]}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		r, err := Read(bytes.NewReader(data))
		if err == nil {
			if cerr := r.Check(); cerr != nil {
				t.Fatalf("Read accepted a run that fails Check: %v", cerr)
			}
		}
	})
}

func TestAddThroughput(t *testing.T) {
	r := sample()
	if err := r.AddThroughput("read", VMMKiln, map[string]string{"blk_mib": "64"}, 64<<20, []time.Duration{2 * time.Second, 4 * time.Second}); err != nil {
		t.Fatal(err)
	}
	m := r.Measures[len(r.Measures)-1]
	if m.Unit != UnitBytesPerSecond || len(m.Samples) != 2 || m.Samples[0] != 32<<20 || m.Samples[1] != 16<<20 || m.Params["blk_mib"] != "64" {
		t.Errorf("measure %+v", m)
	}
	if err := r.Write(&bytes.Buffer{}); err != nil {
		t.Error(err)
	}
	for _, tc := range []struct {
		name  string
		bytes int64
		ds    []time.Duration
	}{
		{"zero duration", 1, []time.Duration{time.Second, 0}},
		{"negative duration", 1, []time.Duration{-time.Second}},
		{"negative bytes", -1, []time.Duration{time.Second}},
	} {
		n := len(r.Measures)
		if err := r.AddThroughput("x", VMMKiln, nil, tc.bytes, tc.ds); err == nil || len(r.Measures) != n {
			t.Errorf("%s: AddThroughput = %v with %d measures, want an error and none added", tc.name, err, len(r.Measures)-n)
		}
	}
}

func TestPerSecondUnit(t *testing.T) {
	r := sample()
	r.Measures = append(r.Measures, Measure{Name: "create-rate", VMM: "kilnd", Unit: UnitPerSecond, Samples: []float64{3.5}})
	var b bytes.Buffer
	if err := r.Write(&b); err != nil {
		t.Fatal(err)
	}
	back, err := Read(&b)
	if err != nil || back.Measures[2].Unit != UnitPerSecond {
		t.Fatalf("read back %v, %v", back, err)
	}
	for u, want := range map[string]bool{UnitSeconds: false, UnitBytes: false, UnitCount: false, UnitBytesPerSecond: true, UnitPerSecond: true} {
		if HigherIsBetter(u) != want {
			t.Errorf("HigherIsBetter(%q) = %v", u, !want)
		}
	}
}
