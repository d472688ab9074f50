package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/daemon/daemontest"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// fakeCgroups is the server's cgroup seam over plain folders: it keeps
// each cgroup's limits and memory.events, and what was made and removed.
type fakeCgroups struct {
	root string
	mu   sync.Mutex
	live map[string]cgroup.Limits
	ev   map[string]cgroup.Events
	made []string
	gone []string
	max  map[string]uint64 // memory.max set by SetMemoryMax
	// onRemove runs before a removal (with the lock not held).
	onRemove func(id string)
}

func newFakeCgroups(t *testing.T) *fakeCgroups {
	return &fakeCgroups{root: t.TempDir(), live: map[string]cgroup.Limits{}, ev: map[string]cgroup.Events{}}
}

func (f *fakeCgroups) Create(id string, l cgroup.Limits) (*cgroup.Group, error) {
	if err := cgroup.CheckID(id); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.live[id]; ok {
		return nil, fmt.Errorf("fake cgroup %s: %w", id, fs.ErrExist)
	}
	p := filepath.Join(f.root, id)
	if err := os.Mkdir(p, 0o755); err != nil {
		return nil, err
	}
	f.live[id] = l
	f.made = append(f.made, id)
	return &cgroup.Group{ID: id, Path: p}, nil
}

func (f *fakeCgroups) Events(id string) (cgroup.Events, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.live[id]; !ok {
		return cgroup.Events{}, fmt.Errorf("fake cgroup %s: %w", id, fs.ErrNotExist)
	}
	return f.ev[id], nil
}

func (f *fakeCgroups) Remove(ctx context.Context, id string) error {
	if f.onRemove != nil {
		f.onRemove(id)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.live[id]; ok {
		delete(f.live, id)
		f.gone = append(f.gone, id)
	}
	return os.RemoveAll(filepath.Join(f.root, id))
}

func (f *fakeCgroups) SetMemoryMax(id string, bytes uint64) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.live[id]
	if !ok {
		return fmt.Errorf("fake cgroup %s: %w", id, fs.ErrNotExist)
	}
	f.max = mapSet(f.max, id, bytes)
	f.live[id] = l
	return nil
}

func mapSet(m map[string]uint64, k string, v uint64) map[string]uint64 {
	if m == nil {
		m = map[string]uint64{}
	}
	m[k] = v
	return m
}

func (f *fakeCgroups) memoryMax(id string) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.max[id]
}

func (f *fakeCgroups) List() ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for id := range f.live {
		out = append(out, id)
	}
	sort.Strings(out)
	return out, nil
}

func (f *fakeCgroups) limits(id string) (cgroup.Limits, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.live[id]
	return l, ok
}

func (f *fakeCgroups) removed(id string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Contains(f.gone, id)
}

func (f *fakeCgroups) setEvents(id string, e cgroup.Events) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ev[id] = e
}

