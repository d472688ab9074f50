package report

import (
	"fmt"
	"image/color"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"

	"github.com/kilnvm/kiln/bench/results"
)

// ScaleParams are the params a curve's x axis can be, with the axis's
// label: how many sandboxes were running (density's "children"), how many
// forks were made at once (the snapshot suite's "n"), how many requests
// were in flight (the daemon suite's "concurrency").
var ScaleParams = map[string]string{
	"children":    "sandboxes running",
	"n":           "forks made at once",
	"concurrency": "requests in flight",
}

// panels draws several measures in one plot: the density curve's
// per-sandbox memory, split into guest RAM and VMM process.
var panels = map[string]string{
	"density-guest-pss": "density-pss-per-sandbox",
	"density-vmm-pss":   "density-pss-per-sandbox",
	"density-total-pss": "density-pss-per-sandbox",
}

// Curve is medians (and tails) of one measure, or of a panel's measures,
// against a numeric param: density (memory against sandboxes running),
// fork scaling (latency against forks at once), concurrency.
type Curve struct {
	Name    string // the measure's, or the panel's
	KVMMode string
	X       string // the param on the x axis (a key of ScaleParams)
	Params  string // the other params, "k=v, k=v"
	Unit    string
	Lines   []Line // sorted by label
}

// Line is one VMM's (or, in a panel, one measure's) points, by X.
type Line struct {
	Label  string
	Points []Point
}

// Point is the statistics of the samples at one X.
type Point struct {
	X float64
	Stats
}

// Curves finds, among groups, the measures taken at two or more values of
// one of ScaleParams with their other params equal, and returns each as a
// curve, in a stable order. A param value that is not a number leaves its
// group out of the curve.
func Curves(groups []*Group) ([]*Curve, error) {
	byKey := map[string]*Curve{}
	lines := map[string]map[string]*Line{}
	for _, g := range groups {
		for x := range ScaleParams {
			xs, ok := g.ParamValues[x]
			if !ok {
				continue
			}
			xv, err := strconv.ParseFloat(xs, 64)
			if err != nil {
				continue
			}
			rest := make(map[string]string, len(g.ParamValues))
			for k, v := range g.ParamValues {
				if k != x {
					rest[k] = v
				}
			}
			name, panel := g.Name, panels[g.Name]
			if panel != "" {
				name = panel
			}
			params := paramString(rest)
			key := g.KVMMode + "\x00" + name + "\x00" + x + "\x00" + params
			c := byKey[key]
			if c == nil {
				c = &Curve{Name: name, KVMMode: g.KVMMode, X: x, Params: params, Unit: g.Unit}
				byKey[key] = c
				lines[key] = map[string]*Line{}
			}
			if c.Unit != g.Unit {
				return nil, fmt.Errorf("report: curve %s by %s mixes %s and %s", name, x, c.Unit, g.Unit)
			}
			for vmm, samples := range g.Series {
				label := vmm
				if panel != "" {
					label = g.Name
					if vmm != results.VMMKiln {
						label += " (" + vmm + ")"
					}
				}
				l := lines[key][label]
				if l == nil {
					l = &Line{Label: label}
					lines[key][label] = l
				}
				l.Points = append(l.Points, Point{X: xv, Stats: StatsOf(samples)})
			}
		}
	}
	var out []*Curve
	for key, c := range byKey {
		xs := map[float64]bool{}
		for _, l := range lines[key] {
			sort.Slice(l.Points, func(i, j int) bool { return l.Points[i].X < l.Points[j].X })
			for _, p := range l.Points {
				xs[p.X] = true
			}
			c.Lines = append(c.Lines, *l)
		}
		if len(xs) < 2 {
			continue
		}
		sort.Slice(c.Lines, func(i, j int) bool { return c.Lines[i].Label < c.Lines[j].Label })
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := out[i], out[j]
		if a.KVMMode != b.KVMMode {
			return a.KVMMode < b.KVMMode
		}
		if a.Name != b.Name {
			return a.Name < b.Name
		}
		if a.X != b.X {
			return a.X < b.X
		}
		return a.Params < b.Params
	})
	return out, nil
}

// Slug is c's plot file name (without .svg).
func (c *Curve) Slug() string {
	s := c.KVMMode + "-" + c.Name + "-by-" + c.X
	if c.Params != "" {
		s += "-" + c.Params
	}
	return slug(s)
}

// WriteCurves draws each curve into dir/SLUG.svg: the median at each X as
// a solid line with points, and, where some X has more than one sample,
// the p95 as a dashed line of the same colour. It returns the files'
// names.
func WriteCurves(dir string, curves []*Curve) ([]string, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("report: %w", err)
	}
	var files []string
	for _, c := range curves {
		p := plot.New()
		p.Title.Text = c.Name + " by " + c.X + " (" + c.KVMMode + " KVM)"
		if c.Params != "" {
			params := c.Params
			if len(params) > 110 {
				params = params[:107] + "..."
			}
			p.Title.Text += "\n" + params
		}
		scale, label := axis(c.Unit)
		p.X.Label.Text = ScaleParams[c.X]
		p.Y.Label.Text = label + " (median; dashed: p95)"
		p.Y.Min = 0
		for i, l := range c.Lines {
			med := make(plotter.XYs, len(l.Points))
			p95 := make(plotter.XYs, len(l.Points))
			tails := false
			for j, pt := range l.Points {
				med[j].X, med[j].Y = pt.X, pt.Median*scale
				p95[j].X, p95[j].Y = pt.X, pt.P95*scale
				tails = tails || pt.N > 1
			}
			line, points, err := plotter.NewLinePoints(med)
			if err != nil {
				return files, fmt.Errorf("report: %s: %w", c.Name, err)
			}
			col := plotutil.Color(i)
			line.Color, points.Color, points.Shape = col, col, plotutil.Shape(i)
			p.Add(line, points)
			p.Legend.Add(l.Label, line, points)
			if tails {
				tail, err := plotter.NewLine(p95)
				if err != nil {
					return files, fmt.Errorf("report: %s: %w", c.Name, err)
				}
				tail.Color = faded(col)
				tail.Dashes = []vg.Length{vg.Points(4), vg.Points(3)}
				p.Add(tail)
				p.Legend.Add(l.Label+" p95", tail)
			}
		}
		p.Legend.Top = true
		p.Legend.Left = true
		name := c.Slug() + ".svg"
		if err := p.Save(6*vg.Inch, 4*vg.Inch, filepath.Join(dir, name)); err != nil {
			return files, fmt.Errorf("report: %s: %w", name, err)
		}
		files = append(files, name)
	}
	return files, nil
}

// faded is c lighter, for a tail line beside its median.
func faded(c color.Color) color.Color {
	r, g, b, _ := c.RGBA()
	mix := func(v uint32) uint8 { return uint8((v>>8)/2 + 0x80) }
	return color.RGBA{R: mix(r), G: mix(g), B: mix(b), A: 0xff}
}

// CurveTitle is a one-line caption for c in tables.md.
func CurveTitle(c *Curve) string {
	t := c.Name + " by " + c.X + ", " + c.KVMMode + " KVM"
	if c.Params != "" {
		t += " (" + strings.ReplaceAll(c.Params, "|", "/") + ")"
	}
	return t
}
