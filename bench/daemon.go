package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	gclient "github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/snapshot"
)

// Defaults of DaemonSpec.
var (
	// DefaultDaemonConcurrency are the create bursts' sizes.
	DefaultDaemonConcurrency = []int{1, 10, 50}
	// DefaultDaemonSetup is the template's setup: a file written once.
	DefaultDaemonSetup = []string{"sh", "-c", "echo ready > /setup"}
)

const (
	// DefaultDaemonSamples is the least number of creates timed at each
	// concurrency, per path.
	DefaultDaemonSamples = 20
	// DefaultDaemonPool is the warm pool's size.
	DefaultDaemonPool = 4
	// DefaultDaemonRateFor is how long the sustained loop starts sandboxes.
	DefaultDaemonRateFor = 60 * time.Second
	// DefaultDaemonRateWorkers is how many loops run at once.
	DefaultDaemonRateWorkers = 4
	// DefaultDaemonCheckpoints is how many checkpoints and rollbacks of
	// each kind are timed.
	DefaultDaemonCheckpoints = 5
	// DefaultDaemonMemoryMiB is the guest memory.
	DefaultDaemonMemoryMiB = 128
	// DefaultDaemonOpTimeout bounds one create, fork or rollback with its
	// exec (emulated KVM's bursts of 50 take minutes).
	DefaultDaemonOpTimeout = 10 * time.Minute
)

// DaemonSpec says what RunDaemon measures.
type DaemonSpec struct {
	// Kilnd is the kilnd binary; VMM the kiln-vmm binary that runs every
	// VM, kilnd's and the library path's.
	Kilnd string `json:"kilnd"`
	VMM   string `json:"vmm"`
	// Kernel and Agent are kilnd's --kernel and --agent (empty: its
	// defaults, the cached Debian kernel and kiln-agent beside kiln).
	Kernel string `json:"kernel,omitempty"`
	Agent  string `json:"agent,omitempty"`
	// Image is the template's image reference, in Images (or pullable
	// from its registry).
	Image  string `json:"image"`
	Images string `json:"images"`
	// Setup is the template's setup argv (DefaultDaemonSetup when nil).
	Setup     []string `json:"setup"`
	MemoryMiB int      `json:"memory_mib"`
	// Concurrency are the create bursts' sizes (DefaultDaemonConcurrency
	// when nil).
	Concurrency []int `json:"concurrency"`
	// Samples is the least number of creates timed at each concurrency
	// per path: bursts of that size are repeated until there are as many.
	Samples int `json:"samples"`
	// Pool is the warm pool's size (0: no pool measured; negative after
	// Normalize never).
	Pool int `json:"pool"`
	// RateFor is how long the sustained loop starts sandboxes, on each
	// path (0: no loop); RateWorkers how many loops run at once.
	RateFor     time.Duration `json:"rate_for_ns"`
	RateWorkers int           `json:"rate_workers"`
	// Forks are the fork sizes, each from one running sandbox per path.
	Forks []int `json:"forks"`
	// Checkpoints is how many checkpoints and rollbacks of each kind are
	// timed (0: none).
	Checkpoints int `json:"checkpoints"`
	// NoLibrary measures kilnd alone.
	NoLibrary bool `json:"no_library"`
	// Dir is the scratch folder (kilnd's socket, state and log, the
	// library's saves); empty: a new temporary one, removed after.
	Dir string `json:"dir,omitempty"`
	// MaxMemoryMiB is kilnd's --max-memory (0: enough for the largest
	// phase).
	MaxMemoryMiB int `json:"max_memory_mib"`
	// CgroupRoot is kilnd's --cgroup-root: a path, or "none" (no limits).
	// Empty: kilnd's own cgroup, unless this process is in the root
	// cgroup (where kilnd refuses); then a folder made for the run under
	// /sys/fs/cgroup, as systemd's Delegate=yes would give it.
	CgroupRoot string `json:"cgroup_root,omitempty"`
	// OpTimeout bounds one create, fork or rollback with its first exec
	// (DefaultDaemonOpTimeout when zero).
	OpTimeout time.Duration `json:"op_timeout_ns"`
	// KVMMode, when set, is reported instead of the one detected.
	KVMMode string `json:"kvm_mode,omitempty"`
	// Logger is the library path's sandboxes'; discarded when nil.
	Logger *slog.Logger `json:"-"`
}