// TestCgroupLifecycle: every way a sandbox starts gives its VMM process a
// cgroup of its own with its limits (create, fork, template builder,
// pool, rollback), removed once the process is gone; a restart keeps
// the live sandboxes' and prunes the others; an OOM kill is named.
func TestCgroupLifecycle(t *testing.T) {
	cg := newFakeCgroups(t)
	io := []cgroup.IOLimit{{Device: "8:0", WriteBPS: 1 << 20, ReadIOPS: 500}}
	e := newEnv(t, func(c *daemon.Config) { c.Cgroups = cg; c.VMMOverheadMiB = 32; c.PidsMax = 99; c.SandboxIO = io })
	var mu sync.Mutex
	specCgroup := map[string]string{} // folder name → CreateSpec.Host.Cgroup
	e.be.CreateHook = func(_ context.Context, spec daemon.CreateSpec) error {
		mu.Lock()
		defer mu.Unlock()
		specCgroup[filepath.Base(spec.Dir)] = spec.Host.Cgroup
		return nil
	}
	started := func(id string) string {
		mu.Lock()
		defer mu.Unlock()
		return specCgroup[id]
	}

	sb := e.create(&kilnpb.CreateSandboxRequest{Resources: &kilnpb.Resources{Cpus: 2, MemoryMib: 256}})
	want := cgroup.Limits{CPUs: 2, MemoryMiB: 256, OverheadMiB: 32, PidsMax: 99, IO: io}
	if l, ok := cg.limits(sb.Id); !ok || !equalLimits(l, want) {
		t.Errorf("sandbox %s's cgroup: %+v (made %v), want %+v", sb.Id, l, ok, want)
	}
	path := filepath.Join(cg.root, sb.Id)
	if sb.Cgroup != path || started(sb.Id) != path {
		t.Errorf("Sandbox.cgroup %q, the backend started it in %q; want %q", sb.Cgroup, started(sb.Id), path)
	}

	// Fork children: one cgroup each, with the parent's share.
	kids, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sb.Id}, Count: 2})
	if err != nil || len(kids) != 2 {
		t.Fatalf("fork: %v, %v", kids, err)
	}
	for _, k := range kids {
		kp := filepath.Join(cg.root, k.Id)
		if l, ok := cg.limits(k.Id); !ok || !equalLimits(l, want) || k.Cgroup != kp {
			t.Errorf("fork child %s: cgroup %q limits %+v (%v), want %q %+v", k.Id, k.Cgroup, l, ok, kp, want)
		}
	}
	if got := len(specCgroup); got < 3 {
		t.Errorf("the backend saw %d creates, want the sandbox and 2 children", got)
	}

	// Rollback: the new machine is in a cgroup of the same name.
	ck, err := e.c.Checkpoint(ctxT(t), &kilnpb.CheckpointRequest{SandboxId: sb.Id})
	if err != nil {
		t.Fatal(err)
	}
	rb, err := e.c.Rollback(ctxT(t), &kilnpb.RollbackRequest{SandboxId: sb.Id, CheckpointId: ck.Id})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := cg.limits(sb.Id); !ok || rb.Cgroup != path || !cg.removed(sb.Id) {
		t.Errorf("after a rollback: cgroup %q (live %v, old one removed %v), want %q", rb.Cgroup, ok, cg.removed(sb.Id), path)
	}

	// A template's builder runs in a cgroup of its own, gone once built;
	// its pool's sandboxes each have one, which a hand-out keeps.
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Setup: setupScript, Resources: &kilnpb.Resources{MemoryMib: 128}, PoolSize: 1})
	builder := "tb-" + strings.TrimPrefix(tp.Id, "tp-")
	if started(builder) == "" || !cg.removed(builder) {
		t.Errorf("template builder %s: started in %q, removed %v", builder, started(builder), cg.removed(builder))
	}
	e.waitPool(tp.Id, 1)
	pooled := e.create(fromTemplate(tp.Id))
	if !pooled.FromPool || !strings.HasPrefix(filepath.Base(pooled.Cgroup), "pl-") {
		t.Errorf("sandbox from the pool: from pool %v, cgroup %q", pooled.FromPool, pooled.Cgroup)
	}
	if l, ok := cg.limits(filepath.Base(pooled.Cgroup)); !ok || l.MemoryMiB != 128 {
		t.Errorf("the pool sandbox's cgroup: %+v, %v", l, ok)
	}

	// Destroy: the cgroup goes once the VMM process has.
	var pidAlive bool
	cg.onRemove = func(id string) {
		if id == kids[1].Id {
			pidAlive = syscall.Kill(int(kids[1].Pid), 0) == nil && !zombie(kids[1].Pid)
		}
	}
	if _, err := e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: kids[1].Id}); err != nil {
		t.Fatal(err)
	}
	if !cg.removed(kids[1].Id) || pidAlive {
		t.Errorf("destroyed %s: cgroup removed %v, its VMM process still alive at the removal: %v", kids[1].Id, cg.removed(kids[1].Id), pidAlive)
	}
	cg.onRemove = nil

	// A restart keeps the live sandboxes' cgroups and prunes the rest.
	if _, err := cg.Create("sb-gone", cgroup.Limits{}); err != nil {
		t.Fatal(err)
	}
	e.stop()
	e.start()
	for _, id := range []string{sb.Id, kids[0].Id, filepath.Base(pooled.Cgroup)} {
		if _, ok := cg.limits(id); !ok {
			t.Errorf("cgroup %s of a live sandbox removed by a restart", id)
		}
	}
	if !cg.removed("sb-gone") {
		t.Error("a leftover cgroup survived a restart")
	}
	if got := e.get(sb.Id); got.Cgroup != path {
		t.Errorf("after a restart: Sandbox.cgroup %q, want %q", got.Cgroup, path)
	}

	// An adopted sandbox whose VMM process the OOM killer took: failed,
	// with the reason, and its cgroup removed.
	cg.setEvents(kids[0].Id, cgroup.Events{Max: 40, OOM: 1, OOMKill: 1, OOMGroupKill: 1})
	syscall.Kill(int(kids[0].Pid), syscall.SIGKILL)
	failed := e.waitState(kids[0].Id, kilnpb.SandboxState_SANDBOX_STATE_FAILED)
	if w := "killed by its memory limit: memory.max 288 MiB"; !strings.Contains(failed.Reason, w) || !strings.Contains(failed.Reason, "oom_kill 1") {
		t.Errorf("reason %q, want %q and oom_kill 1", failed.Reason, w)
	}
	if failed.Cgroup != "" {
		t.Errorf("failed sandbox still shows cgroup %q", failed.Cgroup)
	}
	waitFor(t, func() bool { return cg.removed(kids[0].Id) }, "the OOM-killed sandbox's cgroup removed")
	// Without an OOM kill the reason is the plain one.
	syscall.Kill(int(e.get(sb.Id).Pid), syscall.SIGKILL)
	if r := e.waitState(sb.Id, kilnpb.SandboxState_SANDBOX_STATE_FAILED).Reason; !strings.HasPrefix(r, "the sandbox stopped on its own") {
		t.Errorf("reason %q", r)
	}

	// A create that fails leaves no cgroup.
	e.be.CreateHook = func(context.Context, daemon.CreateSpec) error { return errors.New("no luck") }
	_, err = e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}})
	if err == nil {
		t.Fatal("create with a failing backend succeeded")
	}
	ids, _ := cg.List()
	for _, id := range ids {
		if id != filepath.Base(pooled.Cgroup) && !strings.HasPrefix(id, "pl-") {
			t.Errorf("cgroup %s left after the sandboxes it was for ended", id)
		}
	}
}

