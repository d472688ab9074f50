package daemon

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/internal/procstat"
)

// Sandbox metrics (GetSandboxMetrics): the server samples every running
// sandbox every Config.SampleInterval into a ring of its box: CPU from
// its cgroup's cpu.stat (usage_usec; without cgroups its VMM process's
// /proc/PID/stat), as percent of its vCPUs over the interval, and memory
// and disk from its agent's Info. Sampling is not activity (the idle
// timeout does not see it), skips paused sandboxes and stops with the
// instance it samples (a rollback, a hibernation or the sandbox's end).

const (
	defaultSampleInterval = 5 * time.Second
	sampleRingSize        = 120
	sampleTimeout         = 10 * time.Second
)

// sampleRing is a box's samples, oldest first, and the CPU use the last
// one was taken at; guarded by the box's mutex.
type sampleRing struct {
	samples []*kilnpb.SandboxMetrics
	cpuOf   Instance // the instance cpuUsec is of
	cpuUsec uint64
	cpuAt   time.Time // monotonic
}

func (r *sampleRing) push(m *kilnpb.SandboxMetrics) {
	if len(r.samples) == sampleRingSize {
		copy(r.samples, r.samples[1:])
		r.samples = r.samples[:sampleRingSize-1]
	}
	r.samples = append(r.samples, m)
}

// sample samples b's instance inst every SampleInterval until inst is no
// longer b's, b ends or the server closes.
func (s *Server) sample(b *box, inst Instance) {
	if s.cfg.SampleInterval < 0 {
		return
	}
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		t := time.NewTicker(s.cfg.SampleInterval)
		defer t.Stop()
		failures := 0
		for {
			select {
			case <-s.ctx.Done():
				return
			case <-inst.Done():
				return
			case <-t.C:
			}
			b.mu.Lock()
			st := b.life.get()
			mine := b.inst == inst && (st == boxRunning || st == boxPaused)
			paused := st == boxPaused
			if paused {
				b.samples.cpuAt = time.Time{} // the next sample starts afresh
			}
			b.mu.Unlock()
			if !mine {
				return
			}
			if paused {
				continue
			}
			if _, err := s.takeSample(b, inst, true); err != nil {
				// A guest that does not answer logs once per 100
				// failures in a row.
				if failures%100 == 0 {
					s.log.Debug("sandbox not sampled", "sandbox", b.id, "err", err)
				}
				failures++
			} else {
				failures = 0
			}
		}
	}()
}

// takeSample samples inst, b's instance; keep puts it into b's ring (and
// makes it the next CPU baseline).
func (s *Server) takeSample(b *box, inst Instance, keep bool) (*kilnpb.SandboxMetrics, error) {
	ctx, cancel := context.WithTimeout(s.ctx, sampleTimeout)
	defer cancel()
	info, err := inst.Info(ctx)
	if err != nil {
		return nil, err
	}
	usec, cpuErr := cpuUsage(inst)
	now := time.Now()
	b.mu.Lock()
	defer b.mu.Unlock()
	r := &b.samples
	m := &kilnpb.SandboxMetrics{
		UnixMs: s.clock.Now().UnixMilli(), CpuCount: b.rec.CPUs,
		MemTotalBytes: info.MemTotal, DiskTotalBytes: info.DiskTotal, DiskUsedBytes: min(info.DiskUsed, info.DiskTotal),
	}
	if info.MemAvailable < info.MemTotal {
		m.MemUsedBytes = info.MemTotal - info.MemAvailable
	}
	if cpuErr == nil && r.cpuOf == inst && !r.cpuAt.IsZero() {
		m.CpuUsedPct = cpuPercent(usec-min(r.cpuUsec, usec), now.Sub(r.cpuAt), int(b.rec.CPUs))
	}
	if keep {
		if cpuErr == nil {
			r.cpuOf, r.cpuUsec, r.cpuAt = inst, usec, now
		}
		r.push(m)
	}
	return proto.Clone(m).(*kilnpb.SandboxMetrics), nil
}

// cpuPercent is used µs of CPU over elapsed as percent of cpus CPUs,
// within 0 to 100.
func cpuPercent(used uint64, elapsed time.Duration, cpus int) float64 {
	if elapsed <= 0 || cpus <= 0 {
		return 0
	}
	pct := float64(used) / float64(elapsed.Microseconds()) / float64(cpus) * 100
	return min(max(pct, 0), 100)
}

// cpuUsage is the CPU time inst's VMM process has used, in µs: its
// cgroup's usage_usec, else its /proc/PID/stat's utime and stime.
func cpuUsage(inst Instance) (uint64, error) {
	if cg := cgroupOf(inst); cg != "" {
		b, err := os.ReadFile(filepath.Join(cg, "cpu.stat"))
		if err != nil {
			return 0, err
		}
		return parseCPUStat(b)
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", inst.PID()))
	if err != nil {
		return 0, err
	}
	ticks, err := parseProcStatCPU(b)
	if err != nil {
		return 0, err
	}
	return ticks * (1_000_000 / procstat.UserHZ), nil
}

// parseCPUStat reads usage_usec from a cgroup's cpu.stat.
func parseCPUStat(b []byte) (uint64, error) {
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(line, " ")
		if ok && k == "usage_usec" {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("daemon: cpu.stat usage_usec %q: %w", v, err)
			}
			return n, nil
		}
	}
	return 0, fmt.Errorf("daemon: cpu.stat has no usage_usec")
}

// parseProcStatCPU reads utime + stime (clock ticks) from /proc/PID/stat.
func parseProcStatCPU(b []byte) (uint64, error) {
	t, err := procstat.Parse(b)
	if err != nil {
		return 0, fmt.Errorf("daemon: %w", err)
	}
	return t.UTime + t.STime, nil
}

// GetSandboxMetrics returns a live sandbox's samples since
// since_unix_ms, oldest first, and, when it runs, one taken now (not
// activity: its idle timeout does not see it).
func (s *Server) GetSandboxMetrics(ctx context.Context, req *kilnpb.GetSandboxMetricsRequest) (*kilnpb.GetSandboxMetricsResponse, error) {
	b, err := s.lookup(req.GetId())
	if err != nil {
		return nil, err
	}
	if req.GetSinceUnixMs() < 0 {
		return nil, status.Errorf(codes.InvalidArgument, "since_unix_ms %d is negative", req.GetSinceUnixMs())
	}
	b.mu.Lock()
	st, refused := b.life.check(metricsOp) // refused once it is ending
	inst := b.inst
	running := st == boxRunning
	var out []*kilnpb.SandboxMetrics
	for _, m := range b.samples.samples {
		if m.UnixMs >= req.GetSinceUnixMs() {
			out = append(out, proto.Clone(m).(*kilnpb.SandboxMetrics))
		}
	}
	b.mu.Unlock()
	if refused != nil {
		return nil, refused
	}
	if running {
		m, err := s.takeSample(b, inst, false)
		if err != nil {
			return nil, callErr("sample sandbox "+b.id, err)
		}
		out = append(out, m)
	}
	return &kilnpb.GetSandboxMetricsResponse{Samples: out}, nil
}
