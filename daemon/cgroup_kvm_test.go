package daemon_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// testCgroupRoot makes a cgroup of the test's own under the host's
// cgroup v2 mount (L1's), with the controllers enabled above it, and
// opens it as kilnd's delegated root; the cleanup removes it.
func testCgroupRoot(t *testing.T) *cgroup.Manager {
	t.Helper()
	var st unix.Statfs_t
	if err := unix.Statfs(cgroup.DefaultMount, &st); err != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
		t.Fatalf("%s is not a cgroup v2 mount (%v): the KVM harness's L1 has one", cgroup.DefaultMount, err)
	}
	if err := os.WriteFile(filepath.Join(cgroup.DefaultMount, "cgroup.subtree_control"), []byte("+cpu +memory +pids +io"), 0); err != nil {
		t.Fatalf("enable controllers in the root cgroup: %v", err)
	}
	root := filepath.Join(cgroup.DefaultMount, fmt.Sprintf("kiln-dtest-%d", os.Getpid()))
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	m, err := cgroup.Open(root)
	if err != nil {
		unix.Rmdir(root)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		ids, _ := m.List()
		for _, id := range ids {
			m.Remove(ctx, id)
		}
		for _, d := range []string{filepath.Join(root, cgroup.SandboxesDir), root} {
			if err := unix.Rmdir(d); err != nil {
				t.Errorf("cleanup: rmdir %s: %v", d, err)
			}
		}
	})
	return m
}

// overheadMiB is the VMM overhead the test gives each sandbox: the
// daemon's default. An idle VMM process (this test binary) holds about
// 10 MiB of anonymous memory of its own in L1 (TestKVMDaemonMemory); its
// binary's pages are charged to whoever read them first (this process).
const overheadMiB = 64

