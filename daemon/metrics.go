package daemon

import (
	"bufio"
	"errors"
	"net/http"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// The server's Prometheus metrics, in a registry of its own (no global
// state): MetricsHandler serves them. Counters and histograms count what
// the API was asked and how it went; the gauges are read from the
// server's state at each scrape. Every label has a bounded set of values:
// a failure's reason is a class (failureReason), never an error's text.
const metricsNamespace = "kiln"

// Operations of the counters and of kiln_failures_total.
const (
	opCreate   = "create"
	opFork     = "fork"
	opRollback = "rollback"
	opExec     = "exec"
	opTemplate = "template"
	// opSandbox: a running sandbox that failed (its VMM process died, its
	// guest powered off on its own).
	opSandbox = "sandbox"
)

// Results of the counters.
const (
	resultOK    = "ok"
	resultError = "error"
)

// latencyBuckets are the histograms' buckets, in seconds: from a restore
// of a warm snapshot to a cold boot under emulation.
var latencyBuckets = []float64{.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300}

// metrics are a server's metrics.
type metrics struct {
	reg *prometheus.Registry

	creates         *prometheus.CounterVec   // source, result
	createSeconds   *prometheus.HistogramVec // source
	forks           *prometheus.CounterVec   // result
	forkSeconds     prometheus.Histogram
	forkChildren    prometheus.Counter
	rollbacks       *prometheus.CounterVec // result
	rollbackSeconds prometheus.Histogram
	execs           *prometheus.CounterVec // result
	execSeconds     prometheus.Histogram   // to the process started
	templates       *prometheus.CounterVec // result
	failures        *prometheus.CounterVec // op, reason
	ended           *prometheus.CounterVec // state
}

func newMetrics(s *Server) *metrics {
	reg := prometheus.NewRegistry()
	f := func(name, help string, labels ...string) *prometheus.CounterVec {
		return prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: metricsNamespace, Name: name, Help: help}, labels)
	}
	h := func(name, help string) prometheus.HistogramOpts {
		return prometheus.HistogramOpts{Namespace: metricsNamespace, Name: name, Help: help, Buckets: latencyBuckets}
	}
	m := &metrics{
		reg:             reg,
		creates:         f("sandbox_creates_total", "CreateSandbox calls, by source (image, template, checkpoint, pool) and result.", "source", "result"),
		createSeconds:   prometheus.NewHistogramVec(h("sandbox_create_seconds", "Time of a CreateSandbox call that made a sandbox, to its agent answering, by source."), []string{"source"}),
		forks:           f("sandbox_forks_total", "Fork calls, by result.", "result"),
		forkSeconds:     prometheus.NewHistogram(h("sandbox_fork_seconds", "Time of a Fork call that made its children.")),
		forkChildren:    prometheus.NewCounter(prometheus.CounterOpts{Namespace: metricsNamespace, Name: "sandbox_fork_children_total", Help: "Children made by Fork calls."}),
		rollbacks:       f("sandbox_rollbacks_total", "Rollback calls (a sandbox restored in place from a checkpoint), by result.", "result"),
		rollbackSeconds: prometheus.NewHistogram(h("sandbox_rollback_seconds", "Time of a Rollback that restored its sandbox.")),
		execs:           f("execs_total", "Exec calls, by result: ok once the process started (whatever its exit), error when it did not.", "result"),
		execSeconds:     prometheus.NewHistogram(h("exec_start_seconds", "Time from an Exec call to its process started.")),
		templates:       f("template_builds_total", "CreateTemplate builds, by result.", "result"),
		failures:        f("failures_total", "Failures, by operation and reason class.", "op", "reason"),
		ended:           f("sandboxes_ended_total", "Sandboxes that ended, by final state.", "state"),
	}
	reg.MustRegister(m.creates, m.createSeconds, m.forks, m.forkSeconds, m.forkChildren, m.rollbacks, m.rollbackSeconds,
		m.execs, m.execSeconds, m.templates, m.failures, m.ended,
		&stateCollector{s: s},
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{Namespace: metricsNamespace}))
	return m
}

// MetricsHandler serves the server's Prometheus metrics (kilnd mounts it
// on /metrics of its metrics address).
func (s *Server) MetricsHandler() http.Handler {
	return promhttp.HandlerFor(s.metrics.reg, promhttp.HandlerOpts{Registry: s.metrics.reg})
}

// MetricsRegistry is the server's own registry, for a caller that adds
// collectors of its own or gathers directly.
func (s *Server) MetricsRegistry() *prometheus.Registry { return s.metrics.reg }

func result(err error) string {
	if err != nil {
		return resultError
	}
	return resultOK
}

// failed counts a failure of op.
func (m *metrics) failed(op string, err error) {
	m.failures.WithLabelValues(op, failureReason(op, err)).Inc()
}