// Normalize fills in the defaults and checks the spec.
func (s DaemonSpec) Normalize() (DaemonSpec, error) {
	if s.Setup == nil {
		s.Setup = DefaultDaemonSetup
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = DefaultDaemonMemoryMiB
	}
	if s.Concurrency == nil {
		s.Concurrency = DefaultDaemonConcurrency
	}
	if s.Samples == 0 {
		s.Samples = DefaultDaemonSamples
	}
	if s.RateWorkers == 0 {
		s.RateWorkers = DefaultDaemonRateWorkers
	}
	if s.Forks == nil {
		s.Forks = DefaultForks
	}
	if s.OpTimeout == 0 {
		s.OpTimeout = DefaultDaemonOpTimeout
	}
	switch {
	case s.Kilnd == "" || s.VMM == "":
		return s, fmt.Errorf("bench: daemon spec: kilnd %q and kiln-vmm %q binaries are both needed", s.Kilnd, s.VMM)
	case s.Image == "" || s.Images == "":
		return s, fmt.Errorf("bench: daemon spec: image %q and images folder %q are both needed", s.Image, s.Images)
	case len(s.Setup) == 0:
		return s, errors.New("bench: daemon spec: an empty setup argv (leave it nil for the default)")
	case s.MemoryMiB < 1 || s.Samples < 1 || s.Pool < 0 || s.RateFor < 0 || s.RateWorkers < 1 || s.Checkpoints < 0 || s.MaxMemoryMiB < 0 || s.OpTimeout < 0:
		return s, fmt.Errorf("bench: daemon spec: %d MiB, %d samples, pool %d, rate for %v with %d workers, %d checkpoints, max memory %d MiB, op timeout %v: want memory, samples and workers positive, the rest not negative",
			s.MemoryMiB, s.Samples, s.Pool, s.RateFor, s.RateWorkers, s.Checkpoints, s.MaxMemoryMiB, s.OpTimeout)
	}
	for _, c := range s.Concurrency {
		if c < 1 || c > 1024 {
			return s, fmt.Errorf("bench: daemon spec: concurrency %d: want 1 to 1024", c)
		}
	}
	for _, n := range s.Forks {
		if n < 1 || n > 256 {
			return s, fmt.Errorf("bench: daemon spec: fork of %d: want 1 to 256 (kilnd's most)", n)
		}
	}
	if s.MaxMemoryMiB == 0 {
		s.MaxMemoryMiB = s.neededMemoryMiB()
	}
	return s, nil
}

// neededMemoryMiB is guest memory enough for the largest phase: a burst,
// a fork's parent and children, or the rate loops and the pool, with a
// template's own boot beside.
func (s DaemonSpec) neededMemoryMiB() int {
	most := s.RateWorkers + s.Pool
	for _, c := range s.Concurrency {
		most = max(most, c)
	}
	for _, n := range s.Forks {
		most = max(most, n+1)
	}
	return (most + s.Pool + 2) * s.MemoryMiB
}

// Bursts is how many bursts of c creates make at least s.Samples.
func (s DaemonSpec) Bursts(c int) int {
	return max(1, (s.Samples+c-1)/c)
}

// daemonRunner is RunDaemon's state.
type daemonRunner struct {
	spec     DaemonSpec
	rep      *DaemonReport
	k        *Kilnd
	c        *client.Client
	dir      string
	start    time.Time
	progress io.Writer
	proc     sandbox.ProcessOptions
	roots    *image.Roots
	// key is kilnd's snapshot key, which its snapshots are authenticated
	// by; snapshots keeps the checked, sealed copies of their memory for
	// the next restore, as kilnd's backend does.
	key       []byte
	snapshots *snapshot.Cache
	mu        sync.Mutex // guards rep.Notes from the phases' goroutines
	// warnedPersisted is set once kilnd was seen persisting an in-memory
	// checkpoint.
	warnedPersisted bool
}

func (r *daemonRunner) logf(format string, args ...any) {
	fmt.Fprintf(r.progress, format+"\n", args...)
}

func (r *daemonRunner) note(format string, args ...any) {
	n := fmt.Sprintf(format, args...)
	r.mu.Lock()
	r.rep.Notes = append(r.rep.Notes, n)
	r.mu.Unlock()
	r.logf("note: %s", n)
}

