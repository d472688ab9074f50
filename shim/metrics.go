package shim

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/containerd/cgroups/v3/cgroup2/stats"
	"github.com/containerd/containerd/protobuf"
	"github.com/containerd/typeurl/v2"
	"google.golang.org/protobuf/types/known/anypb"
)

// Bounds on the guest files Stats reads: the guest is not trusted.
const maxProcFile = 64 << 10

// guestMetrics reads the guest's /proc/meminfo, /proc/stat and
// /proc/loadavg (through the agent) into cgroup v2 metrics: memory in use
// and the guest's total, CPU time used, processes.
func guestMetrics(ctx context.Context, vm VM) (*anypb.Any, error) {
	read := func(path string) ([]byte, error) {
		var b bytes.Buffer
		if _, err := vm.ReadFile(ctx, path, &limitWriter{w: &b, n: maxProcFile}); err != nil {
			return nil, fmt.Errorf("reading the guest's %s: %w", path, err)
		}
		return b.Bytes(), nil
	}
	mem, err := read("/proc/meminfo")
	if err != nil {
		return nil, err
	}
	st, err := read("/proc/stat")
	if err != nil {
		return nil, err
	}
	load, err := read("/proc/loadavg")
	if err != nil {
		return nil, err
	}
	a, err := typeurl.MarshalAny(parseMetrics(mem, st, load))
	if err != nil {
		return nil, err
	}
	return protobuf.FromAny(a), nil
}

// parseMetrics turns the guest's proc files into metrics; what it cannot
// parse stays zero.
func parseMetrics(meminfo, stat, loadavg []byte) *stats.Metrics {
	m := &stats.Metrics{Memory: &stats.MemoryStat{}, CPU: &stats.CPUStat{}, Pids: &stats.PidsStat{}}
	kb := map[string]uint64{}
	sc := bufio.NewScanner(bytes.NewReader(meminfo))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 {
			if v, err := strconv.ParseUint(f[1], 10, 64); err == nil {
				kb[strings.TrimSuffix(f[0], ":")] = v
			}
		}
	}
	total, avail := kb["MemTotal"], kb["MemAvailable"]
	if avail <= total {
		m.Memory.Usage = (total - avail) * 1024
	}
	m.Memory.UsageLimit = total * 1024
	m.Memory.File = (kb["Cached"] + kb["Buffers"]) * 1024
	m.Memory.Anon = kb["AnonPages"] * 1024
	sc = bufio.NewScanner(bytes.NewReader(stat))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 4 || f[0] != "cpu" {
			continue
		}
		// USER_HZ is 100 on Linux: one tick is 10 ms.
		tick := func(i int) uint64 {
			if i >= len(f) {
				return 0
			}
			v, _ := strconv.ParseUint(f[i], 10, 64)
			return v * 10000
		}
		m.CPU.UserUsec = tick(1) + tick(2)
		m.CPU.SystemUsec = tick(3)
		m.CPU.UsageUsec = m.CPU.UserUsec + m.CPU.SystemUsec
		break
	}
	// loadavg's fourth field: running/total scheduling entities.
	if f := strings.Fields(string(loadavg)); len(f) >= 4 {
		if _, n, ok := strings.Cut(f[3], "/"); ok {
			if v, err := strconv.ParseUint(n, 10, 64); err == nil {
				m.Pids.Current = v
			}
		}
	}
	return m
}

// limitWriter keeps the first n bytes and drops the rest.
type limitWriter struct {
	w io.Writer
	n int
}

func (l *limitWriter) Write(p []byte) (int, error) {
	k := len(p)
	if len(p) > l.n {
		p = p[:l.n]
	}
	l.n -= len(p)
	if len(p) > 0 {
		if _, err := l.w.Write(p); err != nil {
			return 0, err
		}
	}
	return k, nil
}