func equalLimits(a, b cgroup.Limits) bool {
	return a.CPUs == b.CPUs && a.MemoryMiB == b.MemoryMiB && a.OverheadMiB == b.OverheadMiB && a.PidsMax == b.PidsMax && slices.Equal(a.IO, b.IO)
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	for range 2000 {
		if cond() {
			return
		}
		syscall.Nanosleep(&syscall.Timespec{Nsec: 5e6}, nil)
	}
	t.Fatalf("timed out waiting for %s", what)
}

// TestMemoryAdmission: creates, forks and pool fills are admitted while
// the commit (guest memory plus VMM overhead each) stays within the
// overcommit ratio of the host's memory; the refusal names the numbers.
func TestMemoryAdmission(t *testing.T) {
	for _, tc := range []struct {
		name      string
		ratio     float64
		overhead  uint64
		fit       int    // 512 MiB sandboxes that fit on 2048 MiB
		wantInMsg string // the refusal of the one more
	}{
		{name: "default ratio and overhead", fit: 3,
			wantInMsg: "commit 1728 MiB (guest memory plus 64 MiB of VMM overhead each); 576 more MiB would pass 2048 MiB, 1 × the host's 2048 MiB"},
		{name: "overcommit 2", ratio: 2, overhead: 64, fit: 7,
			wantInMsg: "commit 4032 MiB (guest memory plus 64 MiB of VMM overhead each); 576 more MiB would pass 4096 MiB, 2 × the host's 2048 MiB"},
		{name: "small overhead", ratio: 1.5, overhead: 1, fit: 5,
			wantInMsg: "commit 2565 MiB (guest memory plus 1 MiB of VMM overhead each); 513 more MiB would pass 3072 MiB, 1.5 × the host's 2048 MiB"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, func(c *daemon.Config) {
				c.HostMemoryMiB, c.MaxMemoryMiB, c.MemoryOvercommit, c.VMMOverheadMiB = 2048, 1<<20, tc.ratio, tc.overhead
			})
			res := &kilnpb.Resources{MemoryMib: 512}
			var sbs []*kilnpb.Sandbox
			for range tc.fit {
				sbs = append(sbs, e.create(&kilnpb.CreateSandboxRequest{Resources: res}))
			}
			committed, limit := e.srv.MemoryCommit()
			over := tc.overhead
			if over == 0 {
				over = 64
			}
			if want := uint64(tc.fit) * (512 + over); committed != want || limit != uint64(2048*max(tc.ratio, 1)) {
				t.Errorf("MemoryCommit = %d of %d, want %d of %v", committed, limit, want, 2048*max(tc.ratio, 1))
			}
			_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Resources: res})
			wantCode(t, err, codes.ResourceExhausted, tc.wantInMsg)
			// A fork of one more child is refused the same way.
			_, err = e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: sbs[0].Id}, Count: 1})
			wantCode(t, err, codes.ResourceExhausted, "memory overcommit ratio")
			// An ended sandbox no longer counts.
			e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sbs[0].Id})
			e.create(&kilnpb.CreateSandboxRequest{Resources: res})
		})
	}
}