// RunDaemon starts kilnd, makes a template of spec.Image and measures
// what spec says through kilnd and through the library path, printing
// each figure to progress (nil: nowhere) as it comes. A sample that fails
// is recorded in its set and the run goes on; failing to start kilnd or
// to make the template ends it, with what was measured so far.
func RunDaemon(ctx context.Context, spec DaemonSpec, progress io.Writer) (rep DaemonReport, err error) {
	if spec, err = spec.Normalize(); err != nil {
		return rep, err
	}
	if progress == nil {
		progress = io.Discard
	}
	begin := time.Now()
	rep.Spec, rep.Env, rep.LoadBefore = spec, DetectEnv(spec.KVMMode), LoadAverage()
	defer func() { rep.Took, rep.LoadAfter = time.Since(begin), LoadAverage() }()
	r := &daemonRunner{spec: spec, rep: &rep, progress: progress, start: begin,
		proc:  sandbox.ProcessOptions{Command: []string{spec.VMM}},
		roots: image.NewRoots(image.Options{Logger: spec.Logger}), snapshots: snapshot.NewCache(0)}
	if r.spec.Logger == nil {
		r.spec.Logger = slog.New(slog.DiscardHandler)
	}
	r.dir = spec.Dir
	if r.dir == "" {
		// Short: the sandboxes' Unix sockets live under it.
		if r.dir, err = os.MkdirTemp("", "kbd-"); err != nil {
			return rep, fmt.Errorf("bench: daemon: %w", err)
		}
		defer os.RemoveAll(r.dir)
	}
	cgRoot := spec.CgroupRoot
	if cgRoot == "" {
		root, cleanup, err := delegatedCgroup()
		if err != nil {
			return rep, err
		}
		defer cleanup() // after kilnd stops (deferred below)
		cgRoot = root
	}
	r.k, err = StartKilnd(ctx, KilndSpec{Binary: spec.Kilnd, VMM: spec.VMM, Kernel: spec.Kernel, Agent: spec.Agent,
		Images: spec.Images, Dir: filepath.Join(r.dir, "kilnd"), MaxMemoryMiB: spec.MaxMemoryMiB, CgroupRoot: cgRoot})
	if err != nil {
		return rep, err
	}
	r.c = r.k.Client
	defer func() {
		if serr := r.k.Stop(context.Background()); serr != nil {
			r.note("stopping kilnd: %v", serr)
		}
	}()
	r.logf("kilnd %s serves on %s (log %s)", spec.Kilnd, r.k.Spec.Socket(), r.k.Spec.LogFile())
	if err := r.makeSource(ctx); err != nil {
		return rep, fmt.Errorf("%w; kilnd log: %s", err, r.k.LogTail())
	}
	r.creates(ctx)
	if spec.Pool > 0 && ctx.Err() == nil {
		r.pool(ctx)
	}
	if spec.RateFor > 0 {
		for _, path := range r.paths() {
			if ctx.Err() != nil {
				break
			}
			rate := r.rate(ctx, path)
			rep.Rates = append(rep.Rates, rate)
			r.logf("%s: sustained for %v with %d workers: %d sandboxes, %d errors, %.2f/s; create to first exec p50 %s ms",
				path, rate.For, rate.Workers, rate.Completed, rate.Errors, rate.PerSecond(), msString(rate.Latency.P50))
		}
	}
	if len(spec.Forks) > 0 && ctx.Err() == nil {
		r.forks(ctx)
	}
	if spec.Checkpoints > 0 && ctx.Err() == nil {
		r.checkpoints(ctx)
	}
	if ctx.Err() != nil {
		return rep, fmt.Errorf("bench: daemon: %w", ctx.Err())
	}
	return rep, nil
}

// paths are the paths measured: kilnd, and the library unless left out.
func (r *daemonRunner) paths() []string {
	if r.spec.NoLibrary || r.rep.Snapshot == "" {
		return []string{PathKilnd}
	}
	return []string{PathKilnd, PathLibrary}
}

// makeSource makes what the creates start from: a template, or where
// kilnd refuses templates, a kept checkpoint of a sandbox set up alike.
func (r *daemonRunner) makeSource(ctx context.Context) error {
	res := &kilnpb.Resources{MemoryMib: uint32(r.spec.MemoryMiB)}
	start := time.Now()
	tp, err := r.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "bench", Image: r.spec.Image, Setup: r.spec.Setup, Resources: res})
	switch {
	case err == nil:
		r.rep.Source, r.rep.SourceID, r.rep.SourceCreate = "template", tp.GetId(), time.Since(start)
		r.setSnapshot(filepath.Join(r.k.Spec.StateDir(), "templates", tp.GetId()))
	case isCode(err, codes.Unimplemented):
		r.note("kilnd refuses templates (%v): the creates restore a kept checkpoint of a sandbox of the image set up the same way, and the pool is not measured", err)
		start = time.Now()
		sb, err := r.c.CreateSandbox(ctx, &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Image{Image: r.spec.Image}, Resources: res})
		if err != nil {
			return fmt.Errorf("bench: daemon: the template's sandbox: %w", err)
		}
		defer r.c.DestroySandbox(context.Background(), sb.GetId())
		if err := r.kilndExec(ctx, sb.GetId(), r.spec.Setup); err != nil {
			return fmt.Errorf("bench: daemon: setup %q: %w", r.spec.Setup, err)
		}
		ck, err := r.c.Checkpoint(ctx, sb.GetId(), client.CheckpointOptions{Persist: true, Keep: true})
		if err != nil {
			return fmt.Errorf("bench: daemon: the template's checkpoint: %w", err)
		}
		r.rep.Source, r.rep.SourceID, r.rep.SourceCreate = "checkpoint", ck.GetId(), time.Since(start)
		r.setSnapshot(filepath.Join(r.k.Spec.StateDir(), "checkpoints", ck.GetId()))
	default:
		return fmt.Errorf("bench: daemon: %w", err)
	}
	snap := r.rep.Snapshot
	if snap == "" {
		snap = "nothing"
	}
	r.logf("source: %s %s made in %v; the library path restores %s", r.rep.Source, r.rep.SourceID,
		r.rep.SourceCreate.Round(time.Millisecond), snap)
	return nil
}

