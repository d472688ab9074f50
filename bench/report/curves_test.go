package report

import (
	"encoding/xml"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/bench/results"
)

// TestCurves: measures taken at several counts become curves (fork
// scaling per VMM, the density panel one line per measure), a measure at
// one count or a non-numeric count does not, and each curve is drawn.
func TestCurves(t *testing.T) {
	r := &results.Run{Version: results.Version, KVMMode: results.KVMEmulated}
	for _, n := range []string{"1", "8", "32"} {
		r.AddDurations("fork-ready", results.VMMKiln, map[string]string{"n": n, "memory_mib": "512"}, ms(10, 20, 30))
		for _, m := range []string{"density-guest-pss", "density-vmm-pss", "density-total-pss"} {
			r.Measures = append(r.Measures, results.Measure{Name: m, VMM: results.VMMKiln, Unit: results.UnitBytes,
				Params: map[string]string{"children": n, "memory_mib": "512"}, Samples: []float64{5 << 20}})
		}
	}
	// A second memory size is a curve of its own; one count is no curve.
	r.AddDurations("fork-ready", results.VMMKiln, map[string]string{"n": "1", "memory_mib": "1024"}, ms(10))
	// Not a number: left out.
	r.AddDurations("fork-ready", results.VMMKiln, map[string]string{"n": "many", "memory_mib": "512"}, ms(10))
	r.AddDurations("daemon-create", "kilnd", map[string]string{"concurrency": "1"}, ms(5, 6))
	r.AddDurations("daemon-create", "kilnd", map[string]string{"concurrency": "10"}, ms(50, 60))
	r.AddDurations("daemon-create", "kiln-library", map[string]string{"concurrency": "10"}, ms(40))
	groups, err := Groups([]*results.Run{r})
	if err != nil {
		t.Fatal(err)
	}
	curves, err := Curves(groups)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, c := range curves {
		var labels []string
		for _, l := range c.Lines {
			labels = append(labels, l.Label+":"+strings.Repeat("*", len(l.Points)))
		}
		got = append(got, c.Name+" by "+c.X+" ["+c.Params+"] "+strings.Join(labels, " "))
	}
	want := []string{
		"daemon-create by concurrency [] kiln-library:* kilnd:**",
		"density-pss-per-sandbox by children [memory_mib=512] density-guest-pss:*** density-total-pss:*** density-vmm-pss:***",
		"fork-ready by n [memory_mib=512] kiln:***",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Fatalf("curves:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
	fork := curves[2].Lines[0].Points
	if fork[0].X != 1 || fork[2].X != 32 || fork[1].Median != 0.02 || fork[1].N != 3 {
		t.Errorf("fork points %+v", fork)
	}
	dir := t.TempDir()
	files, err := WriteCurves(dir, curves)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 3 || files[1] != "emulated-density-pss-per-sandbox-by-children-memory_mib_512.svg" {
		t.Fatalf("files %q", files)
	}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := xml.Unmarshal(b, new(struct{})); err != nil {
			t.Errorf("%s is not XML: %v", f, err)
		}
	}
	b, _ := os.ReadFile(filepath.Join(dir, files[2]))
	if !strings.Contains(string(b), "kiln p95") || !strings.Contains(string(b), "forks made at once") {
		t.Errorf("fork curve lacks its p95 line or axis label")
	}
	// Units that differ within a curve are an error, not a mix.
	bad := &results.Run{Version: results.Version, KVMMode: results.KVMEmulated}
	bad.AddDurations("density-guest-pss", results.VMMKiln, map[string]string{"children": "1"}, ms(1))
	bad.Measures = append(bad.Measures, results.Measure{Name: "density-vmm-pss", VMM: results.VMMKiln, Unit: results.UnitBytes,
		Params: map[string]string{"children": "2"}, Samples: []float64{1}})
	g, err := Groups([]*results.Run{bad})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Curves(g); err == nil {
		t.Error("Curves mixed seconds and bytes")
	}
}