// TestMemoryAdmissionPool: a pool's refills count and wait for room
// rather than fail, and a builder counts while it runs.
func TestMemoryAdmissionPool(t *testing.T) {
	// 1024 MiB: three sandboxes of 256 + 64 MiB.
	e := newEnv(t, func(c *daemon.Config) { c.HostMemoryMiB, c.MaxMemoryMiB, c.VMMOverheadMiB = 1024, 1<<20, 64 })
	res := &kilnpb.Resources{MemoryMib: 256}
	sb := e.create(&kilnpb.CreateSandboxRequest{Resources: res})
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Setup: setupScript, Resources: res, PoolSize: 4})
	e.waitPool(tp.Id, 2) // 3 × 320 MiB = 960: the others wait
	if committed, _ := e.srv.MemoryCommit(); committed != 960 {
		t.Errorf("committed %d MiB, want 960", committed)
	}
	_, err := e.c.CreateSandbox(ctxT(t), &kilnpb.CreateSandboxRequest{RequestId: nextReq(), Source: &kilnpb.CreateSandboxRequest_Image{Image: "busybox"}, Resources: res})
	wantCode(t, err, codes.ResourceExhausted, "commit 960 MiB")
	// Room made: the pool refills into it at once, not when its backoff
	// (1 s, 2 s, 4 s: the next try 7 s after the first) next lets it.
	time.Sleep(3500 * time.Millisecond)
	e.c.DestroySandbox(ctxT(t), &kilnpb.DestroySandboxRequest{Id: sb.Id})
	deadline := time.Now().Add(2500 * time.Millisecond)
	for {
		got, err := e.c.GetTemplate(ctxT(t), &kilnpb.GetTemplateRequest{Id: tp.Id})
		if err != nil {
			t.Fatal(err)
		}
		if got.PoolReady == 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the pool did not refill into the room a destroy made: %d ready (it waited out its backoff)", got.PoolReady)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestCgroupConfigInvalid(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(*daemon.Config)
		want string
	}{
		{"negative ratio", func(c *daemon.Config) { c.MemoryOvercommit = -1 }, "MemoryOvercommit -1"},
		{"NaN ratio", func(c *daemon.Config) { c.MemoryOvercommit = math.NaN() }, "MemoryOvercommit NaN"},
		{"negative pids", func(c *daemon.Config) { c.PidsMax = -5 }, "PidsMax -5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			be := &daemontest.Backend{}
			t.Cleanup(be.KillAll)
			cfg := daemon.Config{StateDir: t.TempDir(), Backend: be}
			tc.mod(&cfg)
			if _, err := daemon.New(cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New: %v, want an error with %q", err, tc.want)
			}
		})
	}
}