// setSnapshot finds the snapshot in dir, or in one of its folders, for
// the library path; without one the library path is left out.
func (r *daemonRunner) setSnapshot(dir string) {
	if r.spec.NoLibrary {
		return
	}
	snap, err := FindSnapshot(dir)
	if err != nil {
		r.note("no library path: %v", err)
		return
	}
	// kilnd's snapshots are authenticated by its host key: the library
	// path restores them with it, as kilnd does.
	if r.key, err = kilndSnapshotKey(r.k.Spec.SnapshotKeyFile()); err != nil {
		r.note("no library path: %v", err)
		return
	}
	r.rep.Snapshot = snap
}

// FindSnapshot returns dir when it holds a snapshot (sandbox.Save's
// folder), else the one folder under it that does.
func FindSnapshot(dir string) (string, error) {
	if _, err := snapshot.Info(dir); err == nil {
		return dir, nil
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", fmt.Errorf("bench: snapshot: %w", err)
	}
	var found []string
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		p := filepath.Join(dir, e.Name())
		if _, err := snapshot.Info(p); err == nil {
			found = append(found, p)
		}
	}
	if len(found) != 1 {
		return "", fmt.Errorf("bench: snapshot: %s holds %d snapshots, in itself or a folder: want one", dir, len(found))
	}
	return found[0], nil
}

// createReq is a create from the source, or from template when set.
func (r *daemonRunner) createReq(template string) *kilnpb.CreateSandboxRequest {
	switch {
	case template != "":
		return &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Template{Template: template}}
	case r.rep.Source == "template":
		return &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Template{Template: r.rep.SourceID}}
	}
	return &kilnpb.CreateSandboxRequest{Source: &kilnpb.CreateSandboxRequest_Checkpoint{Checkpoint: r.rep.SourceID}}
}

// kilndExec runs argv in a kilnd sandbox and checks it exited 0.
func (r *daemonRunner) kilndExec(ctx context.Context, id string, argv []string) error {
	res, err := r.c.Exec(ctx, id, client.ExecOptions{Argv: argv})
	if err != nil {
		return err
	}
	if !res.Exited || res.ExitCode != 0 {
		return fmt.Errorf("exec %q in %s: exit %d, signal %d", argv, id, res.ExitCode, res.Signal)
	}
	return nil
}

// libExec runs true in a library sandbox and checks it exited 0.
func libExec(ctx context.Context, sb *sandbox.Sandbox) error {
	st, err := sb.Client().Exec(ctx, gclient.ExecOptions{Argv: []string{"true"}})
	if err != nil {
		return fmt.Errorf("exec true: %w", err)
	}
	if !st.Success() {
		return fmt.Errorf("exec true: %v", st)
	}
	return nil
}

// kilndCreate creates a sandbox through kilnd and times it to its first
// exec of true; the ID is set when the sandbox was created, failed or not.
func (r *daemonRunner) kilndCreate(ctx context.Context, template string) (string, DaemonSample) {
	ctx, cancel := context.WithTimeout(ctx, r.spec.OpTimeout)
	defer cancel()
	s := DaemonSample{At: time.Since(r.start)}
	start := time.Now()
	sb, err := r.c.CreateSandbox(ctx, r.createReq(template))
	if err != nil {
		s.Err = err.Error()
		return "", s
	}
	s.Call, s.ReadyMS, s.FromPool = time.Since(start), sb.GetReadyMs(), sb.GetFromPool()
	if err := r.kilndExec(ctx, sb.GetId(), []string{"true"}); err != nil {
		s.Err = err.Error()
		return sb.GetId(), s
	}
	s.Total = time.Since(start)
	return sb.GetId(), s
}