// createDone counts a CreateSandbox call.
func (m *metrics) createDone(source string, began time.Time, sb *kilnpb.Sandbox, err error) {
	if err == nil && sb.GetFromPool() {
		source = "pool"
	}
	m.creates.WithLabelValues(source, result(err)).Inc()
	if err != nil {
		m.failed(opCreate, err)
		return
	}
	m.createSeconds.WithLabelValues(source).Observe(time.Since(began).Seconds())
}

// opDone counts a call of op (fork, rollback, template) that took since
// began.
func (m *metrics) opDone(op string, began time.Time, err error) {
	var c *prometheus.CounterVec
	var h prometheus.Histogram
	switch op {
	case opFork:
		c, h = m.forks, m.forkSeconds
	case opRollback:
		c, h = m.rollbacks, m.rollbackSeconds
	case opTemplate:
		c = m.templates
	default:
		return
	}
	c.WithLabelValues(result(err)).Inc()
	if err != nil {
		m.failed(op, err)
	} else if h != nil {
		h.Observe(time.Since(began).Seconds())
	}
}

// execStarted counts an Exec call that started its process (err nil) or
// did not.
func (m *metrics) execStarted(began time.Time, err error) {
	m.execs.WithLabelValues(result(err)).Inc()
	if err != nil {
		m.failed(opExec, err)
		return
	}
	m.execSeconds.Observe(time.Since(began).Seconds())
}

// sandboxEnded counts a sandbox that ended in state.
func (m *metrics) sandboxEnded(state kilnpb.SandboxState) {
	m.ended.WithLabelValues(strings.ToLower(strings.TrimPrefix(state.String(), "SANDBOX_STATE_"))).Inc()
}

// The reason classes of kiln_failures_total.
const (
	reasonInvalidArgument    = "invalid_argument"
	reasonNotFound           = "not_found"
	reasonAlreadyExists      = "already_exists"
	reasonFailedPrecondition = "failed_precondition"
	reasonResourceExhausted  = "resource_exhausted"
	reasonBootTimeout        = "boot_timeout"
	reasonTimeout            = "timeout"
	reasonCanceled           = "canceled"
	reasonVMMExited          = "vmm_exited"
	reasonOutOfMemory        = "out_of_memory"
	reasonAgentUnreachable   = "agent_unreachable"
	reasonUnavailable        = "unavailable"
	reasonInternal           = "internal"
)

// failureReason is the class of op's failure err: one of a few reasons,
// never free text (a label's values must stay few).
func failureReason(op string, err error) string {
	if errors.Is(err, ErrMachineExited) {
		return reasonVMMExited
	}
	st := status.Convert(err)
	msg := strings.ToLower(st.Message())
	switch {
	case strings.Contains(msg, "out of memory") || strings.Contains(msg, "killed by its memory limit") || strings.Contains(msg, "oom-kill") || strings.Contains(msg, "oom kill"):
		return reasonOutOfMemory
	case strings.Contains(msg, "vmm process") && (strings.Contains(msg, "exit") || strings.Contains(msg, "died") ||
		strings.Contains(msg, "gone") || strings.Contains(msg, "signal") || strings.Contains(msg, "killed")):
		return reasonVMMExited
	}
	switch st.Code() {
	case codes.InvalidArgument, codes.OutOfRange:
		return reasonInvalidArgument
	case codes.NotFound:
		return reasonNotFound
	case codes.AlreadyExists:
		return reasonAlreadyExists
	case codes.FailedPrecondition:
		return reasonFailedPrecondition
	case codes.ResourceExhausted:
		return reasonResourceExhausted
	case codes.DeadlineExceeded:
		if op == opCreate || op == opFork || op == opRollback || op == opTemplate {
			return reasonBootTimeout
		}
		return reasonTimeout
	case codes.Canceled:
		return reasonCanceled
	case codes.Unavailable:
		if strings.Contains(msg, "agent") || strings.Contains(msg, "vsock") {
			return reasonAgentUnreachable
		}
		return reasonUnavailable
	}
	if strings.Contains(msg, "agent") {
		return reasonAgentUnreachable
	}
	return reasonInternal
}

// stateCollector reads the server's state at each scrape: sandboxes by
// state, the host's memory as admission counts it and as the kernel has
// it, templates' sandboxes and pools, checkpoints held.
type stateCollector struct{ s *Server }

