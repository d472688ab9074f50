package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/kvmtest"
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

const smapsFixture = `00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/kiln
Size:                328 kB
Rss:                 300 kB
Pss:                 300 kB
Anonymous:             0 kB
VmFlags: rd ex mr mw me dw
7f0000000000-7f0000100000 rw-p 00000000 00:01 2049        /memfd:kiln-guest-ram-base (deleted)
Size:               1024 kB
KernelPageSize:        4 kB
Rss:                 512 kB
Pss:                 128 kB
Pss_Dirty:           128 kB
Shared_Clean:          0 kB
Shared_Dirty:        448 kB
Private_Clean:         0 kB
Private_Dirty:        64 kB
Anonymous:            64 kB
THPeligible:    0
VmFlags: rd wr mr mw me ac sd
7f0000100000-7f0000200000 rw-p 00100000 00:01 2049        /memfd:kiln-guest-ram-base (deleted)
Size:               1024 kB
Rss:                  16 kB
Pss:                   8 kB
Shared_Dirty:         16 kB
Anonymous:             0 kB
VmFlags: rd wr mr mw me ac sd
7fff00000000-7fff00021000 rw-p 00000000 00:00 0           [stack]
Rss:                  12 kB
Pss:                  12 kB
`

func TestParseSmapsRange(t *testing.T) {
	u, err := parseSmapsRange(strings.NewReader(smapsFixture), 0x7f0000000000, 0x7f0000200000)
	if err != nil {
		t.Fatal(err)
	}
	want := MemUsage{Rss: 528 << 10, Pss: 136 << 10, SharedDirty: 464 << 10, PrivateDirty: 64 << 10, Anonymous: 64 << 10, Mappings: 2}
	if u != want {
		t.Errorf("got %+v\nwant %+v", u, want)
	}
	if _, err := parseSmapsRange(strings.NewReader(smapsFixture), 0x7f0000000000, 0x7f0000180000); err == nil || !strings.Contains(err.Error(), "straddles") {
		t.Errorf("a range ending inside a mapping: %v", err)
	}
	if _, err := parseSmapsRange(strings.NewReader(smapsFixture), 0x1000, 0x2000); err == nil {
		t.Error("a range with no mapping gave no error")
	}
	bad := strings.Replace(smapsFixture, "Pss:                 128 kB", "Pss:                 12x kB", 1)
	if _, err := parseSmapsRange(strings.NewReader(bad), 0x7f0000000000, 0x7f0000200000); err == nil {
		t.Error("a malformed figure gave no error")
	}
}

func TestSmapsHeader(t *testing.T) {
	for _, tt := range []struct {
		line   string
		lo, hi uint64
		ok     bool
	}{
		{"7f00-7f80 rw-p 00000000 00:01 12 /memfd:x", 0x7f00, 0x7f80, true},
		{"00400000-00452000 r-xp 00000000 08:02 173521", 0x400000, 0x452000, true},
		{"Rss:                 300 kB", 0, 0, false},
		{"VmFlags: rd ex mr mw me dw", 0, 0, false},
		{"7f80-7f00 rw-p 0 0:0 0", 0, 0, false},
		{"", 0, 0, false},
	} {
		lo, hi, ok := smapsHeader(tt.line)
		if lo != tt.lo || hi != tt.hi || ok != tt.ok {
			t.Errorf("smapsHeader(%q) = %x, %x, %v", tt.line, lo, hi, ok)
		}
	}
}

