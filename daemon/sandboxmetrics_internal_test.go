package daemon

import (
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func TestParseCPUStat(t *testing.T) {
	for _, c := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"usage_usec 12345\nuser_usec 10000\nsystem_usec 2345\n", 12345, true},
		{"nr_periods 0\nusage_usec 7", 7, true},
		{"user_usec 1\n", 0, false},
		{"usage_usec x\n", 0, false},
		{"", 0, false},
	} {
		got, err := parseCPUStat([]byte(c.in))
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseCPUStat(%q) = %d, %v; want %d, ok %v", c.in, got, err, c.want, c.ok)
		}
	}
}

func TestParseProcStatCPU(t *testing.T) {
	fields := " S 1 2 3 4 5 6 7 8 9 10 300 45 0 0 20 0 1 0 100 1000 10"
	for _, c := range []struct {
		in   string
		want uint64
		ok   bool
	}{
		{"42 (kiln)" + fields, 345, true},
		{"42 (a b) c))" + fields, 345, true}, // a name with spaces and parentheses
		{"42 (kiln) S 1 2", 0, false},
		{"42 kiln" + fields, 0, false},
		{"42 (kiln) S 1 2 3 4 5 6 7 8 9 10 x 45", 0, false},
	} {
		got, err := parseProcStatCPU([]byte(c.in))
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseProcStatCPU(%q) = %d, %v; want %d, ok %v", c.in, got, err, c.want, c.ok)
		}
	}
}

func TestCPUPercent(t *testing.T) {
	for _, c := range []struct {
		used    uint64
		elapsed time.Duration
		cpus    int
		want    float64
	}{
		{500_000, time.Second, 1, 50},
		{500_000, time.Second, 2, 25},
		{3_000_000, time.Second, 2, 100}, // clamped
		{1, 0, 1, 0},
		{1, time.Second, 0, 0},
	} {
		if got := cpuPercent(c.used, c.elapsed, c.cpus); got != c.want {
			t.Errorf("cpuPercent(%d, %v, %d) = %v, want %v", c.used, c.elapsed, c.cpus, got, c.want)
		}
	}
}

func TestSampleRing(t *testing.T) {
	var r sampleRing
	for i := range sampleRingSize + 10 {
		r.push(&kilnpb.SandboxMetrics{UnixMs: int64(i)})
	}
	if len(r.samples) != sampleRingSize || r.samples[0].UnixMs != 10 || r.samples[sampleRingSize-1].UnixMs != sampleRingSize+9 {
		t.Errorf("ring: %d samples, first %d, last %d", len(r.samples), r.samples[0].UnixMs, r.samples[len(r.samples)-1].UnixMs)
	}
}

func FuzzParseProcStatCPU(f *testing.F) {
	f.Add([]byte("42 (kiln) S 1 2 3 4 5 6 7 8 9 10 300 45 0 0"))
	f.Add([]byte(")))"))
	f.Fuzz(func(t *testing.T, b []byte) {
		parseProcStatCPU(b)
		parseCPUStat(b)
	})
}
