// Package report turns benchmark results files (package bench/results)
// into what docs/bench.md shows: a markdown table per KVM mode (medians,
// tails, and Kiln's ratio to its peer from the same run), an SVG plot per
// measure (the samples' CDF, one line per VMM), and curves of measures
// taken at several counts (density: memory against sandboxes running;
// fork scaling; latency against concurrency), drawn with
// gonum.org/v1/plot. Direct and nested KVM figures are never mixed.
package report

import (
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/kilnvm/kiln/bench/results"
)

// Group is the measures of one name and params, on one KVM mode, from
// every run given: one series per VMM.
type Group struct {
	Name    string
	Params  string // "k=v, k=v", sorted
	KVMMode string
	Unit    string
	Series  map[string][]float64 // VMM → samples, pooled across runs
	// ParamValues is Params as a map (what Curves groups by).
	ParamValues map[string]string
}

// Stats of one series.
type Stats struct {
	N                     int
	Min, Median, P95, P99 float64
}

// StatsOf computes s's statistics (nearest-rank percentiles).
func StatsOf(samples []float64) Stats {
	s := slices.Clone(samples)
	sort.Float64s(s)
	if len(s) == 0 {
		return Stats{}
	}
	rank := func(p float64) float64 {
		i := int(math.Ceil(p*float64(len(s)))) - 1
		return s[max(0, min(i, len(s)-1))]
	}
	med := s[len(s)/2]
	if len(s)%2 == 0 {
		med = (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return Stats{N: len(s), Min: s[0], Median: med, P95: rank(0.95), P99: rank(0.99)}
}

// Groups gathers runs' measures, in a stable order (mode, name, params).
func Groups(runs []*results.Run) ([]*Group, error) {
	byKey := map[string]*Group{}
	for _, r := range runs {
		for _, m := range r.Measures {
			params := paramString(m.Params)
			key := r.KVMMode + "\x00" + m.Name + "\x00" + params
			g := byKey[key]
			if g == nil {
				g = &Group{Name: m.Name, Params: params, KVMMode: r.KVMMode, Unit: m.Unit, Series: map[string][]float64{},
					ParamValues: maps.Clone(m.Params)}
				byKey[key] = g
			}
			if g.Unit != m.Unit {
				return nil, fmt.Errorf("report: %s (%s) is in %s in one run and %s in another", m.Name, params, g.Unit, m.Unit)
			}
			g.Series[m.VMM] = append(g.Series[m.VMM], m.Samples...)
		}
	}
	out := make([]*Group, 0, len(byKey))
	for _, g := range byKey {
		out = append(out, g)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.KVMMode != b.KVMMode {
			return a.KVMMode < b.KVMMode
		}
		if a.Name != b.Name {
			return a.Name < b.Name
		}
		return a.Params < b.Params
	})
	return out, nil
}

func paramString(p map[string]string) string {
	keys := make([]string, 0, len(p))
	for k := range p {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + p[k]
	}
	return strings.Join(parts, ", ")
}

// vmms is g's VMMs, Kiln first.
func (g *Group) vmms() []string {
	var out []string
	for v := range g.Series {
		out = append(out, v)
	}
	sort.Slice(out, func(i, j int) bool {
		if (out[i] == results.VMMKiln) != (out[j] == results.VMMKiln) {
			return out[i] == results.VMMKiln
		}
		return out[i] < out[j]
	})
	return out
}

// Ratio is Kiln's median over the peer's (NaN without both). For
// throughputs and rates (B/s, /s) a ratio above 1 is Kiln ahead; for
// times and sizes, below 1 (Better says which).
func (g *Group) Ratio(peer string) float64 {
	k, p := g.Series[results.VMMKiln], g.Series[peer]
	if len(k) == 0 || len(p) == 0 {
		return math.NaN()
	}
	pm := StatsOf(p).Median
	if pm == 0 {
		return math.NaN()
	}
	return StatsOf(k).Median / pm
}

// Better is which way is better for g's measure: "higher" for throughputs
// and rates, "lower" for times and sizes, "" for counts.
func (g *Group) Better() string {
	switch {
	case results.HigherIsBetter(g.Unit):
		return "higher"
	case g.Unit == results.UnitSeconds, g.Unit == results.UnitBytes:
		return "lower"
	}
	return ""
}

// TablesNote is what WriteTables says above each table about its ratios.
const TablesNote = "kiln / peer is Kiln's median over the peer's from the same runs; " +
	"better says which way is better for the measure: where lower is better (times, sizes) " +
	"a ratio below 1 is Kiln ahead, where higher is better (B/s, /s) a ratio above 1 is."

// WriteTables writes a markdown table of groups per KVM mode.
func WriteTables(w io.Writer, groups []*Group) error {
	mode := ""
	for _, g := range groups {
		if g.KVMMode != mode {
			mode = g.KVMMode
			fmt.Fprintf(w, "\n### KVM %s\n\n%s\n\n", mode, TablesNote)
			fmt.Fprintln(w, "| measure | params | VMM | n | median | p95 | p99 | kiln / peer (medians) | better |")
			fmt.Fprintln(w, "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
		}
		for _, v := range g.vmms() {
			st := StatsOf(g.Series[v])
			ratio := ""
			if v != results.VMMKiln {
				if r := g.Ratio(v); !math.IsNaN(r) {
					ratio = fmt.Sprintf("**%.2f**", r)
				}
			}
			fmt.Fprintf(w, "| %s | %s | %s | %d | %s | %s | %s | %s | %s |\n", g.Name, g.Params, v, st.N,
				format(st.Median, g.Unit), format(st.P95, g.Unit), format(st.P99, g.Unit), ratio, g.Better())
		}
	}
	return nil
}

// format shows v in unit u with a readable scale.
func format(v float64, u string) string {
	switch u {
	case results.UnitSeconds:
		switch {
		case v < 1e-3:
			return fmt.Sprintf("%.1f µs", v*1e6)
		case v < 1:
			return fmt.Sprintf("%.1f ms", v*1e3)
		}
		return fmt.Sprintf("%.2f s", v)
	case results.UnitBytesPerSecond:
		return fmt.Sprintf("%.1f MiB/s", v/(1<<20))
	case results.UnitBytes:
		return fmt.Sprintf("%.1f MiB", v/(1<<20))
	case results.UnitPerSecond:
		return fmt.Sprintf("%.2f /s", v)
	}
	return fmt.Sprintf("%g", v)
}

// Slug is g's plot file name (without .svg).
func (g *Group) Slug() string {
	s := g.KVMMode + "-" + g.Name
	if g.Params != "" {
		s += "-" + g.Params
	}
	return slug(s)
}

// slug is s as a file name: lower case, [a-z0-9.-] kept, the rest '_',
// at most 120 bytes.
func slug(s string) string {
	var b strings.Builder
	for _, c := range strings.ToLower(s) {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9', c == '-', c == '.':
			b.WriteRune(c)
		default:
			b.WriteByte('_')
		}
	}
	out := b.String()
	if len(out) > 120 {
		out = out[:120]
	}
	return out
}

// WritePlots draws each group's CDF into dir/SLUG.svg and returns the
// files' names.
func WritePlots(dir string, groups []*Group) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("report: %w", err)
	}
	var files []string
	for _, g := range groups {
		p := plot.New()
		p.Title.Text = g.Name + " (" + g.KVMMode + " KVM)"
		if g.Params != "" {
			p.Title.Text += "\n" + g.Params
		}
		scale, label := axis(g.Unit)
		p.X.Label.Text = label
		p.Y.Label.Text = "fraction of samples ≤ x"
		p.Y.Min, p.Y.Max = 0, 1
		var lines []any
		for _, v := range g.vmms() {
			lines = append(lines, v, cdf(g.Series[v], scale))
		}
		if err := plotutil.AddLinePoints(p, lines...); err != nil {
			return files, fmt.Errorf("report: %s: %w", g.Name, err)
		}
		p.Legend.Top = false
		name := g.Slug() + ".svg"
		if err := p.Save(6*vg.Inch, 4*vg.Inch, filepath.Join(dir, name)); err != nil {
			return files, fmt.Errorf("report: %s: %w", name, err)
		}
		files = append(files, name)
	}
	return files, nil
}

// axis is the scale and label of the x axis for unit u.
func axis(u string) (float64, string) {
	switch u {
	case results.UnitSeconds:
		return 1e3, "milliseconds"
	case results.UnitBytesPerSecond:
		return 1.0 / (1 << 20), "MiB/s"
	case results.UnitBytes:
		return 1.0 / (1 << 20), "MiB"
	case results.UnitPerSecond:
		return 1, "per second"
	}
	return 1, u
}

// cdf is the empirical CDF of samples, scaled.
func cdf(samples []float64, scale float64) plotter.XYs {
	s := slices.Clone(samples)
	sort.Float64s(s)
	xy := make(plotter.XYs, len(s))
	for i, v := range s {
		xy[i].X, xy[i].Y = v*scale, float64(i+1)/float64(len(s))
	}
	return xy
}
