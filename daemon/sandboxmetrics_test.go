package daemon_test

import (
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

func (e *env) metrics(id string, since int64) []*kilnpb.SandboxMetrics {
	e.t.Helper()
	r, err := e.c.GetSandboxMetrics(ctxT(e.t), &kilnpb.GetSandboxMetricsRequest{Id: id, SinceUnixMs: since})
	if err != nil {
		e.t.Fatalf("metrics of %s: %v", id, err)
	}
	return r.Samples
}

// waitSamples waits until sandbox id's ring has n samples (the call's own
// sample is the n+1st).
func (e *env) waitSamples(id string, n int) []*kilnpb.SandboxMetrics {
	e.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		s := e.metrics(id, 0)
		if len(s) >= n+1 {
			return s
		}
		if time.Now().After(deadline) {
			e.t.Fatalf("%d samples of %s, want %d", len(s), id, n+1)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestSandboxMetrics: samples of memory, disk and CPU in a bounded ring,
// one more at the call; none taken while paused; sampling is not
// activity (the idle timeout fires); a sandbox that ended has none.
func TestSandboxMetrics(t *testing.T) {
	e := newEnv(t, func(c *daemon.Config) { c.SampleInterval = 2 * time.Millisecond })
	sb := e.create(&kilnpb.CreateSandboxRequest{IdleTimeoutMs: 60_000, Resources: &kilnpb.Resources{Cpus: 2, MemoryMib: 256}})
	e.sh(sb.Id, `head -c 1048576 /dev/zero > "$KILN_TEST_ROOT/big"`)
	s := e.waitSamples(sb.Id, 2)
	last := s[len(s)-1]
	if last.CpuCount != 2 || last.MemTotalBytes != 256<<20 || last.DiskUsedBytes < 1<<20 || last.DiskTotalBytes < last.DiskUsedBytes ||
		last.MemUsedBytes < 1<<20 || last.MemUsedBytes > last.MemTotalBytes {
		t.Errorf("sample %v", last)
	}
	for _, m := range s {
		if m.CpuUsedPct < 0 || m.CpuUsedPct > 100 {
			t.Errorf("cpu %v%%", m.CpuUsedPct)
		}
	}
	// The ring is bounded: 120 kept, and the call's.
	s = e.waitSamples(sb.Id, 120)
	if len(s) != 121 {
		t.Errorf("%d samples, want 121", len(s))
	}
	if got := e.metrics(sb.Id, e.clock.Now().UnixMilli()+1); len(got) != 1 {
		t.Errorf("%d samples after now, want the call's only", len(got))
	}
	// Paused: no sample at the call, none taken meanwhile (the ring
	// stands still).
	if _, err := e.c.PauseSandbox(ctxT(t), &kilnpb.PauseSandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // a sample under way when it paused is in
	e.clock.Advance(time.Second)      // later samples would have a later time
	time.Sleep(50 * time.Millisecond)
	if got := e.metrics(sb.Id, e.clock.Now().UnixMilli()); len(got) != 0 {
		t.Errorf("%d samples of a paused sandbox", len(got))
	}
	if _, err := e.c.ResumeSandbox(ctxT(t), &kilnpb.ResumeSandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	// Sampling is not activity.
	e.waitSamples(sb.Id, 120)
	e.clock.Advance(61 * time.Second)
	e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT)
	_, err := e.c.GetSandboxMetrics(ctxT(t), &kilnpb.GetSandboxMetricsRequest{Id: sb.Id})
	wantCode(t, err, codes.FailedPrecondition, "ended")
	_, err = e.c.GetSandboxMetrics(ctxT(t), &kilnpb.GetSandboxMetricsRequest{Id: "sb-nope"})
	wantCode(t, err, codes.NotFound, "")
}
