package daemon_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"syscall"
	"testing"

	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// metricValue is the value of the metric name with labels (a counter's,
// a gauge's, or a histogram's sample count); -1 when there is none.
func metricValue(t *testing.T, srv *daemon.Server, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := srv.MetricsRegistry().Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			switch mf.GetType() {
			case dto.MetricType_COUNTER:
				return m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				return m.GetGauge().GetValue()
			case dto.MetricType_HISTOGRAM:
				return float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return -1
}

// TestMetrics: after creates, execs, failures and a sandbox whose VMM
// process dies, the counters, histograms and gauges say so, and the
// handler serves them in the text format.
func TestMetrics(t *testing.T) {
	e := newEnv(t, nil)
	ctx := ctxT(t)
	const n, m = 3, 4
	var sbs []*kilnpb.Sandbox
	for range n {
		sbs = append(sbs, e.create(nil))
	}
	for i := range m {
		e.sh(sbs[i%n].Id, "true")
	}
	// One failing create of each kind, one failing exec.
	_, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Template{Template: "no-such-template"}})
	wantCode(t, err, codes.NotFound, "")
	_, err = e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"},
		Resources: &kilnpb.Resources{MemoryMib: 1 << 20}})
	wantCode(t, err, codes.InvalidArgument, "")
	if r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sbs[0].Id, Argv: []string{"/no/such/binary"}}); r.err == nil {
		t.Fatal("exec of a missing binary succeeded")
	}
	// A checkpoint, a fork and a rollback.
	ck := e.checkpoint(sbs[0].Id, false)
	if _, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sbs[1].Id}, Count: 2}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.c.Rollback(ctx, &kilnpb.RollbackRequest{SandboxId: sbs[0].Id, CheckpointId: ck.Id}); err != nil {
		t.Fatal(err)
	}
	// A sandbox whose VMM process dies.
	syscall.Kill(int(sbs[2].Pid), syscall.SIGKILL)
	e.waitState(sbs[2].Id, kilnpb.SandboxState_SANDBOX_STATE_FAILED)
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Setup: setupScript})
	e.create(fromTemplate(tp.Id))

	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"kiln_sandbox_creates_total", map[string]string{"source": "image", "result": "ok"}, n},
		{"kiln_sandbox_creates_total", map[string]string{"source": "template", "result": "error"}, 1},
		{"kiln_sandbox_creates_total", map[string]string{"source": "image", "result": "error"}, 1},
		{"kiln_sandbox_creates_total", map[string]string{"source": "template", "result": "ok"}, 1},
		{"kiln_sandbox_create_seconds", map[string]string{"source": "image"}, n},
		{"kiln_execs_total", map[string]string{"result": "ok"}, m},
		{"kiln_execs_total", map[string]string{"result": "error"}, 1},
		{"kiln_exec_start_seconds", nil, m},
		{"kiln_failures_total", map[string]string{"op": "create", "reason": "not_found"}, 1},
		{"kiln_failures_total", map[string]string{"op": "create", "reason": "invalid_argument"}, 1},
		{"kiln_failures_total", map[string]string{"op": "exec", "reason": "not_found"}, 1},
		{"kiln_failures_total", map[string]string{"op": "sandbox", "reason": "vmm_exited"}, 1},
		{"kiln_sandbox_forks_total", map[string]string{"result": "ok"}, 1},
		{"kiln_sandbox_fork_children_total", nil, 2},
		{"kiln_sandbox_rollbacks_total", map[string]string{"result": "ok"}, 1},
		{"kiln_template_builds_total", map[string]string{"result": "ok"}, 1},
		{"kiln_sandboxes_ended_total", map[string]string{"state": "failed"}, 1}, // the killed one (the failed creates made none)
		{"kiln_sandboxes", map[string]string{"state": "running"}, n - 1 + 2 + 1},
		{"kiln_sandboxes", map[string]string{"state": "paused"}, 0},
		{"kiln_host_memory_committed_bytes", nil, float64((n - 1 + 2 + 1) * 512 << 20)},
		{"kiln_host_memory_total_bytes", nil, 16384 << 20},
		{"kiln_template_sandboxes", map[string]string{"template": tp.Id}, 1},
		{"kiln_template_pool_size", map[string]string{"template": tp.Id}, 0},
		{"kiln_checkpoints", map[string]string{"kind": "memory"}, 1},
	} {
		if got := metricValue(t, e.srv, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if got := metricValue(t, e.srv, "kiln_host_memory_available_bytes", nil); got <= 0 {
		t.Errorf("kiln_host_memory_available_bytes = %v", got)
	}
	if err := testutil.GatherAndCompare(e.srv.MetricsRegistry(), strings.NewReader(`
# HELP kiln_sandbox_forks_total Fork calls, by result.
# TYPE kiln_sandbox_forks_total counter
kiln_sandbox_forks_total{result="ok"} 1
`), "kiln_sandbox_forks_total"); err != nil {
		t.Error(err)
	}

	// The handler serves them.
	hs := httptest.NewServer(e.srv.MetricsHandler())
	defer hs.Close()
	resp, err := http.Get(hs.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`kiln_sandbox_creates_total{result="ok",source="image"} 3`, `kiln_execs_total{result="error"} 1`,
		`kiln_failures_total{op="sandbox",reason="vmm_exited"} 1`, "go_goroutines", "kiln_process_resident_memory_bytes"} {
		if !bytes.Contains(body, []byte(want)) {
			t.Errorf("/metrics has no %s", want)
		}
	}
}

// TestLogSandboxIDs: over a create, an exec and a destroy, every log line
// that is about a sandbox names it under "sandbox".
func TestLogSandboxIDs(t *testing.T) {
	var logs syncBuffer
	e := newEnv(t, jsonLog(&logs))
	sb := e.create(nil)
	e.sh(sb.Id, "echo hi")
	e.exec(ctxT(t), &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"/no/such/binary"}})
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(logs.Bytes()))
	for sc.Scan() {
		var line map[string]any
		if err := json.Unmarshal(sc.Bytes(), &line); err != nil {
			t.Fatalf("a log line is not JSON: %q: %v", sc.Text(), err)
		}
		msg, _ := line["msg"].(string)
		if !strings.Contains(sc.Text(), sb.Id) && !strings.Contains(msg, "sandbox") && !strings.Contains(msg, "exec") {
			continue
		}
		if line["sandbox"] != sb.Id {
			t.Errorf("a line about sandbox %s names no sandbox: %s", sb.Id, sc.Text())
		}
		seen[msg] = true
	}
	for _, msg := range []string{"sandbox running", "exec started", "exec exited", "exec did not start", "sandbox ended"} {
		if !seen[msg] {
			t.Errorf("no %q line in the log:\n%s", msg, logs.Bytes())
		}
	}
}