// TestRangeUsageSharedMemfd maps one memfd twice, shared, and touches
// every page through both: each mapping's PSS is half its RSS. A third,
// private mapping writes half its pages: those are its own (anonymous).
func TestRangeUsageSharedMemfd(t *testing.T) {
	const size = 1 << 20
	fd, err := unix.MemfdCreate("kiln-bench-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, size); err != nil {
		t.Fatal(err)
	}
	var maps [][]byte
	for _, flags := range []int{unix.MAP_SHARED, unix.MAP_SHARED, unix.MAP_PRIVATE} {
		m, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, flags)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Munmap(m)
		maps = append(maps, m)
	}
	var sum int
	for off := 0; off < size; off += 4096 {
		maps[0][off] = 1
		sum += int(maps[1][off]) // a read maps the page
	}
	if sum != size/4096 {
		t.Fatalf("read %d through the second mapping", sum)
	}
	for off := 0; off < size/2; off += 4096 {
		maps[2][off] = 2
	}
	usage := func(m []byte) MemUsage {
		t.Helper()
		u, err := RangeUsage(uintptr(unsafe.Pointer(unsafe.SliceData(m))), uint64(len(m)))
		if err != nil {
			t.Fatal(err)
		}
		return u
	}
	a, priv := usage(maps[0]), usage(maps[2])
	if a.Rss != size || a.Mappings != 1 {
		t.Errorf("shared mapping: %+v, want RSS %d in one mapping", a, size)
	}
	// The private mapping maps only the pages it wrote (its copies), so
	// the shared ones have two mappers.
	if a.Pss < size/2 || a.Pss > size*3/4+4096 {
		t.Errorf("shared mapping: PSS %d, want about half of %d", a.Pss, size)
	}
	if priv.Anonymous != size/2 || priv.Rss != size/2 || priv.Pss != size/2 {
		t.Errorf("private mapping: %+v, want %d anonymous, all its own", priv, size/2)
	}
	if s := a.String(); !strings.Contains(s, "RSS 1.0 MiB") {
		t.Errorf("String() = %q", s)
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

// fakeQMP answers QMP on a Unix socket the way QEMU does: a greeting,
// events between answers, and query-migrate going from active to status.
func fakeQMP(t *testing.T, path, status string) <-chan []string {
	t.Helper()
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	cmds := make(chan []string, 1)
	go func() {
		defer ln.Close()
		var seen []string
		defer func() { cmds <- seen }()
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		fmt.Fprintln(c, `{"QMP": {"version": {"qemu": {"micro": 22, "minor": 2, "major": 7}}, "capabilities": []}}`)
		r := bufio.NewReader(c)
		polls := 0
		for {
			line, err := r.ReadBytes('\n')
			if err != nil {
				return
			}
			var req struct {
				Execute   string         `json:"execute"`
				Arguments map[string]any `json:"arguments"`
			}
			if err := json.Unmarshal(line, &req); err != nil {
				fmt.Fprintln(c, `{"error": {"class": "GenericError", "desc": "bad json"}}`)
				continue
			}
			seen = append(seen, req.Execute)
			switch req.Execute {
			case "migrate":
				if !strings.HasPrefix(fmt.Sprint(req.Arguments["uri"]), "exec:cat > '") {
					fmt.Fprintln(c, `{"error": {"class": "GenericError", "desc": "bad uri"}}`)
					continue
				}
				fmt.Fprintln(c, `{"event": "STOP", "timestamp": {"seconds": 1, "microseconds": 2}}`)
				fmt.Fprintln(c, `{"return": {}}`)
			case "query-migrate":
				polls++
				if polls < 3 {
					fmt.Fprintln(c, `{"return": {"status": "active"}}`)
				} else {
					fmt.Fprintf(c, `{"return": {"status": %q, "error-desc": "no space"}}`+"\n", status)
				}
			case "query-status":
				fmt.Fprintln(c, `{"return": {"status": "inmigrate", "running": false}}`)
				fmt.Fprintln(c, `{"event": "MIGRATION", "data": {"status": "completed"}}`)
				fmt.Fprintln(c, `{"event": "RESUME", "timestamp": {"seconds": 1, "microseconds": 2}}`)
			case "nonsense":
				fmt.Fprintln(c, `{"error": {"class": "CommandNotFound", "desc": "The command nonsense has not been found"}}`)
			default:
				fmt.Fprintln(c, `{"return": {}}`)
			}
		}
	}()
	return cmds
}

func TestQEMUPeerSave(t *testing.T) {
	dir := t.TempDir()
	p := &qemuPeer{qmpPath: filepath.Join(dir, "qmp.sock"), state: filepath.Join(dir, "state")}
	cmds := fakeQMP(t, p.qmpPath, "completed")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := p.save(ctx); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(<-cmds, " ")
	if want := "qmp_capabilities migrate-set-parameters migrate query-migrate query-migrate query-migrate"; got != want {
		t.Errorf("commands %q, want %q", got, want)
	}

	p.qmpPath = filepath.Join(dir, "qmp2.sock")
	fakeQMP(t, p.qmpPath, "failed")
	if _, err := p.save(ctx); err == nil || !strings.Contains(err.Error(), "failed: no space") {
		t.Errorf("a failed migration: %v", err)
	}

	p.qmpPath = filepath.Join(dir, "qmp3.sock")
	fakeQMP(t, p.qmpPath, "completed")
	q, err := dialQMP(ctx, p.qmpPath)
	if err != nil {
		t.Fatal(err)
	}
	defer q.conn.Close()
	if _, err := q.do("nonsense", nil); err == nil || !strings.Contains(err.Error(), "CommandNotFound") {
		t.Errorf("an unknown command: %v", err)
	}
}

func TestWatchResume(t *testing.T) {
	path := filepath.Join(t.TempDir(), "qmp.sock")
	out := make(chan time.Duration, 1)
	start := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// The socket appears a little later, as QEMU's does.
	go watchResume(ctx, path, start, make(chan struct{}), out)
	time.Sleep(50 * time.Millisecond)
	fakeQMP(t, path, "completed")
	d, ok := <-out
	if !ok || d < 50*time.Millisecond {
		t.Errorf("watchResume: %v, %v", d, ok)
	}

	// A QEMU that exits before its socket appears: nothing to report.
	stopped := make(chan struct{})
	close(stopped)
	out = make(chan time.Duration, 1)
	watchResume(ctx, filepath.Join(t.TempDir(), "none.sock"), start, stopped, out)
	if d, ok := <-out; ok {
		t.Errorf("watchResume without QEMU reported %v", d)
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
