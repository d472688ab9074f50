package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/vmm"
)

// fakeKilndEnv makes this test binary a kilnd over package daemon's test
// double (daemontest: sandboxes are host folders, execs host processes),
// serving --listen unix:PATH with --state-dir, for RunDaemon's tests
// without KVM.
const fakeKilndEnv = "KILN_BENCH_FAKE_KILND"

func TestMain(m *testing.M) {
	if os.Getenv(fakeKilndEnv) == "1" {
		os.Exit(fakeKilnd(os.Args[1:]))
	}
	os.Exit(m.Run())
}

// fakeKilnd serves package daemon's server on daemontest's backend with
// the health service, as kilnd does, until SIGTERM.
func fakeKilnd(args []string) int {
	var sock, state string
	for i := 0; i+1 < len(args); i++ {
		switch args[i] {
		case "--listen":
			sock = strings.TrimPrefix(args[i+1], "unix:")
		case "--state-dir":
			state = args[i+1]
		}
	}
	ctx, cancel := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer cancel()
	srv, err := daemon.New(daemon.Config{StateDir: state, Backend: &daemontest.Backend{},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))})
	if err != nil {
		os.Stderr.WriteString("fake kilnd: " + err.Error() + "\n")
		return 1
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		os.Stderr.WriteString("fake kilnd: " + err.Error() + "\n")
		return 1
	}
	gs := grpc.NewServer()
	srv.Register(gs)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(gs, hs)
	hs.SetServingStatus("kiln.v1.Kiln", healthpb.HealthCheckResponse_SERVING)
	go gs.Serve(ln)
	<-ctx.Done()
	gs.Stop()
	srv.Close(context.Background())
	return 0
}

func msec(n int) time.Duration { return time.Duration(n) * time.Millisecond }

func TestSummarizeLatencies(t *testing.T) {
	hundred := make([]time.Duration, 100)
	for i := range hundred {
		hundred[i] = msec(100 - i) // 100 ms down to 1 ms
	}
	tests := []struct {
		name string
		ds   []time.Duration
		errs int
		want LatencyStats
	}{
		{name: "none", errs: 3, want: LatencyStats{Errors: 3}},
		{name: "one", ds: []time.Duration{msec(7)}, want: LatencyStats{N: 1, Mean: msec(7), P50: msec(7), P95: msec(7), P99: msec(7), Min: msec(7), Max: msec(7)}},
		{name: "unsorted", ds: []time.Duration{msec(30), msec(10), msec(20)}, errs: 1,
			want: LatencyStats{N: 3, Errors: 1, Mean: msec(20), P50: msec(20), P95: msec(30), P99: msec(30), Min: msec(10), Max: msec(30)}},
		{name: "hundred", ds: hundred,
			want: LatencyStats{N: 100, Mean: 50500 * time.Microsecond, P50: msec(50), P95: msec(95), P99: msec(99), Min: msec(1), Max: msec(100)}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := SummarizeLatencies(tt.ds, tt.errs); got != tt.want {
				t.Errorf("SummarizeLatencies = %+v, want %+v", got, tt.want)
			}
		})
	}
}

func TestDaemonSetStats(t *testing.T) {
	s := DaemonSet{Samples: []DaemonSample{{Total: msec(10)}, {Err: "boom"}, {Total: msec(30)}, {Err: "second"}}}
	st := s.Stats()
	if st.N != 2 || st.Errors != 2 || st.Mean != msec(20) || st.Max != msec(30) {
		t.Errorf("Stats = %+v, want 2 samples, 2 errors, mean 20ms, max 30ms", st)
	}
	if got := s.FirstError(); got != "boom" {
		t.Errorf("FirstError = %q, want boom", got)
	}
	if got := (DaemonSet{Samples: []DaemonSample{{Total: 1}}}).FirstError(); got != "" {
		t.Errorf("FirstError of a set without errors = %q", got)
	}
}

