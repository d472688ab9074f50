package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// What `kiln bench daemon` measures, each through kilnd (PathKilnd) and
// through package sandbox in this process (PathLibrary), so that the
// daemon's overhead shows beside the library's own figures.

// Paths a DaemonSet was measured on.
const (
	// PathKilnd is through a kilnd process, over its gRPC socket.
	PathKilnd = "kilnd"
	// PathLibrary is package sandbox called in this process, each VM in a
	// VMM process of its own (kiln-vmm), as kilnd runs them.
	PathLibrary = "library"
)

// Operations a DaemonSet times.
const (
	// OpCreate is a create from the template to its first exec of true
	// answered (library: sandbox.Restore of the template's snapshot).
	OpCreate = "create"
	// OpCreatePool is OpCreate from a template's warm pool.
	OpCreatePool = "create-pool"
	// OpCheckpoint is Checkpoint{persist: false}: kilnd's in-memory one.
	OpCheckpoint = "checkpoint"
	// OpCheckpointPersist is Checkpoint{persist: true} (library:
	// Sandbox.Save to a folder).
	OpCheckpointPersist = "checkpoint-persist"
	// OpRollback is Rollback to an OpCheckpoint's checkpoint, to the
	// first exec answered after it.
	OpRollback = "rollback"
	// OpRollbackPersist is Rollback to an OpCheckpointPersist's
	// checkpoint (library: closing the sandbox and sandbox.Restore of its
	// save), to the first exec answered after it.
	OpRollbackPersist = "rollback-persist"
	// OpDestroy is DestroySandbox (library: Sandbox.Close).
	OpDestroy = "destroy"
)

// KVM modes a DaemonEnv reports.
const (
	// KVMDirect is /dev/kvm on bare metal: no hypervisor under the host.
	KVMDirect = "direct"
	// KVMNested is /dev/kvm in a VM with hardware-assisted nesting.
	KVMNested = "nested"
	// KVMEmulated is /dev/kvm in a VM whose CPU QEMU emulates (TCG, the
	// test harness's L1): some 50 times slower than direct.
	KVMEmulated = "emulated"
)

// LatencyStats summarizes one set of latencies. The percentiles are
// nearest-rank, as Percentile.
type LatencyStats struct {
	N      int           `json:"n"`
	Errors int           `json:"errors"`
	Mean   time.Duration `json:"mean_ns"`
	P50    time.Duration `json:"p50_ns"`
	P95    time.Duration `json:"p95_ns"`
	P99    time.Duration `json:"p99_ns"`
	Min    time.Duration `json:"min_ns"`
	Max    time.Duration `json:"max_ns"`
}

// SummarizeLatencies is ds's LatencyStats, with errs failed attempts
// beside them; the zero durations for none.
func SummarizeLatencies(ds []time.Duration, errs int) LatencyStats {
	s := LatencyStats{N: len(ds), Errors: errs}
	if len(ds) == 0 {
		return s
	}
	var sum float64
	for _, d := range ds {
		sum += float64(d)
	}
	s.Mean = time.Duration(math.Round(sum / float64(len(ds))))
	s.P50, s.P95, s.P99 = Percentile(ds, 50), Percentile(ds, 95), Percentile(ds, 99)
	s.Min, s.Max = slices.Min(ds), slices.Max(ds)
	return s
}

// DaemonSample is one timed operation.
type DaemonSample struct {
	// At is when it began, from the start of the run.
	At time.Duration `json:"at_ns"`
	// Total is the latency its set's Op names (0 when it failed).
	Total time.Duration `json:"total_ns"`
	// Call is the create, rollback or fork call alone, before the first
	// exec; 0 where the set has no separate call.
	Call time.Duration `json:"call_ns,omitempty"`
	// ReadyMS is kilnd's own figure for a create: the request to the
	// agent answering (Sandbox.ready_ms).
	ReadyMS int64 `json:"ready_ms,omitempty"`
	// FromPool says kilnd handed out a pooled sandbox.
	FromPool bool `json:"from_pool,omitempty"`
	// Err is why it failed ("" when it did not).
	Err string `json:"error,omitempty"`
}

// DaemonSet is the samples of one operation on one path at one
// concurrency.
type DaemonSet struct {
	Op          string         `json:"op"`
	Path        string         `json:"path"`
	Concurrency int            `json:"concurrency"`
	Samples     []DaemonSample `json:"samples"`
}

