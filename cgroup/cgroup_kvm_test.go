package cgroup

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

// realRoot makes a delegated root of its own under the host's cgroup v2
// mount (with the controllers enabled above it) and opens a Manager on
// it; the cleanup removes it.
func realRoot(tb testing.TB) *Manager {
	tb.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(DefaultMount, &st); err != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
		if _, bench := tb.(*testing.B); bench {
			tb.Skipf("%s is not a cgroup v2 mount (%v): run the benchmark in the KVM harness's L1", DefaultMount, err)
		}
		tb.Fatalf("%s is not a cgroup v2 mount (%v): the KVM harness's L1 has one", DefaultMount, err)
	}
	// The host's root cgroup may hold processes and still delegate.
	if err := write(filepath.Join(DefaultMount, "cgroup.subtree_control"), "+cpu +memory +pids +io"); err != nil {
		tb.Fatalf("enable controllers in the root cgroup: %v", err)
	}
	root := filepath.Join(DefaultMount, fmt.Sprintf("kiln-test-%d", os.Getpid()))
	if err := os.Mkdir(root, 0o755); err != nil {
		tb.Fatal(err)
	}
	m, err := Open(root)
	if err != nil {
		unix.Rmdir(root)
		tb.Fatal(err)
	}
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		ids, _ := m.List()
		for _, id := range ids {
			if err := m.Remove(ctx, id); err != nil {
				tb.Errorf("cleanup: %v", err)
			}
		}
		for _, d := range []string{m.sandboxes, root} {
			if err := unix.Rmdir(d); err != nil {
				tb.Errorf("cleanup: rmdir %s: %v", d, err)
			}
		}
	})
	return m
}

// startIn starts argv directly in g (clone3 CLONE_INTO_CGROUP).
func startIn(t *testing.T, g *Group, argv ...string) *exec.Cmd {
	t.Helper()
	fd, err := g.OpenFD()
	if err != nil {
		t.Fatal(err)
	}
	defer fd.Close()
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(fd.Fd())}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %q in %s: %v", argv, g.Path, err)
	}
	return cmd
}