func TestDaemonRatePerSecond(t *testing.T) {
	tests := []struct {
		r    DaemonRate
		want float64
	}{
		{DaemonRate{Completed: 30, Elapsed: 10 * time.Second}, 3},
		{DaemonRate{Completed: 5}, 0},
		{DaemonRate{Elapsed: time.Second}, 0},
	}
	for _, tt := range tests {
		if got := tt.r.PerSecond(); got != tt.want {
			t.Errorf("%+v.PerSecond() = %v, want %v", tt.r, got, tt.want)
		}
	}
}

func TestKVMMode(t *testing.T) {
	tests := []struct {
		name, cpuinfo, want string
	}{
		{"bare metal", "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu vme svm\n", KVMDirect},
		{"cloud VM", "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum\nflags\t\t: fpu vmx hypervisor\n", KVMNested},
		{"TCG L1", "processor\t: 0\nmodel name\t: QEMU TCG CPU version 2.5+\nflags\t\t: fpu svm hypervisor\n", KVMEmulated},
		{"nothing", "", KVMDirect},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, why := KVMMode(tt.cpuinfo)
			if got != tt.want || why == "" {
				t.Errorf("KVMMode = %q (%q), want %q with a reason", got, why, tt.want)
			}
		})
	}
}

func TestMachineFacts(t *testing.T) {
	if got := memTotalMiB("MemTotal:        4030464 kB\nMemFree: 1 kB\n"); got != 3936 {
		t.Errorf("memTotalMiB = %d, want 3936", got)
	}
	if got := memTotalMiB("MemFree: 1 kB\n"); got != 0 {
		t.Errorf("memTotalMiB without MemTotal = %d, want 0", got)
	}
	if got := cpuModel("processor: 0\nmodel name : Some CPU  \nmodel name: Other\n"); got != "Some CPU" {
		t.Errorf("cpuModel = %q, want the first model name", got)
	}
	if got := cpuModel(""); got != "?" {
		t.Errorf("cpuModel of nothing = %q, want ?", got)
	}
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "enabled"), []byte("always [madvise] never\n"), 0o644)
	os.WriteFile(filepath.Join(dir, "shmem_enabled"), []byte("always within_size advise [never] deny force\n"), 0o644)
	if got := hugePageModes(dir); got != "anon madvise, shmem never" {
		t.Errorf("hugePageModes = %q, want anon madvise, shmem never", got)
	}
	if got := hugePageModes(filepath.Join(dir, "none")); got != "" {
		t.Errorf("hugePageModes without the files = %q, want empty", got)
	}
	e := DetectEnv(KVMEmulated)
	if e.KVM != KVMEmulated || !strings.Contains(e.KVMWhy, "given") || e.CPUs < 1 || e.Kernel == "" || e.Commit == "" {
		t.Errorf("DetectEnv(emulated) = %+v", e)
	}
}

// okSpec is a DaemonSpec that Normalize accepts.
func okSpec() DaemonSpec {
	return DaemonSpec{Kilnd: "/bin/kilnd", VMM: "/bin/kiln-vmm", Image: "busybox", Images: "/images"}
}