// Stats summarizes the set's successful samples and counts its failures.
func (s DaemonSet) Stats() LatencyStats {
	var ds []time.Duration
	errs := 0
	for _, x := range s.Samples {
		if x.Err != "" {
			errs++
			continue
		}
		ds = append(ds, x.Total)
	}
	return SummarizeLatencies(ds, errs)
}

// FirstError is the first failed sample's error, "" when none failed.
func (s DaemonSet) FirstError() string {
	for _, x := range s.Samples {
		if x.Err != "" {
			return x.Err
		}
	}
	return ""
}

// DaemonRate is a sustained create, exec and destroy loop.
type DaemonRate struct {
	Path    string `json:"path"`
	Workers int    `json:"workers"`
	// For is how long new sandboxes were started; Elapsed runs to the
	// last one's destroy.
	For     time.Duration `json:"for_ns"`
	Elapsed time.Duration `json:"elapsed_ns"`
	// Completed counts sandboxes created, answering an exec and
	// destroyed; Errors the loops that failed.
	Completed int `json:"completed"`
	Errors    int `json:"errors"`
	// Latency is create to first exec answered, over the completed ones.
	Latency  LatencyStats `json:"latency"`
	FirstErr string       `json:"first_error,omitempty"`
}

// PerSecond is the completed sandboxes per second of Elapsed.
func (r DaemonRate) PerSecond() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Completed) / r.Elapsed.Seconds()
}

// DaemonFork is one fork of N children from a running sandbox.
type DaemonFork struct {
	Path string `json:"path"`
	N    int    `json:"n"`
	// Ready is the fork call to every child reported ready (kilnd: the
	// Fork stream's last child; library: Sandbox.Fork's return).
	Ready time.Duration `json:"ready_ns"`
	// AllExec is the same start to every child's first exec of true
	// answered.
	AllExec time.Duration `json:"all_exec_ns"`
	Err     string        `json:"error,omitempty"`
}

// DaemonEnv is where a report was measured.
type DaemonEnv struct {
	Time      time.Time `json:"time"`
	Host      string    `json:"host"`
	CPU       string    `json:"cpu"`
	CPUs      int       `json:"cpus"`
	MemoryMiB int       `json:"memory_mib"`
	Kernel    string    `json:"kernel"`
	Commit    string    `json:"commit"`
	GoVersion string    `json:"go_version"`
	// KVM is KVMDirect, KVMNested or KVMEmulated; KVMWhy says how that
	// was told.
	KVM    string `json:"kvm"`
	KVMWhy string `json:"kvm_why"`
	// HugePages is the host's transparent huge page modes for anonymous
	// memory and for shmem (a cold-booted guest's RAM), "anon always,
	// shmem advise"; empty without them.
	HugePages string `json:"hugepages,omitempty"`
}

// DaemonReport is what RunDaemon measured.
type DaemonReport struct {
	Env  DaemonEnv  `json:"env"`
	Spec DaemonSpec `json:"spec"`
	// Source is what the creates start from: "template" (CreateTemplate)
	// or "checkpoint" (a kept checkpoint of a set-up sandbox, where kilnd
	// refuses templates); SourceID its ID.
	Source   string `json:"source"`
	SourceID string `json:"source_id"`
	// Snapshot is the folder the library path restores: the source's
	// snapshot in kilnd's state folder.
	Snapshot string `json:"snapshot"`
	// SourceCreate is the time kilnd took to make the source (boot, setup,
	// snapshot).
	SourceCreate time.Duration `json:"source_create_ns"`
	Sets         []DaemonSet   `json:"sets"`
	Rates        []DaemonRate  `json:"rates"`
	Forks        []DaemonFork  `json:"forks"`
	// Notes say what was skipped or failed, and why.
	Notes      []string      `json:"notes,omitempty"`
	LoadBefore string        `json:"load_before"`
	LoadAfter  string        `json:"load_after"`
	Took       time.Duration `json:"took_ns"`
}

// Set returns the report's set for op on path at concurrency (0: any),
// and whether there is one.
func (rep DaemonReport) Set(op, path string, concurrency int) (DaemonSet, bool) {
	for _, s := range rep.Sets {
		if s.Op == op && s.Path == path && (concurrency == 0 || s.Concurrency == concurrency) {
			return s, true
		}
	}
	return DaemonSet{}, false
}

// WriteJSON writes the report as indented JSON.
func (rep DaemonReport) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(rep); err != nil {
		return fmt.Errorf("bench: daemon report: %w", err)
	}
	return nil
}