func readTrim(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func readMiB(t *testing.T, path string) uint64 {
	t.Helper()
	n, err := strconv.ParseUint(readTrim(t, path), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	return n >> 20
}

// TestKVMDaemonCgroups: a server over the real backend with cgroups on
// (in L1's cgroup v2 tree) runs each sandbox's VMM process in a cgroup
// of its own with the sandbox's limits, fork children in theirs; the
// guest filling its memory is charged there and stays within
// memory.max; a VMM-side leak (memory.max lowered below what the process
// holds) is OOM-killed inside that cgroup only: memory.events counts it,
// the sandbox fails with the memory-limit reason, its sibling and this
// process run on, and the cgroups go with their sandboxes. A small
// template's builder saves within its cgroup.
func TestKVMDaemonCgroups(t *testing.T) {
	kvmtest.Require(t)
	m := testCgroupRoot(t)
	e := newKVMEnv(t)
	e.stop()
	e.cfg.Cgroups = m
	e.cfg.VMMOverheadMiB = overheadMiB
	e.startKVM()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	began := time.Now()

	sbs := make([]*kilnpb.Sandbox, 2)
	var wg sync.WaitGroup
	for i := range sbs {
		wg.Add(1)
		go func() { defer wg.Done(); sbs[i] = e.createImage(0) }()
	}
	wg.Wait()
	t.Logf("two sandboxes ready in %v", time.Since(began).Round(time.Millisecond))
	victim, sibling := sbs[0], sbs[1]
	for _, sb := range sbs {
		dir := m.Path(sb.Id)
		if sb.Cgroup != dir {
			t.Errorf("sandbox %s: Sandbox.cgroup %q, want %q", sb.Id, sb.Cgroup, dir)
		}
		want := "0::" + strings.TrimPrefix(dir, cgroup.DefaultMount)
		if got := readTrim(t, fmt.Sprintf("/proc/%d/cgroup", sb.Pid)); got != want {
			t.Errorf("sandbox %s: VMM process %d is in %q, want %q", sb.Id, sb.Pid, got, want)
		}
		for f, want := range map[string]string{"cpu.max": "100000 100000", "memory.max": strconv.Itoa((512 + overheadMiB) << 20),
			"pids.max": "1024", "memory.oom.group": "1"} {
			if got := readTrim(t, filepath.Join(dir, f)); got != want {
				t.Errorf("sandbox %s: %s = %q, want %q", sb.Id, f, got, want)
			}
		}
	}

	// A fork child's VMM process starts in a cgroup of its own.
	kids, err := e.forkCtx(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sibling.Id}, Count: 1})
	if err != nil || len(kids) != 1 {
		t.Fatalf("fork: %v, %v", kids, err)
	}
	kid := kids[0]
	if want := "0::" + strings.TrimPrefix(m.Path(kid.Id), cgroup.DefaultMount); kid.Cgroup != m.Path(kid.Id) ||
		readTrim(t, fmt.Sprintf("/proc/%d/cgroup", kid.Pid)) != want {
		t.Errorf("fork child %s: cgroup %q, VMM process %d in %q; want %q", kid.Id, kid.Cgroup, kid.Pid,
			readTrim(t, fmt.Sprintf("/proc/%d/cgroup", kid.Pid)), want)
	}
	if got := e.shOut(kid.Id, "echo child"); got != "child" {
		t.Errorf("fork child: %q", got)
	}
	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: kid.Id}); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(m.Path(kid.Id)); !os.IsNotExist(err) {
		t.Errorf("destroyed fork child's cgroup: %v, want it removed", err)
	}

	// The guest fills its page cache (a tmpfs file of 320 MiB): charged
	// to its VMM process's cgroup, within memory.max.
	vdir := m.Path(victim.Id)
	before := readMiB(t, filepath.Join(vdir, "memory.current"))
	t.Logf("victim's VMM process before: %s", rss(t, victim.Pid))
	e.shOut(victim.Id, "mkdir -p /mnt/fill && mount -t tmpfs -o size=330m fill /mnt/fill && dd if=/dev/zero of=/mnt/fill/f bs=1M count=320 2>/dev/null; sync; echo ok")
	cur, max := readMiB(t, filepath.Join(vdir, "memory.current")), readMiB(t, filepath.Join(vdir, "memory.max"))
	peak := cur
	if _, err := os.Stat(filepath.Join(vdir, "memory.peak")); err == nil {
		peak = readMiB(t, filepath.Join(vdir, "memory.peak"))
	}
	t.Logf("victim's cgroup: memory.current %d MiB before, %d after the guest's 320 MiB; peak %d; memory.max %d MiB; memory.events %q; VMM process %s",
		before, cur, peak, max, strings.ReplaceAll(readTrim(t, filepath.Join(vdir, "memory.events")), "\n", ", "), rss(t, victim.Pid))
	if cur < before+250 || cur > max || peak > max {
		t.Errorf("memory.current %d MiB (was %d), peak %d: want the guest's 320 MiB charged, and at most memory.max %d MiB", cur, before, peak, max)
	}
	if got := e.shOut(victim.Id, "echo alive"); got != "alive" {
		t.Errorf("victim after filling its memory: %q", got)
	}

	// A VMM-side leak: memory.max below what the process holds, with no
	// swap to go to: the OOM killer takes the VMM process, in its cgroup
	// (the write counts "oom", not "max": no charge hit the limit).
	lowered := cur / 2
	if err := os.WriteFile(filepath.Join(vdir, "memory.max"), []byte(strconv.FormatUint(lowered<<20, 10)), 0); err != nil {
		t.Fatalf("lower memory.max: %v", err)
	}
	evb, err := os.ReadFile(filepath.Join(vdir, "memory.events"))
	if err != nil {
		t.Logf("memory.events already gone with the cgroup: %v", err)
	} else {
		ev, err := cgroup.ParseEvents(string(evb))
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("victim's memory.events after memory.max %d MiB: %q", lowered, strings.ReplaceAll(strings.TrimSpace(string(evb)), "\n", ", "))
		if ev.OOM == 0 || ev.OOMKill == 0 {
			t.Errorf("memory.events %+v: want oom and oom_kill counted", ev)
		}
	}
	deadline := time.Now().Add(3 * time.Minute)
	var failed *kilnpb.Sandbox
	for {
		failed, err = e.c.GetSandbox(ctx, &kilnpb.GetSandboxRequest{Id: victim.Id})
		if err != nil {
			t.Fatal(err)
		}
		if failed.State == kilnpb.SandboxState_SANDBOX_STATE_FAILED || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("victim: %s: %s", failed.State, failed.Reason)
	if failed.State != kilnpb.SandboxState_SANDBOX_STATE_FAILED || !strings.Contains(failed.Reason, fmt.Sprintf("killed by its memory limit: memory.max %d MiB", 512+overheadMiB)) ||
		!strings.Contains(failed.Reason, "memory.events oom_kill") {
		t.Errorf("victim %s (%s), want FAILED, killed by its memory limit", failed.State, failed.Reason)
	}
	if alive(victim.Pid) {
		t.Errorf("victim's VMM process %d still runs", victim.Pid)
	}
	if _, err := os.Stat(vdir); !os.IsNotExist(err) {
		t.Errorf("victim's cgroup after it failed: %v, want it removed", err)
	}
	// The sibling and this process run on, untouched.
	if got := e.shOut(sibling.Id, "echo alive"); got != "alive" {
		t.Errorf("sibling: %q", got)
	}
	sev, err := cgroup.ParseEvents(readTrim(t, filepath.Join(m.Path(sibling.Id), "memory.events")))
	if err != nil || sev.OOMKill != 0 || sev.Max != 0 {
		t.Errorf("sibling's memory.events %+v, %v: want no OOM", sev, err)
	}

	// A template builder of 128 MiB: a cold boot in 2 MiB pages holds
	// nearly all of its guest memory, and the memory file its save writes
	// is charged to the same cgroup (on a tmpfs state folder, for good).
	// Its limit makes room for the file first: the template is made, not
	// OOM-killed in the save (as it was, measured in kiln bench daemon).
	tp, err := e.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "small", Image: e.image, RequestId: nextReq(),
		Setup: []string{"sh", "-c", "echo ready > /setup"}, Resources: &kilnpb.Resources{MemoryMib: 128}})
	if err != nil {
		t.Errorf("a 128 MiB template with cgroups on: %v", err)
	} else {
		t.Logf("template %s of 128 MiB made with cgroups on", tp.Id)
	}

	if _, err := e.c.DestroySandbox(ctx, &kilnpb.DestroySandboxRequest{Id: sibling.Id}); err != nil {
		t.Fatal(err)
	}
	if ids, err := m.List(); err != nil || len(ids) != 0 {
		t.Errorf("cgroups left after every sandbox ended: %q, %v", ids, err)
	}
	t.Logf("TestKVMDaemonCgroups took %v", time.Since(began).Round(time.Millisecond))
}

// rss is what /proc/PID/status says of a process's resident memory.
func rss(t *testing.T, pid int32) string {
	t.Helper()
	var out []string
	for _, line := range strings.Split(readTrim(t, fmt.Sprintf("/proc/%d/status", pid)), "\n") {
		for _, k := range []string{"RssAnon:", "RssFile:", "RssShmem:"} {
			if strings.HasPrefix(line, k) {
				out = append(out, strings.Join(strings.Fields(line), " "))
			}
		}
	}
	return strings.Join(out, ", ")
}