func TestDaemonSpecNormalize(t *testing.T) {
	s, err := okSpec().Normalize()
	if err != nil {
		t.Fatal(err)
	}
	if s.MemoryMiB != DefaultDaemonMemoryMiB || s.Samples != DefaultDaemonSamples || s.RateWorkers != DefaultDaemonRateWorkers ||
		len(s.Concurrency) != 3 || len(s.Forks) != 3 || len(s.Setup) != 3 || s.OpTimeout != DefaultDaemonOpTimeout {
		t.Errorf("defaults not filled in: %+v", s)
	}
	// The largest phase is the burst of 50 or the fork of 32: 50 + 2.
	if want := 52 * DefaultDaemonMemoryMiB; s.MaxMemoryMiB != want {
		t.Errorf("MaxMemoryMiB = %d, want %d", s.MaxMemoryMiB, want)
	}
	tests := []struct {
		name   string
		change func(*DaemonSpec)
		want   string
	}{
		{"no kilnd", func(s *DaemonSpec) { s.Kilnd = "" }, "binaries"},
		{"no image", func(s *DaemonSpec) { s.Image = "" }, "image"},
		{"no images folder", func(s *DaemonSpec) { s.Images = "" }, "images folder"},
		{"empty setup", func(s *DaemonSpec) { s.Setup = []string{} }, "setup"},
		{"negative memory", func(s *DaemonSpec) { s.MemoryMiB = -1 }, "-1 MiB"},
		{"negative pool", func(s *DaemonSpec) { s.Pool = -2 }, "pool -2"},
		{"negative rate", func(s *DaemonSpec) { s.RateFor = -time.Second }, "rate for -1s"},
		{"negative checkpoints", func(s *DaemonSpec) { s.Checkpoints = -1 }, "-1 checkpoints"},
		{"zero concurrency", func(s *DaemonSpec) { s.Concurrency = []int{1, 0} }, "concurrency 0"},
		{"huge fork", func(s *DaemonSpec) { s.Forks = []int{257} }, "fork of 257"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := okSpec()
			tt.change(&s)
			_, err := s.Normalize()
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Normalize = %v, want an error naming %q", err, tt.want)
			}
		})
	}
}

func TestDaemonSpecBursts(t *testing.T) {
	tests := []struct{ samples, c, want int }{
		{20, 1, 20}, {20, 10, 2}, {20, 50, 1}, {5, 10, 1}, {21, 10, 3}, {1, 1, 1},
	}
	for _, tt := range tests {
		if got := (DaemonSpec{Samples: tt.samples}).Bursts(tt.c); got != tt.want {
			t.Errorf("Bursts(%d) with %d samples = %d, want %d", tt.c, tt.samples, got, tt.want)
		}
	}
}

func TestKilndArgs(t *testing.T) {
	s := KilndSpec{Binary: "kilnd", VMM: "/k/kiln-vmm", Images: "/img", Dir: "/d", Kernel: "/vmlinux", MaxMemoryMiB: 640}
	want := "--listen unix:/d/kilnd.sock --state-dir /d/state --images /img --vmm /k/kiln-vmm --kernel /vmlinux --max-memory 640"
	if got := strings.Join(s.KilndArgs(), " "); got != want {
		t.Errorf("KilndArgs = %q\nwant        %q", got, want)
	}
	s.Kernel, s.MaxMemoryMiB, s.Agent = "", 0, "/agent"
	if got := strings.Join(s.KilndArgs(), " "); !strings.HasSuffix(got, "--vmm /k/kiln-vmm --agent /agent") {
		t.Errorf("KilndArgs = %q, want --agent last and no --kernel or --max-memory", got)
	}
}

// writeManifest writes a valid snapshot manifest into dir.
func writeManifest(t *testing.T, dir string) {
	t.Helper()
	m := snapshot.Manifest{Format: snapshot.FormatVersion, Created: time.Now(), CPUs: 1, MemoryMiB: vmm.MinMemoryMiB,
		StateVersion: vmm.StateVersion, StateSize: 1, StateSHA256: strings.Repeat("ab", 32), MemorySHA256: strings.Repeat("cd", 32),
		MemorySize:   uint64(vmm.MinMemoryMiB) << 20,
		MemoryLayout: []vmm.MemoryRegion{{Size: uint64(vmm.MinMemoryMiB) << 20}}}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, snapshot.ManifestFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func TestFindSnapshot(t *testing.T) {
	root := t.TempDir()
	here := filepath.Join(root, "here")
	writeManifest(t, here)
	below := filepath.Join(root, "below")
	writeManifest(t, filepath.Join(below, "snap"))
	two := filepath.Join(root, "two")
	writeManifest(t, filepath.Join(two, "a"))
	writeManifest(t, filepath.Join(two, "b"))
	empty := filepath.Join(root, "empty")
	os.Mkdir(empty, 0o755)
	tests := []struct {
		name, dir, want, err string
	}{
		{name: "in the folder", dir: here, want: here},
		{name: "in a folder under it", dir: below, want: filepath.Join(below, "snap")},
		{name: "two under it", dir: two, err: "holds 2 snapshots"},
		{name: "none", dir: empty, err: "holds 0 snapshots"},
		{name: "missing", dir: filepath.Join(root, "nope"), err: "no such file"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := FindSnapshot(tt.dir)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) {
					t.Errorf("FindSnapshot = %q, %v; want an error with %q", got, err, tt.err)
				}
				return
			}
			if err != nil || got != tt.want {
				t.Errorf("FindSnapshot = %q, %v; want %q", got, err, tt.want)
			}
		})
	}
}