// restoreOptions restore the template's snapshot as kilnd would.
func (r *daemonRunner) restoreOptions() sandbox.RestoreOptions {
	proc := r.proc
	return sandbox.RestoreOptions{Process: &proc, Images: r.spec.Images, ImageRoots: r.roots,
		Timeout: r.spec.OpTimeout, Logger: r.spec.Logger, SnapshotKey: r.key, SnapshotCache: r.snapshots}
}

// libCreate restores the template's snapshot in a VMM process and times
// it to its first exec of true; the sandbox is set when it was restored.
func (r *daemonRunner) libCreate(ctx context.Context, snap string) (*sandbox.Sandbox, DaemonSample) {
	ctx, cancel := context.WithTimeout(ctx, r.spec.OpTimeout)
	defer cancel()
	s := DaemonSample{At: time.Since(r.start)}
	start := time.Now()
	sb, err := sandbox.Restore(ctx, snap, r.restoreOptions())
	if err != nil {
		s.Err = err.Error()
		return nil, s
	}
	s.Call = time.Since(start)
	if err := libExec(ctx, sb); err != nil {
		s.Err = err.Error()
		return sb, s
	}
	s.Total = time.Since(start)
	return sb, s
}

// destroy destroys kilnd sandboxes concurrently, timing each.
func (r *daemonRunner) destroy(ids []string) []DaemonSample {
	out := make([]DaemonSample, len(ids))
	var wg sync.WaitGroup
	for i, id := range ids {
		if id == "" {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), r.spec.OpTimeout)
			defer cancel()
			out[i].At = time.Since(r.start)
			start := time.Now()
			if err := r.c.DestroySandbox(ctx, id); err != nil {
				out[i].Err = err.Error()
				return
			}
			out[i].Total = time.Since(start)
		}()
	}
	wg.Wait()
	return out
}

// closeLib closes library sandboxes concurrently, timing each.
func (r *daemonRunner) closeLib(sbs []*sandbox.Sandbox) []DaemonSample {
	out := make([]DaemonSample, len(sbs))
	var wg sync.WaitGroup
	for i, sb := range sbs {
		if sb == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), r.spec.OpTimeout)
			defer cancel()
			out[i].At = time.Since(r.start)
			start := time.Now()
			if err := sb.Close(ctx); err != nil {
				out[i].Err = err.Error()
				return
			}
			out[i].Total = time.Since(start)
		}()
	}
	wg.Wait()
	return out
}

// burst creates c sandboxes at once on path, times each to its first
// exec, then destroys them all; the destroys' times come back too.
func (r *daemonRunner) burst(ctx context.Context, path string, c int) (creates, destroys []DaemonSample) {
	creates = make([]DaemonSample, c)
	ids := make([]string, c)
	sbs := make([]*sandbox.Sandbox, c)
	var wg sync.WaitGroup
	for i := range c {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if path == PathKilnd {
				ids[i], creates[i] = r.kilndCreate(ctx, "")
			} else {
				sbs[i], creates[i] = r.libCreate(ctx, r.rep.Snapshot)
			}
		}()
	}
	wg.Wait()
	if path == PathKilnd {
		return creates, r.destroy(ids)
	}
	return creates, r.closeLib(sbs)
}

// creates times the create bursts at each concurrency, kilnd's and the
// library's alternating.
func (r *daemonRunner) creates(ctx context.Context) {
	destroys := map[string]*DaemonSet{}
	for _, c := range r.spec.Concurrency {
		sets := map[string]*DaemonSet{}
		for _, path := range r.paths() {
			sets[path] = &DaemonSet{Op: OpCreate, Path: path, Concurrency: c}
		}
		for b := range r.spec.Bursts(c) {
			for _, path := range r.paths() {
				if ctx.Err() != nil {
					break
				}
				cr, ds := r.burst(ctx, path, c)
				sets[path].Samples = append(sets[path].Samples, cr...)
				st := DaemonSet{Samples: cr}.Stats()
				r.logf("%s: burst %d of %d creates: p50 %s ms, max %s ms, %d errors", path, b+1, c, msString(st.P50), msString(st.Max), st.Errors)
				if c == 1 {
					if destroys[path] == nil {
						destroys[path] = &DaemonSet{Op: OpDestroy, Path: path, Concurrency: 1}
					}
					destroys[path].Samples = append(destroys[path].Samples, ds...)
				}
			}
		}
		for _, path := range r.paths() {
			r.rep.Sets = append(r.rep.Sets, *sets[path])
		}
	}
	for _, path := range r.paths() {
		if d := destroys[path]; d != nil {
			r.rep.Sets = append(r.rep.Sets, *d)
		}
	}
}