// ms formats d in milliseconds with one decimal.
func msString(d time.Duration) string {
	return fmt.Sprintf("%.1f", float64(d)/float64(time.Millisecond))
}

// overhead is kilnd's figure over the library's, "-" without both.
func overhead(kilnd, lib time.Duration) string {
	if kilnd <= 0 || lib <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.2f", float64(kilnd)/float64(lib))
}

// Print writes the report as tables, milliseconds throughout.
func (rep DaemonReport) Print(w io.Writer) {
	e := rep.Env
	fmt.Fprintf(w, "kilnd beside the library path: %s, %d CPUs, %d MiB; kernel %s; commit %s; KVM %s (%s)\n",
		e.CPU, e.CPUs, e.MemoryMiB, e.Kernel, e.Commit, e.KVM, e.KVMWhy)
	fmt.Fprintf(w, "source: %s %s (made in %s ms); guest %d MiB; load average %s before, %s after; took %v\n",
		rep.Source, rep.SourceID, msString(rep.SourceCreate), rep.Spec.MemoryMiB, rep.LoadBefore, rep.LoadAfter, rep.Took.Round(time.Second))
	row := func(label string, s DaemonSet) {
		st := s.Stats()
		fmt.Fprintf(w, "%-20s %-8s %5d %4d %4d %9s %9s %9s %9s %9s\n", label, s.Path, s.Concurrency, st.N, st.Errors,
			msString(st.Mean), msString(st.P50), msString(st.P95), msString(st.P99), msString(st.Max))
		if e := s.FirstError(); e != "" {
			fmt.Fprintf(w, "%-20s   first error: %s\n", "", e)
		}
	}
	header := func() {
		fmt.Fprintf(w, "%-20s %-8s %5s %4s %4s %9s %9s %9s %9s %9s\n", "op", "path", "conc", "n", "err", "mean", "p50", "p95", "p99", "max")
	}
	fmt.Fprintln(w, "\ncreate from the template to the first exec of true answered, ms:")
	header()
	for _, op := range []string{OpCreate, OpCreatePool} {
		for _, s := range rep.Sets {
			if s.Op == op {
				row(op, s)
			}
		}
	}
	var pairs []string
	for _, s := range rep.Sets {
		if s.Op != OpCreate || s.Path != PathKilnd {
			continue
		}
		if l, ok := rep.Set(OpCreate, PathLibrary, s.Concurrency); ok {
			k, lb := s.Stats(), l.Stats()
			pairs = append(pairs, fmt.Sprintf("at %d: p50 %s, p95 %s, mean %s", s.Concurrency,
				overhead(k.P50, lb.P50), overhead(k.P95, lb.P95), overhead(k.Mean, lb.Mean)))
		}
	}
	if len(pairs) > 0 {
		fmt.Fprintf(w, "kilnd / library: %s\n", strings.Join(pairs, "; "))
	}
	if p, ok := rep.Set(OpCreatePool, PathKilnd, 0); ok {
		n := 0
		for _, x := range p.Samples {
			if x.FromPool {
				n++
			}
		}
		fmt.Fprintf(w, "pool: %d of %d creates were handed a pooled sandbox\n", n, len(p.Samples))
	}
	if len(rep.Rates) > 0 {
		fmt.Fprintln(w, "\nsustained create, exec of true and destroy:")
		fmt.Fprintf(w, "%-8s %7s %8s %9s %6s %10s %9s %9s\n", "path", "workers", "for s", "completed", "errors", "per second", "p50 ms", "p95 ms")
		for _, r := range rep.Rates {
			fmt.Fprintf(w, "%-8s %7d %8.0f %9d %6d %10.2f %9s %9s\n", r.Path, r.Workers, r.For.Seconds(), r.Completed, r.Errors,
				r.PerSecond(), msString(r.Latency.P50), msString(r.Latency.P95))
			if r.FirstErr != "" {
				fmt.Fprintf(w, "         first error: %s\n", r.FirstErr)
			}
		}
	}
	if len(rep.Forks) > 0 {
		fmt.Fprintln(w, "\nfork of N from a running sandbox, ms:")
		fmt.Fprintf(w, "%-8s %4s %14s %18s\n", "path", "N", "all ready", "all first execs")
		for _, f := range rep.Forks {
			if f.Err != "" {
				fmt.Fprintf(w, "%-8s %4d failed: %s\n", f.Path, f.N, f.Err)
				continue
			}
			fmt.Fprintf(w, "%-8s %4d %14s %18s\n", f.Path, f.N, msString(f.Ready), msString(f.AllExec))
		}
	}
	var cks []DaemonSet
	for _, s := range rep.Sets {
		switch s.Op {
		case OpCheckpoint, OpCheckpointPersist, OpRollback, OpRollbackPersist, OpDestroy:
			cks = append(cks, s)
		}
	}
	if len(cks) > 0 {
		fmt.Fprintln(w, "\ncheckpoint, rollback (to the first exec answered) and destroy, ms:")
		header()
		for _, s := range cks {
			row(s.Op, s)
		}
	}
	for _, n := range rep.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}