// sampleReport is a report with one of everything.
func sampleReport() DaemonReport {
	return DaemonReport{
		Env:    DaemonEnv{CPU: "Test CPU", CPUs: 2, MemoryMiB: 4096, Kernel: "6.1", Commit: "abc", KVM: KVMEmulated, KVMWhy: "told"},
		Spec:   DaemonSpec{MemoryMiB: 128},
		Source: "template", SourceID: "tp-1", SourceCreate: msec(1500),
		Sets: []DaemonSet{
			{Op: OpCreate, Path: PathKilnd, Concurrency: 1, Samples: []DaemonSample{{Total: msec(120)}, {Total: msec(80)}}},
			{Op: OpCreate, Path: PathLibrary, Concurrency: 1, Samples: []DaemonSample{{Total: msec(50)}, {Total: msec(50)}}},
			{Op: OpCreatePool, Path: PathKilnd, Concurrency: 1, Samples: []DaemonSample{{Total: msec(9), FromPool: true}, {Err: "pool failed"}}},
			{Op: OpCheckpoint, Path: PathKilnd, Concurrency: 1, Samples: []DaemonSample{{Total: msec(33)}}},
		},
		Rates: []DaemonRate{{Path: PathKilnd, Workers: 4, For: time.Minute, Elapsed: time.Minute, Completed: 120,
			Latency: LatencyStats{N: 120, P50: msec(70), P95: msec(90)}}},
		Forks: []DaemonFork{{Path: PathKilnd, N: 8, Ready: msec(400), AllExec: msec(450)}, {Path: PathLibrary, N: 32, Err: "too many"}},
		Notes: []string{"something skipped"},
	}
}