// TestKVMCgroupReal runs in L1 (the harness's VM, whose /sys/fs/cgroup is
// cgroup v2 with every controller): a sandbox's cgroup on the real tree
// has its limits, takes a process started into it directly, counts and
// kills (the whole group) a process that passes memory.max while a
// sibling runs on, and is removed with what is left in it.
func TestKVMCgroupReal(t *testing.T) {
	kvmtest.Require(t)
	m := realRoot(t)
	for _, c := range []string{"cpu", "memory", "pids"} {
		if !slices.Contains(m.Controllers(), c) {
			t.Errorf("controller %s not enabled: %q", c, m.Controllers())
		}
	}
	lim := Limits{CPUs: 1, MemoryMiB: 32, OverheadMiB: 16, PidsMax: 64}
	g, err := m.Create("sb-hog", lim)
	if err != nil {
		t.Fatal(err)
	}
	for f, want := range map[string]string{"cpu.max": "100000 100000", "memory.max": fmt.Sprint(48 << 20), "pids.max": "64", "memory.oom.group": "1"} {
		if got := strings.TrimSpace(readFile(t, filepath.Join(g.Path, f))); got != want {
			t.Errorf("%s = %q, want %q", f, got, want)
		}
	}
	if _, err := os.Stat(filepath.Join(g.Path, "memory.swap.max")); err == nil {
		if got := strings.TrimSpace(readFile(t, filepath.Join(g.Path, "memory.swap.max"))); got != "0" {
			t.Errorf("memory.swap.max = %q, want 0", got)
		}
	}
	other, err := m.Create("sb-other", Limits{MemoryMiB: 64, OverheadMiB: 16, PidsMax: 64})
	if err != nil {
		t.Fatal(err)
	}
	sleeper := startIn(t, other, "sleep", "300")
	defer func() { sleeper.Process.Kill(); sleeper.Wait() }()
	want := "0::" + strings.TrimPrefix(other.Path, DefaultMount) + "\n"
	if got := readFile(t, fmt.Sprintf("/proc/%d/cgroup", sleeper.Process.Pid)); got != want {
		t.Errorf("the process started into %s is in %q, want %q", other.Path, got, want)
	}
	if pids, err := other.Procs(); err != nil || !slices.Equal(pids, []int{sleeper.Process.Pid}) {
		t.Errorf("Procs = %v, %v; want [%d]", pids, err, sleeper.Process.Pid)
	}

	// dd's 128 MiB buffer, filled from /dev/zero, passes memory.max.
	hog := startIn(t, g, "dd", "if=/dev/zero", "of=/dev/null", "bs=128M", "count=4")
	err = hog.Wait()
	ws, _ := hog.ProcessState.Sys().(syscall.WaitStatus)
	if err == nil || !ws.Signaled() || ws.Signal() != syscall.SIGKILL {
		t.Errorf("dd over memory.max ended with %v, want killed by SIGKILL", err)
	}
	ev, err := g.Events()
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("memory.events after the hog: %+v", ev)
	if ev.Max == 0 || ev.OOMKill == 0 || ev.OOMGroupKill == 0 {
		t.Errorf("memory.events %+v: want max, oom_kill and oom_group_kill counted", ev)
	}
	if pk, err := g.Peak(); err == nil && pk > lim.MemoryMax() {
		t.Errorf("memory.peak %d passed memory.max %d", pk, lim.MemoryMax())
	}
	if st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", sleeper.Process.Pid)); err != nil || strings.Contains(string(st), ") Z") {
		t.Error("the process in the sibling cgroup did not survive the hog's OOM kill")
	}
	if oev, err := other.Events(); err != nil || oev.OOMKill != 0 {
		t.Errorf("sibling's memory.events %+v, %v: want no OOM kill", oev, err)
	}

	// Remove kills what is left and waits for it to go.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := m.Remove(ctx, "sb-other"); err != nil {
		t.Fatal(err)
	}
	if err := sleeper.Wait(); err == nil {
		t.Error("the process in a removed cgroup exited cleanly, want killed")
	}
	if ids, err := m.List(); err != nil || !slices.Equal(ids, []string{"sb-hog"}) {
		t.Errorf("List = %q, %v; want [sb-hog]", ids, err)
	}
	// A cgroup a previous kilnd made is found again.
	if g2, err := m.Get("sb-hog"); err != nil || g2.Path != g.Path {
		t.Errorf("Get = %v, %v", g2, err)
	}
	// Opening the root again (a restarted kilnd) keeps what is there.
	m2, err := Open(m.Root())
	if err != nil {
		t.Fatal(err)
	}
	if ids, err := m2.List(); err != nil || !slices.Equal(ids, []string{"sb-hog"}) {
		t.Errorf("reopened List = %q, %v; want [sb-hog]", ids, err)
	}
}

// BenchmarkCgroupSetup measures a sandbox's cgroup setup: Create with
// every limit, then Remove, on the host's real cgroup v2 tree (run it as
// root where /sys/fs/cgroup is cgroup v2, as in the harness's L1):
//
//	go test -run '^$' -bench BenchmarkCgroupSetup -benchtime 100x ./cgroup
func BenchmarkCgroupSetup(b *testing.B) {
	m := realRoot(b)
	lim := Limits{CPUs: 2, MemoryMiB: 512, OverheadMiB: 64, PidsMax: 1024}
	ctx := context.Background()
	var create, remove []time.Duration
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		id := fmt.Sprintf("bench-%d", i)
		t0 := time.Now()
		if _, err := m.Create(id, lim); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := m.Remove(ctx, id); err != nil {
			b.Fatal(err)
		}
		create, remove = append(create, t1.Sub(t0)), append(remove, time.Since(t1))
	}
	b.StopTimer()
	total := make([]time.Duration, len(create))
	for i := range create {
		total[i] = create[i] + remove[i]
	}
	for _, x := range []struct {
		name string
		d    []time.Duration
	}{{"create", create}, {"remove", remove}, {"setup", total}} {
		b.ReportMetric(percentileMS(x.d, 50), x.name+"-p50-ms")
		b.ReportMetric(percentileMS(x.d, 95), x.name+"-p95-ms")
	}
}

func percentileMS(d []time.Duration, p int) float64 {
	if len(d) == 0 {
		return 0
	}
	s := slices.Clone(d)
	slices.Sort(s)
	i := min(len(s)-1, (len(s)*p+99)/100-1)
	return float64(s[max(i, 0)]) / float64(time.Millisecond)
}