// pool makes a template with a warm pool and times creates from it, each
// once the pool is full again.
func (r *daemonRunner) pool(ctx context.Context) {
	if r.rep.Source != "template" {
		r.note("pool not measured: kilnd has no templates")
		return
	}
	start := time.Now()
	tp, err := r.c.CreateTemplate(ctx, &kilnpb.CreateTemplateRequest{Name: "bench-pool", Image: r.spec.Image, Setup: r.spec.Setup,
		Resources: &kilnpb.Resources{MemoryMib: uint32(r.spec.MemoryMiB)}, PoolSize: uint32(r.spec.Pool)})
	if err != nil {
		r.note("pool not measured: %v", err)
		return
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.Background(), r.spec.OpTimeout)
		defer cancel()
		if err := r.c.DeleteTemplate(dctx, tp.GetId(), true); err != nil {
			r.note("deleting the pool's template: %v", err)
		}
	}()
	if err := r.waitPool(ctx, tp.GetId()); err != nil {
		r.note("the pool of %d was not full %v after its template was asked for: %v", r.spec.Pool, time.Since(start).Round(time.Second), err)
	} else {
		r.logf("pool: template %s with %d ready after %v", tp.GetId(), r.spec.Pool, time.Since(start).Round(time.Millisecond))
	}
	set := DaemonSet{Op: OpCreatePool, Path: PathKilnd, Concurrency: 1}
	for i := range r.spec.Samples {
		if i > 0 {
			if err := r.waitPool(ctx, tp.GetId()); err != nil {
				r.note("the pool did not refill before create %d: %v", i+1, err)
			}
		}
		if ctx.Err() != nil {
			break
		}
		id, s := r.kilndCreate(ctx, tp.GetId())
		set.Samples = append(set.Samples, s)
		r.destroy([]string{id})
	}
	st := set.Stats()
	r.logf("pool: %d creates, p50 %s ms, %d errors", st.N, msString(st.P50), st.Errors)
	r.rep.Sets = append(r.rep.Sets, set)
}