func TestDaemonReportPrint(t *testing.T) {
	var b bytes.Buffer
	sampleReport().Print(&b)
	out := b.String()
	for _, want := range []string{
		"KVM emulated (told)",
		"source: template tp-1 (made in 1500.0 ms)",
		// kilnd at concurrency 1: mean 100, p50 80 (nearest rank), max 120.
		"create               kilnd        1    2    0     100.0      80.0     120.0     120.0     120.0",
		"kilnd / library: at 1: p50 1.60, p95 2.40, mean 2.00",
		"create-pool          kilnd        1    1    1",
		"first error: pool failed",
		"pool: 1 of 2 creates were handed a pooled sandbox",
		"kilnd          4       60       120      0       2.00      70.0      90.0",
		"kilnd       8          400.0              450.0",
		"library    32 failed: too many",
		"checkpoint           kilnd        1    1    0      33.0",
		"note: something skipped",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
}

func TestDaemonReportJSON(t *testing.T) {
	var b bytes.Buffer
	rep := sampleReport()
	if err := rep.WriteJSON(&b); err != nil {
		t.Fatal(err)
	}
	var back DaemonReport
	if err := json.Unmarshal(b.Bytes(), &back); err != nil {
		t.Fatal(err)
	}
	if len(back.Sets) != len(rep.Sets) || back.Sets[0].Samples[0].Total != msec(120) || back.Env.KVM != KVMEmulated ||
		back.Forks[1].Err != "too many" || back.Rates[0].Completed != 120 {
		t.Errorf("JSON round trip lost something: %s", b.String())
	}
	for _, key := range []string{`"total_ns": 120000000`, `"kvm": "emulated"`, `"from_pool": true`, `"p95_ns"`} {
		if !strings.Contains(b.String(), key) {
			t.Errorf("JSON lacks %s", key)
		}
	}
	if err := rep.WriteJSON(failWriter{}); err == nil {
		t.Error("WriteJSON to a failing writer: no error")
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestStartKilndFails(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	sleeper := filepath.Join(dir, "sleeper")
	if err := os.WriteFile(sleeper, []byte("#!/bin/sh\nexec sleep 30\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		spec KilndSpec
		want string
	}{
		{"missing fields", KilndSpec{Binary: "/bin/true"}, "must all be given"},
		{"no such binary", KilndSpec{Binary: filepath.Join(dir, "nope"), VMM: "k", Images: "i", Dir: filepath.Join(dir, "a")}, "start"},
		{"exits at once", KilndSpec{Binary: "/bin/false", VMM: "k", Images: "i", Dir: filepath.Join(dir, "b")}, "exited before serving"},
		{"never serves", KilndSpec{Binary: sleeper, VMM: "k", Images: "i", Dir: filepath.Join(dir, "c"), Timeout: 300 * time.Millisecond}, "did not serve within"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			k, err := StartKilnd(ctx, tt.spec)
			if err == nil {
				k.Stop(ctx)
				t.Fatal("StartKilnd succeeded")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("StartKilnd: %v, want %q", err, tt.want)
			}
		})
	}
}

// TestRunDaemonFakeKilnd runs every phase through a kilnd process over
// package daemon's test double: the calls, streams, pool and cleanup are
// real; the sandboxes are host folders, so the library path (which needs
// a real snapshot) drops out with a note.
func TestRunDaemonFakeKilnd(t *testing.T) {
	t.Setenv(fakeKilndEnv, "1")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "kbt-") // short: Unix sockets live in it
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	spec := DaemonSpec{Kilnd: os.Args[0], VMM: "/nonexistent/kiln-vmm", Image: "busybox", Images: dir, Setup: []string{"true"},
		Concurrency: []int{1, 3}, Samples: 3, Pool: 2, RateFor: 300 * time.Millisecond, RateWorkers: 2,
		Forks: []int{1, 2}, Checkpoints: 2, Dir: dir, OpTimeout: time.Minute, KVMMode: KVMDirect}
	rep, err := RunDaemon(ctx, spec, testLogWriter{t})
	if err != nil {
		t.Fatalf("RunDaemon: %v", err)
	}
	if rep.Source != "template" || !strings.HasPrefix(rep.SourceID, "tp-") || rep.Snapshot != "" {
		t.Errorf("source %s %s, snapshot %q: want a template and no library snapshot", rep.Source, rep.SourceID, rep.Snapshot)
	}
	if len(rep.Notes) == 0 || !strings.Contains(rep.Notes[0], "no library path") {
		t.Errorf("notes %q: want the library path's absence first", rep.Notes)
	}
	wantSets := []struct {
		op      string
		conc, n int
	}{
		{OpCreate, 1, 3}, {OpCreate, 3, 3}, {OpDestroy, 1, 3}, {OpCreatePool, 1, 3},
		{OpCheckpoint, 1, 2}, {OpRollback, 1, 2}, {OpCheckpointPersist, 1, 2}, {OpRollbackPersist, 1, 2},
	}
	for _, w := range wantSets {
		s, ok := rep.Set(w.op, PathKilnd, w.conc)
		if !ok {
			t.Errorf("no %s set at %d", w.op, w.conc)
			continue
		}
		if st := s.Stats(); st.N != w.n || st.Errors != 0 || st.Min <= 0 {
			t.Errorf("%s at %d: %+v (first error %q), want %d samples without errors", w.op, w.conc, st, s.FirstError(), w.n)
		}
	}
	if _, ok := rep.Set(OpCreate, PathLibrary, 0); ok {
		t.Error("a library set without a library snapshot")
	}
	if p, _ := rep.Set(OpCreatePool, PathKilnd, 1); len(p.Samples) > 0 {
		for i, s := range p.Samples {
			if !s.FromPool {
				t.Errorf("pool create %d was not from the pool", i+1)
			}
		}
	}
	if len(rep.Rates) != 1 || rep.Rates[0].Completed < 1 || rep.Rates[0].Errors != 0 || rep.Rates[0].Elapsed < spec.RateFor {
		t.Errorf("rates %+v: want one kilnd loop that completed sandboxes without errors", rep.Rates)
	}
	if len(rep.Forks) != 2 {
		t.Fatalf("forks %+v: want 2", rep.Forks)
	}
	for _, f := range rep.Forks {
		if f.Err != "" || f.Ready <= 0 || f.AllExec < f.Ready {
			t.Errorf("fork %+v", f)
		}
	}
	if rep.Env.KVM != KVMDirect || rep.Took <= 0 || rep.LoadAfter == "" {
		t.Errorf("env %+v, took %v", rep.Env, rep.Took)
	}
	var b bytes.Buffer
	rep.Print(&b)
	if !strings.Contains(b.String(), "create-pool") {
		t.Errorf("printed report lacks the pool:\n%s", b.String())
	}
	if err := rep.WriteJSON(io.Discard); err != nil {
		t.Error(err)
	}
}

func TestInRootCgroup(t *testing.T) {
	tests := []struct {
		in   string
		want bool
	}{
		{"0::/\n", true},
		{"0::/user.slice/session-1.scope\n", false},
		{"12:pids:/\n0::/\n", true},
		{"", false},
	}
	for _, tt := range tests {
		if got := inRootCgroup(tt.in); got != tt.want {
			t.Errorf("inRootCgroup(%q) = %v, want %v", tt.in, got, tt.want)
		}
	}
	args := KilndSpec{Binary: "kilnd", VMM: "k", Images: "i", Dir: "/d", CgroupRoot: "none"}.KilndArgs()
	if n := len(args); n < 2 || args[n-2] != "--cgroup-root" || args[n-1] != "none" {
		t.Errorf("KilndArgs = %q, want --cgroup-root none at the end", args)
	}
}

// TestKilndSnapshotKey: the library path restores kilnd's snapshots with
// the key kilnd made in its state folder; one that is missing is an
// error (not a new key, which would authenticate nothing of kilnd's), as
// is one snapshot.LoadKey refuses.
func TestKilndSnapshotKey(t *testing.T) {
	spec := KilndSpec{Dir: t.TempDir()}
	file := spec.SnapshotKeyFile()
	if filepath.Dir(file) != spec.StateDir() {
		t.Fatalf("SnapshotKeyFile %s is not in the state folder %s", file, spec.StateDir())
	}
	if _, err := kilndSnapshotKey(file); err == nil || !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("no key: %v, want a not-exist error", err)
	}
	if _, err := os.Stat(file); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("reading a missing key made one: %v", err)
	}
	want, err := snapshot.LoadKey(file) // as kilnd makes it
	if err != nil {
		t.Fatal(err)
	}
	got, err := kilndSnapshotKey(file)
	if err != nil || !bytes.Equal(got, want) {
		t.Errorf("kilnd's key: %x, %v; want %x", got, err, want)
	}
	if err := os.Chmod(file, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := kilndSnapshotKey(file); err == nil || !strings.Contains(err.Error(), "snapshot key") {
		t.Errorf("a key others may read: %v, want it refused", err)
	}
}