var (
	descSandboxes = prometheus.NewDesc("kiln_sandboxes", "Live sandboxes, by state (template builders and pool sandboxes apart).", []string{"state"}, nil)
	descBuilding  = prometheus.NewDesc("kiln_template_builders", "Template builds under way (each a sandbox).", nil, nil)
	descCommitted = prometheus.NewDesc("kiln_host_memory_committed_bytes", "Guest memory the host's sandboxes, builders and pools have, as admission counts it.", nil, nil)
	descLimit     = prometheus.NewDesc("kiln_host_memory_limit_bytes", "Guest memory admission lets the host's sandboxes have in all.", nil, nil)
	descTotal     = prometheus.NewDesc("kiln_host_memory_total_bytes", "The host's memory, as the server takes it.", nil, nil)
	descAvailable = prometheus.NewDesc("kiln_host_memory_available_bytes", "The host's available memory (MemAvailable of /proc/meminfo).", nil, nil)
	descTmplLive  = prometheus.NewDesc("kiln_template_sandboxes", "Live sandboxes created from a template.", []string{"template"}, nil)
	descPoolSize  = prometheus.NewDesc("kiln_template_pool_size", "Sandboxes a template's pool keeps ready.", []string{"template"}, nil)
	descPoolReady = prometheus.NewDesc("kiln_template_pool_ready", "Sandboxes ready in a template's pool.", []string{"template"}, nil)
	descCkpts     = prometheus.NewDesc("kiln_checkpoints", "Checkpoints the server holds, in memory or persisted.", []string{"kind"}, nil)
	descForkReqs  = prometheus.NewDesc("kiln_fork_requests", "Fork request IDs the server remembers for retries: each until the last of its children is forgotten.", nil, nil)
)

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSandboxes, descBuilding, descCommitted, descLimit, descTotal, descAvailable,
		descTmplLive, descPoolSize, descPoolReady, descCkpts, descForkReqs} {
		ch <- d
	}
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.s
	const mib = 1 << 20
	states := map[string]int{"starting": 0, "running": 0, "paused": 0}
	perTemplate := map[string]int{}
	type poolInfo struct {
		size  uint32
		ready int
	}
	pools := map[string]poolInfo{}
	var memory, persisted, forkReqs int

	s.mu.Lock()
	used := s.buildingMiB + s.pooledMiB // as admitLocked counts
	building := s.building
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.life.get().live() {
			used += uint64(b.rec.MemoryMiB)
			states[strings.ToLower(strings.TrimPrefix(b.rec.State, "SANDBOX_STATE_"))]++
			if b.rec.Template != "" {
				perTemplate[b.rec.Template]++
			}
		}
		b.mu.Unlock()
	}
	for id, t := range s.templates {
		pi := poolInfo{size: t.rec.PoolSize}
		if t.pool != nil {
			pi.ready = t.pool.readyCount()
		}
		pools[id] = pi
	}
	for _, ck := range s.checkpoints {
		if ck.Persisted {
			persisted++
		} else {
			memory++
		}
	}
	forkReqs = len(s.forks)
	s.mu.Unlock()

	for st, n := range states {
		ch <- prometheus.MustNewConstMetric(descSandboxes, prometheus.GaugeValue, float64(n), st)
	}
	ch <- prometheus.MustNewConstMetric(descBuilding, prometheus.GaugeValue, float64(building))
	ch <- prometheus.MustNewConstMetric(descCommitted, prometheus.GaugeValue, float64(used*mib))
	ch <- prometheus.MustNewConstMetric(descLimit, prometheus.GaugeValue, float64(s.cfg.MaxMemoryMiB*mib))
	ch <- prometheus.MustNewConstMetric(descTotal, prometheus.GaugeValue, float64(s.cfg.HostMemoryMiB*mib))
	if avail, ok := memAvailable(); ok {
		ch <- prometheus.MustNewConstMetric(descAvailable, prometheus.GaugeValue, float64(avail))
	}
	for id, pi := range pools {
		ch <- prometheus.MustNewConstMetric(descTmplLive, prometheus.GaugeValue, float64(perTemplate[id]), id)
		ch <- prometheus.MustNewConstMetric(descPoolSize, prometheus.GaugeValue, float64(pi.size), id)
		ch <- prometheus.MustNewConstMetric(descPoolReady, prometheus.GaugeValue, float64(pi.ready), id)
	}
	ch <- prometheus.MustNewConstMetric(descCkpts, prometheus.GaugeValue, float64(memory), "memory")
	ch <- prometheus.MustNewConstMetric(descCkpts, prometheus.GaugeValue, float64(persisted), "persisted")
	ch <- prometheus.MustNewConstMetric(descForkReqs, prometheus.GaugeValue, float64(forkReqs))
}

// memAvailable reads MemAvailable from /proc/meminfo, in bytes.
func memAvailable() (uint64, bool) {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemAvailable:" {
			kb, err := strconv.ParseUint(fields[1], 10, 64)
			return kb * 1024, err == nil
		}
	}
	return 0, false
}

// createSource is a create's source, for the metrics.
func createSource(req *kilnpb.CreateSandboxRequest) string {
	switch req.GetSource().(type) {
	case *kilnpb.CreateSandboxRequest_Image:
		return "image"
	case *kilnpb.CreateSandboxRequest_Template:
		return "template"
	case *kilnpb.CreateSandboxRequest_Checkpoint:
		return "checkpoint"
	}
	return "none"
}