// TestCgroupGrowsWithCheckpoints: an in-memory checkpoint or a fork
// freezes a sandbox's memory into a base its VMM process pays for, and
// the guest's writes after it are copies on top: its memory.max grows by a
// guest's worth per base it holds (before the hold, so the copies fit),
// and never shrinks while it lives. A persisted checkpoint holds nothing.
func TestCgroupGrowsWithCheckpoints(t *testing.T) {
	cg := newFakeCgroups(t)
	e := newEnv(t, func(c *daemon.Config) { c.Cgroups = cg; c.VMMOverheadMiB = 64; c.MemoryOvercommit = 8 })
	res := &kilnpb.Resources{MemoryMib: 256}
	mib := func(n uint64) uint64 { return n << 20 }

	sb := e.create(&kilnpb.CreateSandboxRequest{Resources: res})
	if got := cg.memoryMax(sb.Id); got != 0 {
		t.Errorf("a fresh sandbox's memory.max was changed to %d: its Create limits hold", got)
	}
	e.checkpoint(sb.Id, false) // in memory
	if got, want := cg.memoryMax(sb.Id), mib(2*256+64); got != want {
		t.Errorf("after one in-memory checkpoint: memory.max %d MiB, want %d", got>>20, want>>20)
	}
	ck2 := e.checkpoint(sb.Id, false)
	if got, want := cg.memoryMax(sb.Id), mib(3*256+64); got != want {
		t.Errorf("after two: memory.max %d MiB, want %d", got>>20, want>>20)
	}
	if _, err := e.c.DeleteCheckpoint(ctxT(t), &kilnpb.DeleteCheckpointRequest{Id: ck2.Id}); err != nil {
		t.Fatal(err)
	}
	if got, want := cg.memoryMax(sb.Id), mib(3*256+64); got != want {
		t.Errorf("after a delete: memory.max %d MiB, want it kept at %d", got>>20, want>>20)
	}

	// A fork of a sandbox with no checkpoint: one base.
	other := e.create(&kilnpb.CreateSandboxRequest{Resources: res})
	if _, err := e.fork(&kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: other.Id}, Count: 1}); err != nil {
		t.Fatal(err)
	}
	if got, want := cg.memoryMax(other.Id), mib(2*256+64); got != want {
		t.Errorf("a forked parent: memory.max %d MiB, want %d", got>>20, want>>20)
	}

	// A persisted checkpoint holds no base in the VMM process.
	third := e.create(&kilnpb.CreateSandboxRequest{Resources: res})
	if _, err := e.c.Checkpoint(ctxT(t), &kilnpb.CheckpointRequest{SandboxId: third.Id, Persist: true}); err != nil {
		t.Fatal(err)
	}
	if got := cg.memoryMax(third.Id); got != 0 {
		t.Errorf("after a persisted checkpoint: memory.max changed to %d MiB", got>>20)
	}
}

// TestCgroupRoomForTemplateSave: a template builder's VMM process writes
// the snapshot's memory file, charged to its cgroup on top of the guest
// memory it holds (on a tmpfs state folder, for good): its memory.max
// has room for one more guest's worth before the save, not before.
func TestCgroupRoomForTemplateSave(t *testing.T) {
	cg := newFakeCgroups(t)
	e := newEnv(t, func(c *daemon.Config) { c.Cgroups = cg; c.VMMOverheadMiB = 64 })
	var (
		mu    sync.Mutex
		saves []uint64
	)
	e.be.CreateHook = func(ctx context.Context, spec daemon.CreateSpec) error {
		if got := cg.memoryMax(filepath.Base(spec.Dir)); got != 0 {
			return fmt.Errorf("memory.max raised to %d MiB before the builder booted", got>>20)
		}
		return nil
	}
	e.be.SaveHook = func(ctx context.Context, inDir, dir string) error {
		id := filepath.Base(inDir)
		l, ok := cg.limits(id)
		if !ok {
			return fmt.Errorf("saving from %s, which has no cgroup", id)
		}
		if l.MemoryMax() != (256+64)<<20 {
			return fmt.Errorf("the builder's cgroup was made with memory.max %d MiB, want 256 + 64", l.MemoryMax()>>20)
		}
		mu.Lock()
		saves = append(saves, cg.memoryMax(id))
		mu.Unlock()
		return nil
	}
	tp := e.createTemplate(&kilnpb.CreateTemplateRequest{Name: "room", Setup: setupScript,
		Resources: &kilnpb.Resources{MemoryMib: 256}})
	mu.Lock()
	defer mu.Unlock()
	if len(saves) != 1 {
		t.Fatalf("template %s: %d saves, want 1", tp.Id, len(saves))
	}
	if got, want := saves[0], uint64(2*256+64)<<20; got != want {
		t.Errorf("builder's memory.max during the save: %d MiB, want %d (two guests' worth and the overhead)", got>>20, want>>20)
	}
}