// waitPool waits until the template's pool is full, for OpTimeout.
func (r *daemonRunner) waitPool(ctx context.Context, id string) error {
	ctx, cancel := context.WithTimeout(ctx, r.spec.OpTimeout)
	defer cancel()
	for {
		tp, err := r.c.GetTemplate(ctx, id)
		if err != nil {
			return err
		}
		if tp.GetPoolReady() >= tp.GetPoolSize() {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%d of %d ready: %w", tp.GetPoolReady(), tp.GetPoolSize(), ctx.Err())
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// rate runs RateWorkers loops of create, first exec and destroy on path
// for RateFor.
func (r *daemonRunner) rate(ctx context.Context, path string) DaemonRate {
	res := DaemonRate{Path: path, Workers: r.spec.RateWorkers, For: r.spec.RateFor}
	start := time.Now()
	deadline := start.Add(r.spec.RateFor)
	var mu sync.Mutex
	var lat []time.Duration
	var wg sync.WaitGroup
	for range r.spec.RateWorkers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(deadline) && ctx.Err() == nil {
				var s DaemonSample
				if path == PathKilnd {
					var id string
					id, s = r.kilndCreate(ctx, "")
					if d := r.destroy([]string{id}); id != "" && d[0].Err != "" && s.Err == "" {
						s.Err = d[0].Err
					}
				} else {
					var sb *sandbox.Sandbox
					sb, s = r.libCreate(ctx, r.rep.Snapshot)
					if d := r.closeLib([]*sandbox.Sandbox{sb}); sb != nil && d[0].Err != "" && s.Err == "" {
						s.Err = d[0].Err
					}
				}
				mu.Lock()
				if s.Err != "" {
					res.Errors++
					if res.FirstErr == "" {
						res.FirstErr = s.Err
					}
				} else {
					res.Completed++
					lat = append(lat, s.Total)
				}
				mu.Unlock()
				if s.Err != "" {
					// A failing daemon answers at once: no busy loop.
					select {
					case <-ctx.Done():
					case <-time.After(100 * time.Millisecond):
					}
				}
			}
		}()
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	res.Latency = SummarizeLatencies(lat, res.Errors)
	return res
}

// forks times a fork of each size through kilnd and through the library,
// alternating, each path from one running parent.
func (r *daemonRunner) forks(ctx context.Context) {
	var kParent string
	var lParent *sandbox.Sandbox
	paths := r.paths()
	if id, s := r.kilndCreate(ctx, ""); s.Err != "" {
		r.note("kilnd forks not measured: the parent: %s", s.Err)
		r.destroy([]string{id})
		paths = slices.DeleteFunc(slices.Clone(paths), func(p string) bool { return p == PathKilnd })
	} else {
		kParent = id
		defer r.destroy([]string{id})
	}
	if slices.Contains(paths, PathLibrary) {
		if sb, s := r.libCreate(ctx, r.rep.Snapshot); s.Err != "" {
			r.note("library forks not measured: the parent: %s", s.Err)
			r.closeLib([]*sandbox.Sandbox{sb})
			paths = slices.DeleteFunc(paths, func(p string) bool { return p == PathLibrary })
		} else {
			lParent = sb
			defer r.closeLib([]*sandbox.Sandbox{sb})
		}
	}
	for _, n := range r.spec.Forks {
		for _, path := range paths {
			if ctx.Err() != nil {
				return
			}
			var f DaemonFork
			if path == PathKilnd {
				f = r.kilndFork(ctx, kParent, n)
			} else {
				f = r.libFork(ctx, lParent, n)
			}
			r.rep.Forks = append(r.rep.Forks, f)
			if f.Err != "" {
				r.logf("%s: fork of %d failed: %s", path, n, f.Err)
			} else {
				r.logf("%s: fork of %d: all ready after %s ms, all first execs after %s ms", path, n, msString(f.Ready), msString(f.AllExec))
			}
		}
	}
}

// kilndFork forks parent into n children through kilnd and times them to
// their first execs, then destroys them.
func (r *daemonRunner) kilndFork(ctx context.Context, parent string, n int) DaemonFork {
	f := DaemonFork{Path: PathKilnd, N: n}
	ctx, cancel := context.WithTimeout(ctx, r.spec.OpTimeout)
	defer cancel()
	var kids []string
	defer func() { r.destroy(kids) }()
	start := time.Now()
	for sb, err := range r.c.Fork(ctx, &kilnpb.ForkRequest{Source: &kilnpb.ForkRequest_SandboxId{SandboxId: parent}, Count: uint32(n)}) {
		if err != nil {
			f.Err = err.Error()
			return f
		}
		kids = append(kids, sb.GetId())
	}
	f.Ready = time.Since(start)
	if len(kids) != n {
		f.Err = fmt.Sprintf("the fork stream gave %d children of %d", len(kids), n)
		return f
	}
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, id := range kids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = r.kilndExec(ctx, id, []string{"true"})
		}()
	}
	wg.Wait()
	f.AllExec = time.Since(start)
	if err := errors.Join(errs...); err != nil {
		f.Err = err.Error()
	}
	return f
}

// libFork is kilndFork through Sandbox.Fork.
func (r *daemonRunner) libFork(ctx context.Context, parent *sandbox.Sandbox, n int) DaemonFork {
	f := DaemonFork{Path: PathLibrary, N: n}
	ctx, cancel := context.WithTimeout(ctx, r.spec.OpTimeout)
	defer cancel()
	start := time.Now()
	kids, err := parent.Fork(ctx, n, sandbox.ForkOptions{})
	if err != nil {
		f.Err = err.Error()
		return f
	}
	defer r.closeLib(kids)
	f.Ready = time.Since(start)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, k := range kids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = libExec(ctx, k)
		}()
	}
	wg.Wait()
	f.AllExec = time.Since(start)
	if err := errors.Join(errs...); err != nil {
		f.Err = err.Error()
	}
	return f
}

// checkpoints times checkpoints and rollbacks through kilnd, in memory
// and persisted, and the library's save and restore for comparison.
func (r *daemonRunner) checkpoints(ctx context.Context) {
	r.kilndCheckpoints(ctx)
	if slices.Contains(r.paths(), PathLibrary) && ctx.Err() == nil {
		r.libCheckpoints(ctx)
	}
}

func (r *daemonRunner) kilndCheckpoints(ctx context.Context) {
	id, s := r.kilndCreate(ctx, "")
	defer r.destroy([]string{id})
	if s.Err != "" {
		r.note("kilnd checkpoints not measured: the sandbox: %s", s.Err)
		return
	}
	sets := map[bool][2]*DaemonSet{
		false: {{Op: OpCheckpoint, Path: PathKilnd, Concurrency: 1}, {Op: OpRollback, Path: PathKilnd, Concurrency: 1}},
		true:  {{Op: OpCheckpointPersist, Path: PathKilnd, Concurrency: 1}, {Op: OpRollbackPersist, Path: PathKilnd, Concurrency: 1}},
	}
	for i := range r.spec.Checkpoints {
		// Each kind goes first every other time: a rollback's cost moves
		// with what came before it.
		order := []bool{false, true}
		if i%2 == 1 {
			order = []bool{true, false}
		}
		for _, persist := range order {
			if ctx.Err() != nil {
				break
			}
			ck, rb := r.kilndCheckpoint(ctx, id, persist)
			sets[persist][0].Samples = append(sets[persist][0].Samples, ck)
			sets[persist][1].Samples = append(sets[persist][1].Samples, rb)
		}
	}
	for _, persist := range []bool{false, true} {
		for _, s := range sets[persist] {
			st := s.Stats()
			r.logf("kilnd: %s: p50 %s ms over %d, %d errors", s.Op, msString(st.P50), st.N, st.Errors)
			r.rep.Sets = append(r.rep.Sets, *s)
		}
	}
}

