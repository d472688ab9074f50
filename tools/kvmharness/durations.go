package main

import (
	"bufio"
	_ "embed"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
)

// expectedDurations is how long each KVM test's L1 ran in a recent whole
// suite run under TCG (durations.txt, written by -durations-out), so that
// the pool starts the longest first and no long test is left to run alone
// at the end. A test missing from it is taken to need unknownDuration.
//
//go:embed durations.txt
var expectedDurations string

// unknownDuration is what a KVM test not in durations.txt is expected to
// take: about a restore and a few checks under TCG.
const unknownDuration = 90 * time.Second

// parseDurations reads lines of "TestName seconds" (blank lines and lines
// starting with # are skipped). A malformed line is an error naming it.
func parseDurations(r io.Reader) (map[string]time.Duration, error) {
	out := map[string]time.Duration{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 2 {
			return nil, fmt.Errorf("durations line %d: %q: want \"TestName seconds\"", n, line)
		}
		s, err := strconv.ParseFloat(f[1], 64)
		if err != nil || s < 0 || s > 1e6 {
			return nil, fmt.Errorf("durations line %d: %q: seconds must be a number from 0 to 1e6", n, line)
		}
		out[f[0]] = seconds(s)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("reading durations: %w", err)
	}
	return out, nil
}

// writeDurations writes d in parseDurations' form, longest first.
func writeDurations(w io.Writer, d map[string]time.Duration) error {
	names := make([]string, 0, len(d))
	for n := range d {
		names = append(names, n)
	}
	slices.SortFunc(names, func(a, b string) int {
		if d[a] != d[b] {
			return int((d[b] - d[a]) / time.Millisecond)
		}
		return strings.Compare(a, b)
	})
	bw := bufio.NewWriter(w)
	fmt.Fprintln(bw, "# L1 seconds of each KVM test in a whole suite run (kvmharness -durations-out);")
	fmt.Fprintln(bw, "# the harness starts the longest first. Regenerate after adding slow tests.")
	for _, n := range names {
		fmt.Fprintf(bw, "%s %.1f\n", n, d[n].Seconds())
	}
	return bw.Flush()
}

// longestFirst returns phase's units ordered for the pool: those that take
// more than one slot first (each waits for the pool to empty, so it costs
// least before the others start), then by expected duration, longest
// first; ties keep their given order.
func longestFirst(phase []int, names []string, weight func(int) int, expected map[string]time.Duration) []int {
	exp := func(i int) time.Duration {
		if d, ok := expected[names[i]]; ok {
			return d
		}
		return unknownDuration
	}
	out := slices.Clone(phase)
	slices.SortStableFunc(out, func(a, b int) int {
		if wa, wb := weight(a), weight(b); wa != wb {
			return wb - wa
		}
		ea, eb := exp(a), exp(b)
		switch {
		case ea > eb:
			return -1
		case ea < eb:
			return 1
		}
		return 0
	})
	return out
}
