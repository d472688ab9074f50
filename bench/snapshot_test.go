package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/sandbox"
)

// testLogWriter sends each line written to it to t.Log.
type testLogWriter struct{ tb testing.TB }

func (w testLogWriter) Write(p []byte) (int, error) {
	w.tb.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// BenchmarkSnapshot boots a sandbox at each of DefaultSaveSizesMiB and
// times its save, restores the 512 MiB one b.N times to a first exec,
// forks it into 1, 8 and 32 children (each answering an exec), and reads
// the children's guest memory after the fork of 8; QEMU microvm's save
// (migrate to a file) and restore (-incoming) alternate with Kiln's where
// QEMU and /dev/vhost-vsock are there. Run it with a fixed
// count: go test -run '^$' -bench Snapshot -benchtime 5x ./bench
func BenchmarkSnapshot(b *testing.B) {
	if err := kvmtest.Usable(); err != nil {
		b.Skipf("needs /dev/kvm: %v", err)
	}
	kvmtest.Kernel(b)
	spec := SnapshotSpec{
		Agent:    kvmtest.AgentBinary(b),
		Restores: b.N,
		Dir:      b.TempDir(),
		Logger:   slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
	if q, err := exec.LookPath("qemu-system-x86_64"); err != nil {
		b.Log("no qemu-system-x86_64: measuring without the peer")
	} else if err := EnsureVhostVsock(); err != nil {
		b.Logf("measuring without the peer: %v", err)
	} else {
		spec.QEMU = q
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	b.Logf("load average %s", LoadAverage())
	b.ResetTimer()
	rep, err := RunSnapshot(ctx, spec, testLogWriter{b})
	if err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	b.Logf("load average %s", LoadAverage())
	ms := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
	b.ReportMetric(0, "ns/op")
	for _, s := range rep.Saves {
		b.ReportMetric(ms(s.Save), fmt.Sprintf("save-%dMiB-ms", s.MemoryMiB))
		b.ReportMetric(MiB(uint64(s.FileAllocated)), fmt.Sprintf("file-%dMiB-alloc-MiB", s.MemoryMiB))
	}
	b.ReportMetric(ms(rep.ColdStart()), "coldstart-ms")
	b.ReportMetric(ms(rep.RestoreMedian()), "restore-ms")
	b.ReportMetric(rep.RestoreRatio(), "restore/coldstart")
	if p := rep.Peer; p != nil {
		if p.Err != "" {
			b.Logf("qemu microvm failed: %s", p.Err)
		}
		if len(p.Restores) > 0 {
			b.ReportMetric(ms(Median(p.Restores)), "qemu-restore-ms")
			b.ReportMetric(p.RestoreRatio(), "qemu-restore/coldstart")
			b.ReportMetric(float64(rep.RestoreMedian())/float64(Median(p.Restores)), "kiln/qemu-restore")
		}
	}
	for _, f := range rep.Forks {
		if f.Err != "" {
			b.Logf("fork of %d failed: %s", f.N, f.Err)
			continue
		}
		b.ReportMetric(ms(f.AllExec), fmt.Sprintf("fork%d-all-exec-ms", f.N))
	}
	if p := rep.PSS; p != nil {
		b.ReportMetric(MiB(p.Standalone.Pss), "standalone-pss-MiB")
		b.ReportMetric(MiB(p.ChildPSS()), "clone-pss-MiB")
		b.ReportMetric(MiB(p.ChildAnonymous()), "clone-private-MiB")
		b.ReportMetric(MiB(p.GuestPerVM()), "guest-per-vm-MiB")
	}
}

func TestProcessUsageAndLoadAverage(t *testing.T) {
	r, err := ProcessUsage()
	if err != nil {
		t.Fatal(err)
	}
	if r.Rss == 0 || r.Pss == 0 {
		t.Errorf("smaps_rollup of this process: %+v", r)
	}
	if l := LoadAverage(); len(strings.Fields(l)) != 3 {
		t.Errorf("LoadAverage() = %q", l)
	}
}

func TestAllocated(t *testing.T) {
	f, err := os.CreateTemp(t.TempDir(), "sparse")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(64 << 20); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(make([]byte, 4096), 0); err != nil {
		t.Fatal(err)
	}
	// Written bytes of zeros still take a block: write non-zero ones.
	if _, err := f.WriteAt([]byte{1}, 32<<20); err != nil {
		t.Fatal(err)
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	size, alloc, err := allocated(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	if size != 64<<20 || alloc <= 0 || alloc >= 1<<20 {
		t.Errorf("allocated = %d, %d; want 64 MiB logical, a few KiB allocated", size, alloc)
	}
	if s2, a2, err := fdAllocated(int(f.Fd())); err != nil || s2 != size || a2 != alloc {
		t.Errorf("fdAllocated = %d, %d, %v", s2, a2, err)
	}
	if _, _, err := allocated(f.Name() + ".missing"); err == nil {
		t.Error("no error for a missing file")
	}
}

func TestSnapshotSpecNormalize(t *testing.T) {
	s, err := SnapshotSpec{}.Normalize()
	if err != nil {
		t.Fatal(err)
	}
	if s.CPUs != 1 || s.MemoryMiB != 512 || s.ColdBoots != 1 || s.Restores != DefaultRestores || s.PSSFork != 8 ||
		fmt.Sprint(s.SaveSizesMiB) != "[256 512 1024]" || fmt.Sprint(s.Forks) != "[1 8 32]" || s.BootTimeout <= 0 {
		t.Errorf("defaults: %+v", s)
	}
	// Explicitly empty lists stay empty: no save sizes, no timed forks.
	s, err = SnapshotSpec{SaveSizesMiB: []int{}, Forks: []int{}}.Normalize()
	if err != nil || len(s.SaveSizesMiB) != 0 || len(s.Forks) != 0 {
		t.Errorf("empty lists: %+v, %v", s, err)
	}
	for _, bad := range []SnapshotSpec{
		{CPUs: -1},
		{Restores: -1},
		{ColdBoots: -2},
		{SaveSizesMiB: []int{256, 0}},
		{Forks: []int{1, 2000}},
		{Forks: []int{0}},
		{PSSFork: -3},
	} {
		if _, err := bad.Normalize(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}

func TestSnapshotReportFigures(t *testing.T) {
	ms := time.Millisecond
	rep := SnapshotReport{
		Base:     SaveResult{ColdStart: 1000 * ms},
		Restores: []RestoreResult{{Exec: 300 * ms}, {Exec: 100 * ms}, {Exec: 200 * ms}},
	}
	if m := rep.RestoreMedian(); m != 200*ms {
		t.Errorf("RestoreMedian = %v", m)
	}
	if r := rep.RestoreRatio(); r != 0.2 {
		t.Errorf("RestoreRatio = %v", r)
	}
	if r := (SnapshotReport{}).RestoreRatio(); r != 0 {
		t.Errorf("RestoreRatio without a cold start = %v", r)
	}
	rep.ColdStarts = []time.Duration{2000 * ms, 400 * ms, 1000 * ms}
	if c, r := rep.ColdStart(), rep.RestoreRatio(); c != 1000*ms || r != 0.2 {
		t.Errorf("ColdStart, RestoreRatio over three cold boots = %v, %v", c, r)
	}
	p := PSSResult{
		N:             2,
		Children:      []MemUsage{{Pss: 10 << 20, Anonymous: 2 << 20}, {Pss: 20 << 20, Anonymous: 4 << 20}},
		Parent:        MemUsage{Anonymous: 3 << 20},
		BaseAllocated: 100 << 20,
	}
	if got := p.ChildPSS(); got != 15<<20 {
		t.Errorf("ChildPSS = %d", got)
	}
	if got := p.ChildAnonymous(); got != 3<<20 {
		t.Errorf("ChildAnonymous = %d", got)
	}
	if got := p.GuestTotal(); got != 109<<20 {
		t.Errorf("GuestTotal = %d", got)
	}
	if got := p.GuestPerVM(); got != (109<<20)/3 {
		t.Errorf("GuestPerVM = %d", got)
	}
	if (PSSResult{}).ChildPSS() != 0 || (PSSResult{}).GuestPerVM() != 0 {
		t.Error("empty PSSResult figures are not 0")
	}
}

func TestPeerRestoreRatio(t *testing.T) {
	p := PeerSnapshot{ColdStart: 4 * time.Second, Restores: []time.Duration{time.Second, 3 * time.Second, 2 * time.Second}}
	if r := p.RestoreRatio(); r != 0.5 {
		t.Errorf("RestoreRatio = %v", r)
	}
	if r := (PeerSnapshot{}).RestoreRatio(); r != 0 {
		t.Errorf("RestoreRatio without a cold start = %v", r)
	}
}

func TestRestorePhaseMedians(t *testing.T) {
	ph := func(ms ...int) []sandbox.Phase {
		names := []string{sandbox.PhasePrepare, sandbox.PhaseMemory, sandbox.PhaseRestore}
		out := make([]sandbox.Phase, len(ms))
		for i, m := range ms {
			out[i] = sandbox.Phase{Name: names[i], Took: time.Duration(m) * time.Millisecond}
		}
		return out
	}
	rs := []RestoreResult{
		{Phases: ph(1, 10, 100), FirstExec: 5 * time.Millisecond},
		{Phases: ph(3, 30, 300), FirstExec: 7 * time.Millisecond},
		{Phases: ph(2, 20), FirstExec: 6 * time.Millisecond}, // a phase missing
	}
	got := RestorePhaseMedians(rs)
	want := []sandbox.Phase{{Name: sandbox.PhasePrepare, Took: 2 * time.Millisecond}, {Name: sandbox.PhaseMemory, Took: 20 * time.Millisecond}, {Name: sandbox.PhaseRestore, Took: 200 * time.Millisecond}, {Name: "exec", Took: 6 * time.Millisecond}}
	if !slices.Equal(got, want) {
		t.Errorf("RestorePhaseMedians = %v, want %v", got, want)
	}
	if got := restorePhases(want[:2]); got != "prepare 2ms, memory 20ms" {
		t.Errorf("restorePhases = %q", got)
	}
	if RestorePhaseMedians(nil) != nil {
		t.Error("no restores: phases")
	}
}