// kilndCheckpoint times one checkpoint of sandbox id, and a rollback to
// it (after which the sandbox answers a first exec).
func (r *daemonRunner) kilndCheckpoint(ctx context.Context, id string, persist bool) (ck, rb DaemonSample) {
	ctx, cancel := context.WithTimeout(ctx, r.spec.OpTimeout)
	defer cancel()
	ck.At = time.Since(r.start)
	start := time.Now()
	info, err := r.c.Checkpoint(ctx, id, client.CheckpointOptions{Persist: persist})
	if err != nil {
		ck.Err, rb.Err = err.Error(), "no checkpoint to roll back to"
		return ck, rb
	}
	ck.Total = time.Since(start)
	if !persist && info.GetPersisted() && !r.warnedPersisted {
		r.warnedPersisted = true
		r.note("kilnd persisted a checkpoint asked for in memory (%s): its in-memory checkpoints are not built yet, so %q times a persisted one", info.GetId(), OpCheckpoint)
	}
	rb.At = time.Since(r.start)
	start = time.Now()
	if _, err := r.c.Rollback(ctx, id, info.GetId()); err != nil {
		rb.Err = err.Error()
		return ck, rb
	}
	rb.Call = time.Since(start)
	if err := r.kilndExec(ctx, id, []string{"true"}); err != nil {
		rb.Err = err.Error()
		return ck, rb
	}
	rb.Total = time.Since(start)
	return ck, rb
}

// libCheckpoints times Sandbox.Save of a restored sandbox and, as the
// rollback's counterpart, closing it and restoring the save to its first
// exec.
func (r *daemonRunner) libCheckpoints(ctx context.Context) {
	sb, s := r.libCreate(ctx, r.rep.Snapshot)
	if s.Err != "" {
		r.note("library checkpoints not measured: the sandbox: %s", s.Err)
		r.closeLib([]*sandbox.Sandbox{sb})
		return
	}
	save := DaemonSet{Op: OpCheckpointPersist, Path: PathLibrary, Concurrency: 1}
	restore := DaemonSet{Op: OpRollbackPersist, Path: PathLibrary, Concurrency: 1}
	var prev string
	for i := range r.spec.Checkpoints {
		if ctx.Err() != nil {
			break
		}
		dir := filepath.Join(r.dir, fmt.Sprintf("lib-ck-%d", i))
		cctx, cancel := context.WithTimeout(ctx, r.spec.OpTimeout)
		c := DaemonSample{At: time.Since(r.start)}
		start := time.Now()
		err := sb.Save(cctx, dir)
		cancel()
		if err != nil {
			c.Err = err.Error()
			save.Samples = append(save.Samples, c)
			os.RemoveAll(dir)
			break
		}
		c.Total = time.Since(start)
		save.Samples = append(save.Samples, c)
		rb := DaemonSample{At: time.Since(r.start)}
		d := r.closeLib([]*sandbox.Sandbox{sb})
		if d[0].Err != "" {
			r.note("library: closing a sandbox before its restore: %s", d[0].Err)
		}
		sb, s = r.libCreate(ctx, dir)
		if s.Err != "" {
			rb.Err = s.Err
			restore.Samples = append(restore.Samples, rb)
			break
		}
		rb.Call, rb.Total = d[0].Total+s.Call, d[0].Total+s.Total
		restore.Samples = append(restore.Samples, rb)
		// The save before the one restored is no sandbox's now.
		if prev != "" {
			os.RemoveAll(prev)
		}
		prev = dir
	}
	r.closeLib([]*sandbox.Sandbox{sb})
	if prev != "" {
		os.RemoveAll(prev)
	}
	for _, s := range []DaemonSet{save, restore} {
		st := s.Stats()
		r.logf("library: %s: p50 %s ms over %d, %d errors", s.Op, msString(st.P50), st.N, st.Errors)
		r.rep.Sets = append(r.rep.Sets, s)
	}
}
