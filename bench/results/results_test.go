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