// DetectEnv describes this machine; kvm, when set, is the KVM mode to
// report instead of the one /proc/cpuinfo suggests.
func DetectEnv(kvm string) DaemonEnv {
	e := DaemonEnv{Time: time.Now().UTC(), CPUs: runtime.NumCPU(), GoVersion: runtime.Version(), Commit: commit()}
	e.Host, _ = os.Hostname()
	var u unix.Utsname
	if unix.Uname(&u) == nil {
		e.Kernel = unix.ByteSliceToString(u.Release[:])
	}
	if b, err := os.ReadFile("/proc/meminfo"); err == nil {
		e.MemoryMiB = memTotalMiB(string(b))
	}
	cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
	e.CPU = cpuModel(string(cpuinfo))
	e.KVM, e.KVMWhy = KVMMode(string(cpuinfo))
	e.HugePages = hugePageModes("/sys/kernel/mm/transparent_hugepage")
	if kvm != "" {
		e.KVM, e.KVMWhy = kvm, "given, not detected"
	}
	return e
}

// hugePageModes reads the bracketed modes of dir's enabled and
// shmem_enabled ("anon always, shmem advise"), "" where neither is there.
func hugePageModes(dir string) string {
	var out []string
	for _, f := range []struct{ name, file string }{{"anon", "enabled"}, {"shmem", "shmem_enabled"}} {
		b, err := os.ReadFile(filepath.Join(dir, f.file))
		if err != nil {
			continue
		}
		mode := strings.TrimSpace(string(b))
		if i, j := strings.IndexByte(mode, '['), strings.IndexByte(mode, ']'); i >= 0 && j > i {
			mode = mode[i+1 : j]
		}
		out = append(out, f.name+" "+mode)
	}
	return strings.Join(out, ", ")
}

// KVMMode tells from /proc/cpuinfo's text how this machine's KVM runs:
// KVMDirect without the hypervisor flag, KVMEmulated when the CPU is
// QEMU's TCG, KVMNested otherwise; why says what it went by.
func KVMMode(cpuinfo string) (mode, why string) {
	model := cpuModel(cpuinfo)
	hyper := false
	sc := bufio.NewScanner(strings.NewReader(cpuinfo))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "flags" {
			hyper = slices.Contains(strings.Fields(v), "hypervisor")
			break
		}
	}
	switch {
	case strings.Contains(model, "TCG"):
		return KVMEmulated, fmt.Sprintf("CPU %q is QEMU's emulator", model)
	case hyper:
		return KVMNested, fmt.Sprintf("CPU %q has the hypervisor flag: nested KVM", model)
	}
	return KVMDirect, fmt.Sprintf("CPU %q has no hypervisor flag", model)
}

// cpuModel is the first "model name" of /proc/cpuinfo, "?" without one.
func cpuModel(cpuinfo string) string {
	sc := bufio.NewScanner(strings.NewReader(cpuinfo))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == "model name" {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// memTotalMiB is /proc/meminfo's MemTotal in MiB, 0 without it.
func memTotalMiB(meminfo string) int {
	sc := bufio.NewScanner(strings.NewReader(meminfo))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) >= 2 && f[0] == "MemTotal:" {
			var kb int
			if _, err := fmt.Sscan(f[1], &kb); err == nil {
				return kb / 1024
			}
		}
	}
	return 0
}

// commit is the VCS revision this binary was built from ("+dirty" when
// its tree was modified), else the working directory's git HEAD, else "?".
func commit() string {
	if bi, ok := debug.ReadBuildInfo(); ok {
		rev, dirty := "", false
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
		if rev != "" {
			if dirty {
				rev += "+dirty"
			}
			return rev
		}
	}
	if out, err := exec.Command("git", "rev-parse", "HEAD").Output(); err == nil {
		return strings.TrimSpace(string(out))
	}
	return "?"
}
