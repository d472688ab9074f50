package report

import (
	"encoding/xml"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/bench/results"
)

func run(mode string, kiln, qemu []time.Duration) *results.Run {
	r := &results.Run{Version: results.Version, KVMMode: mode}
	p := map[string]string{"kernel": "debian", "cpus": "1"}
	r.AddDurations("boot", results.VMMKiln, p, kiln)
	r.AddDurations("boot", results.VMMQEMU, p, qemu)
	return r
}

func ms(vs ...int) []time.Duration {
	out := make([]time.Duration, len(vs))
	for i, v := range vs {
		out[i] = time.Duration(v) * time.Millisecond
	}
	return out
}

func TestStatsOf(t *testing.T) {
	for _, tc := range []struct {
		in   []float64
		want Stats
	}{
		{nil, Stats{}},
		{[]float64{3}, Stats{N: 1, Min: 3, Median: 3, P95: 3, P99: 3}},
		{[]float64{4, 1, 3, 2}, Stats{N: 4, Min: 1, Median: 2.5, P95: 4, P99: 4}},
	} {
		if got := StatsOf(tc.in); got != tc.want {
			t.Errorf("StatsOf(%v) = %+v, want %+v", tc.in, got, tc.want)
		}
	}
	var s []float64
	for i := 1; i <= 100; i++ {
		s = append(s, float64(i))
	}
	if st := StatsOf(s); st.P95 != 95 || st.P99 != 99 || st.Median != 50.5 {
		t.Errorf("StatsOf(1..100) = %+v", st)
	}
}

// TestReport: two runs of one mode pool their samples, a run of another
// mode stays apart, the table gives each VMM's figures and Kiln's ratio to
// the peer, and each group gets an SVG plot.
func TestReport(t *testing.T) {
	runs := []*results.Run{
		run(results.KVMEmulated, ms(100, 110), ms(200)),
		run(results.KVMEmulated, ms(120), ms(220)),
		run(results.KVMDirect, ms(10), ms(40)),
	}
	groups, err := Groups(runs)
	if err != nil {
		t.Fatal(err)
	}
	if len(groups) != 2 || groups[0].KVMMode != results.KVMDirect || len(groups[1].Series[results.VMMKiln]) != 3 {
		t.Fatalf("groups %+v", groups)
	}
	if r := groups[1].Ratio(results.VMMQEMU); math.Abs(r-0.11/0.21) > 1e-9 {
		t.Errorf("emulated ratio %v, want %v", r, 0.11/0.21)
	}
	if r := groups[0].Ratio("nobody"); !math.IsNaN(r) {
		t.Errorf("ratio to a missing peer %v, want NaN", r)
	}
	var b strings.Builder
	if err := WriteTables(&b, groups); err != nil {
		t.Fatal(err)
	}
	table := b.String()
	for _, want := range []string{"### KVM direct", "### KVM emulated", "| boot | cpus=1, kernel=debian | kiln | 3 | 110.0 ms |",
		"| boot | cpus=1, kernel=debian | qemu-microvm | 1 | 40.0 ms | 40.0 ms | 40.0 ms | **0.25** |"} {
		if !strings.Contains(table, want) {
			t.Errorf("tables lack %q:\n%s", want, table)
		}
	}
	dir := t.TempDir()
	files, err := WritePlots(dir, groups)
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 2 || files[0] != "direct-boot-cpus_1__kernel_debian.svg" {
		t.Fatalf("plots %q", files)
	}
	for _, f := range files {
		b, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := xml.Unmarshal(b, new(struct{})); err != nil {
			t.Errorf("%s is not XML: %v", f, err)
		}
		if !strings.Contains(string(b), "qemu-microvm") || !strings.Contains(string(b), "boot") {
			t.Errorf("%s lacks its legend or title", f)
		}
	}
	// A measure whose unit differs between runs is an error, not a mix.
	bad := run(results.KVMDirect, ms(1), ms(1))
	bad.Measures[0].Unit = results.UnitBytes
	if _, err := Groups([]*results.Run{runs[2], bad}); err == nil {
		t.Error("Groups mixed units")
	}
}

// TestThroughputTable: for B/s the ratio is still Kiln's median over the
// peer's, formatted in MiB/s, and the table says higher is better; for
// times lower, for a rate (/s) higher.
func TestThroughputTable(t *testing.T) {
	r := &results.Run{Version: results.Version, KVMMode: results.KVMEmulated}
	p := map[string]string{"blk_mib": "64"}
	if err := r.AddThroughput("blk-seq-read", results.VMMKiln, p, 64<<20, []time.Duration{2 * time.Second, 4 * time.Second, 8 * time.Second}); err != nil {
		t.Fatal(err)
	}
	if err := r.AddThroughput("blk-seq-read", results.VMMQEMU, p, 64<<20, []time.Duration{time.Second}); err != nil {
		t.Fatal(err)
	}
	r.AddDurations("vsock-rtt", results.VMMKiln, nil, ms(40))
	r.AddDurations("vsock-rtt", results.VMMQEMU, nil, ms(20))
	r.Measures = append(r.Measures, results.Measure{Name: "daemon-create-rate", VMM: "kilnd", Unit: results.UnitPerSecond, Samples: []float64{2.5}})
	groups, err := Groups([]*results.Run{r})
	if err != nil {
		t.Fatal(err)
	}
	var b strings.Builder
	if err := WriteTables(&b, groups); err != nil {
		t.Fatal(err)
	}
	table := b.String()
	for _, want := range []string{
		"| measure | params | VMM | n | median | p95 | p99 | kiln / peer (medians) | better |",
		"| blk-seq-read | blk_mib=64 | kiln | 3 | 16.0 MiB/s | 32.0 MiB/s | 32.0 MiB/s |  | higher |",
		"| blk-seq-read | blk_mib=64 | qemu-microvm | 1 | 64.0 MiB/s | 64.0 MiB/s | 64.0 MiB/s | **0.25** | higher |",
		"| vsock-rtt |  | qemu-microvm | 1 | 20.0 ms | 20.0 ms | 20.0 ms | **2.00** | lower |",
		"| daemon-create-rate |  | kilnd | 1 | 2.50 /s |",
		TablesNote,
	} {
		if !strings.Contains(table, want) {
			t.Errorf("tables lack %q:\n%s", want, table)
		}
	}
	for _, tc := range []struct{ unit, want string }{
		{results.UnitSeconds, "lower"}, {results.UnitBytes, "lower"}, {results.UnitBytesPerSecond, "higher"},
		{results.UnitPerSecond, "higher"}, {results.UnitCount, ""},
	} {
		if got := (&Group{Unit: tc.unit}).Better(); got != tc.want {
			t.Errorf("Better for %s = %q, want %q", tc.unit, got, tc.want)
		}
	}
	if _, err := WritePlots(t.TempDir(), groups); err != nil {
		t.Error(err)
	}
}
