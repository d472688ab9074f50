package daemon_test

import (
	"context"
	"io"
	"io/fs"
	"log/slog"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/hostnet"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// TestKVMDaemonHibernate: a sandbox with a network and a cgroup, a
// background process counting into a file and a file of its own, is
// hibernated (its VMM process and cgroup gone: its memory freed) and
// resumed under the same ID with the process still counting, the file
// there and its network working; hibernated again, the daemon
// restarted, and resumed after the restart.
func TestKVMDaemonHibernate(t *testing.T) {
	kvmtest.Require(t)
	began := time.Now()
	w := newNetWorld(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	mgr, err := hostnet.New(ctx, hostnet.Config{Pool: netip.MustParsePrefix(netTestPool),
		DNS: []netip.AddrPort{netip.MustParseAddrPort(netTestAllowed + ":53")}, Dir: t.TempDir(), HostNetns: w.hostPath,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		t.Fatalf("hostnet: %v", err)
	}
	t.Cleanup(func() {
		for _, id := range mgr.List() {
			mgr.Detach(context.Background(), id)
		}
		mgr.Close()
	})
	m := testCgroupRoot(t)
	e := newKVMEnv(t)
	e.stop()
	e.cfg.Network = daemon.HostNetwork(mgr)
	e.cfg.Cgroups = m
	e.cfg.VMMOverheadMiB = overheadMiB
	e.startKVM()

	sb, err := e.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{RequestId: nextReq(),
		Source: &kilnpb.CreateSandboxRequest_Image{Image: e.image}, Resources: &kilnpb.Resources{MemoryMib: 256},
		LifetimeMs: 3_600_000, Egress: &kilnpb.EgressPolicy{Mode: kilnpb.EgressPolicy_MODE_ALLOW_ALL}})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	t.Logf("sandbox %s ready in %d ms (setup %v)", sb.Id, sb.ReadyMs, time.Since(began).Round(time.Millisecond))
	reach := func(id string) {
		t.Helper()
		r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: id, Argv: []string{"sh", "-c", `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 3 ` + netTestAllowed + ` 80`}})
		if r.err != nil || !strings.HasSuffix(strings.TrimSpace(r.stdout), "world "+netTestAllowed+":80") {
			t.Errorf("sandbox %s: the world's server: %+v", id, r)
		}
	}
	reach(sb.Id)
	// Allow-all is not the metadata service: it is refused by default.
	if r := e.exec(ctx, &kilnpb.ExecStart{SandboxId: sb.Id, Argv: []string{"sh", "-c", `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 3 ` + netTestMetadata + ` 80`}}); r.err != nil || strings.Contains(r.stdout, "world") {
		t.Errorf("sandbox %s under allow-all reached the metadata service %s: %+v", sb.Id, netTestMetadata, r)
	}
	count := func() int {
		t.Helper()
		n, err := strconv.Atoi(e.shOut(sb.Id, "cat /tmp/count"))
		if err != nil {
			t.Fatalf("count: %v", err)
		}
		return n
	}
	// counting checks that the background process still counts, past
	// what it had counted (at least).
	counting := func(least int) int {
		t.Helper()
		deadline := time.Now().Add(time.Minute)
		for {
			if n := count(); n > least {
				return n
			}
			if time.Now().After(deadline) {
				t.Fatalf("the background process stopped counting at %d", least)
			}
			time.Sleep(500 * time.Millisecond)
		}
	}
	bg, cancelBg := e.startExec(&kilnpb.ExecStart{SandboxId: sb.Id, Background: true,
		Argv: []string{"sh", "-c", "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 1; done"}})
	cancelBg() // a background exec outlives its call
	e.shOut(sb.Id, "echo kept > /root/f")
	n := counting(0)
	// An in-memory checkpoint, which its VMM process holds: the
	// hibernation writes it to disk first.
	ck, err := e.c.Checkpoint(ctx, &kilnpb.CheckpointRequest{SandboxId: sb.Id})
	if err != nil || ck.Persisted {
		t.Fatalf("checkpoint: %v, %v", ck, err)
	}
	e.shOut(sb.Id, "echo later > /root/f")

	// hibernate checks that sandbox s hibernates, and what it freed.
	hibernate := func(s *kilnpb.Sandbox) {
		t.Helper()
		cg := m.Path(s.Id)
		cur := readMiB(t, filepath.Join(cg, "memory.current"))
		avail, _ := hostMemAvailableMiB()
		at := time.Now()
		h, err := e.c.PauseSandbox(ctx, &kilnpb.PauseSandboxRequest{Id: s.Id, Hibernate: true})
		if err != nil {
			t.Fatalf("hibernate: %v", err)
		}
		took := time.Since(at)
		if !h.Hibernated || h.State != kilnpb.SandboxState_SANDBOX_STATE_PAUSED || h.Pid != 0 || h.ExpiresUnixMs != 0 {
			t.Fatalf("hibernated: %v", h)
		}
		waitGone(t, s.Pid)
		if _, err := os.Stat(cg); !os.IsNotExist(err) {
			t.Errorf("its cgroup %s after the hibernation: %v", cg, err)
		}
		after, _ := hostMemAvailableMiB()
		t.Logf("hibernated in %v: VMM process %d gone, its cgroup (memory.current %d MiB) removed; host MemAvailable %d → %d MiB; state on disk %d MiB",
			took.Round(time.Millisecond), s.Pid, cur, avail, after, diskMiB(t, filepath.Join(e.state, "hibernated", s.Id)))
	}
	resume := func(s *kilnpb.Sandbox) *kilnpb.Sandbox {
		t.Helper()
		at := time.Now()
		r, err := e.c.ResumeSandbox(ctx, &kilnpb.ResumeSandboxRequest{Id: s.Id})
		if err != nil {
			t.Fatalf("resume: %v", err)
		}
		t.Logf("resumed in %v (ready %d ms), VMM process %d", time.Since(at).Round(time.Millisecond), r.ReadyMs, r.Pid)
		if r.Id != s.Id || r.Hibernated || r.State != kilnpb.SandboxState_SANDBOX_STATE_RUNNING || r.Pid == 0 ||
			r.Network.GetAddress() != sb.Network.GetAddress() || r.Network.GetMac() != sb.Network.GetMac() || r.Cgroup != m.Path(s.Id) {
			t.Fatalf("resumed: %v", r)
		}
		if _, err := os.Stat(filepath.Join(e.state, "hibernated", s.Id)); !os.IsNotExist(err) {
			t.Errorf("its state after the resume: %v", err)
		}
		return r
	}
	listed := func() *kilnpb.ExecInfo {
		t.Helper()
		execs, err := e.c.ListExecs(ctx, &kilnpb.ListExecsRequest{SandboxId: sb.Id})
		if err != nil {
			t.Fatal(err)
		}
		for _, x := range execs.Execs {
			if x.ExecId == bg.ExecId {
				return x
			}
		}
		t.Fatalf("the background exec %s is not listed: %v", bg.ExecId, execs.Execs)
		return nil
	}

	hibernate(sb)
	sb2 := resume(sb)
	if x := listed(); x.Exit != nil {
		t.Errorf("the background exec after the resume: %v", x)
	}
	n = counting(n)
	if got := e.shOut(sb.Id, "cat /root/f"); got != "later" {
		t.Errorf("file after the resume: %q", got)
	}
	reach(sb.Id)
	cks, err := e.c.ListCheckpoints(ctx, &kilnpb.ListCheckpointsRequest{SandboxId: sb.Id})
	if err != nil || len(cks.Checkpoints) != 1 || cks.Checkpoints[0].Id != ck.Id || !cks.Checkpoints[0].Persisted {
		t.Fatalf("checkpoints after the hibernation: %v, %v", cks, err)
	}

	// Hibernated across a restart of the daemon.
	hibernate(sb2)
	e.stop()
	e.startKVM()
	if got, err := e.c.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: sb.Id}); err != nil || !got.Hibernated {
		t.Fatalf("after the restart: %v, %v", got, err)
	}
	resume(sb)
	n = counting(n)
	if got := e.shOut(sb.Id, "cat /root/f"); got != "later" {
		t.Errorf("file after the restart and resume: %q", got)
	}
	reach(sb.Id)
	if _, err := e.c.KillExec(ctx, &kilnpb.KillExecRequest{SandboxId: sb.Id, ExecId: bg.ExecId}); err != nil {
		t.Fatalf("kill the background exec: %v", err)
	}
	deadline := time.Now().Add(time.Minute)
	for listed().Exit == nil {
		if time.Now().After(deadline) {
			t.Fatal("the background exec runs on after KillExec")
		}
		time.Sleep(100 * time.Millisecond)
	}
	// The checkpoint that was in memory before the hibernation, written
	// to disk by it, rolls the sandbox back.
	at := time.Now()
	if _, err := e.c.Rollback(ctx, &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck.Id}); err != nil {
		t.Fatalf("rollback to the persisted checkpoint: %v", err)
	}
	t.Logf("rolled back in %v", time.Since(at).Round(time.Millisecond))
	if got := e.shOut(sb.Id, "cat /root/f"); got != "kept" {
		t.Errorf("file after the rollback: %q", got)
	}
	reach(sb.Id)
	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sb.Id}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(e.state, "hibernated", sb.Id)); !os.IsNotExist(err) {
		t.Errorf("hibernated state after the destroy: %v", err)
	}
	t.Logf("done in %v", time.Since(began).Round(time.Millisecond))
}

// hostMemAvailableMiB reads /proc/meminfo's MemAvailable.
func hostMemAvailableMiB() (uint64, bool) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "MemAvailable:" {
			kb, err := strconv.ParseUint(f[1], 10, 64)
			return kb / 1024, err == nil
		}
	}
	return 0, false
}

// diskMiB is what the files under dir take on disk (sparse files count
// their data only).
func diskMiB(t *testing.T, dir string) int64 {
	t.Helper()
	var blocks int64
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		if fi, err := d.Info(); err == nil {
			if st, ok := fi.Sys().(*syscall.Stat_t); ok {
				blocks += st.Blocks
			}
		}
		return nil
	})
	return blocks * 512 >> 20
}
