package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/procfs"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/snapshot"
)

// The snapshot benchmarks, all on Kiln sandboxes in this one process:
// sandbox.Save time against memory size, sandbox.Restore to the first
// exec's result beside a cold boot to the first exec's result, Sandbox.Fork
// of N children to every child's first exec, and the guest memory (PSS)
// each forked child costs beside one standalone VM.

// Defaults of SnapshotSpec.
var (
	// DefaultSaveSizesMiB are the memory sizes whose save is timed.
	DefaultSaveSizesMiB = []int{256, 512, 1024}
	// DefaultForks are the fork sizes timed.
	DefaultForks = []int{1, 8, 32}
)

const (
	// DefaultSnapshotMemoryMiB sizes the sandbox that is restored, forked
	// and measured for PSS (sandbox.Start's default).
	DefaultSnapshotMemoryMiB = 512
	// DefaultRestores is how many restores are timed.
	DefaultRestores = 5
	// DefaultPSSFork is the fork whose children's memory is measured.
	DefaultPSSFork = 8
	// snapExecTimeout bounds one exec of true.
	snapExecTimeout = 2 * time.Minute
)

// SnapshotSpec says what RunSnapshot measures.
type SnapshotSpec struct {
	// Kernel is the kernel image; empty means the cached Debian kernel
	// (sandbox.Options.Kernel).
	Kernel string
	// Agent is the static kiln-agent; empty means sandbox.FindAgent.
	Agent string
	// CPUs is every sandbox's vCPUs (1 when zero).
	CPUs int
	// SaveSizesMiB are the memory sizes to boot a sandbox at and time its
	// save (DefaultSaveSizesMiB when nil).
	SaveSizesMiB []int
	// MemoryMiB sizes the sandbox that is restored, forked and measured
	// (DefaultSnapshotMemoryMiB when zero); booted once, also when it is
	// one of SaveSizesMiB. Its cold start is the ratio's denominator.
	MemoryMiB int
	// ColdBoots is how many cold boots at MemoryMiB are timed for the
	// ratio's denominator, the measured sandbox's own included (1 when
	// zero).
	ColdBoots int
	// Restores is how many restores are timed (DefaultRestores when zero).
	Restores int
	// Forks are the fork sizes timed, in order, all from one running
	// sandbox (DefaultForks when nil; empty after Normalize only if set so).
	Forks []int
	// PSSFork is the fork whose children's memory is read
	// (DefaultPSSFork when zero; forked on its own when not in Forks).
	PSSFork int
	// Dir is where the snapshots go; empty means a new temporary
	// directory, removed afterwards. The memory files are sparse.
	Dir string
	// BootTimeout bounds each cold boot's wait for the agent (5 minutes
	// when zero).
	BootTimeout time.Duration
	// QEMU, when set, is the peer VMM binary: QEMU microvm boots the same
	// kernel, agent initramfs and command line with a vhost-vsock device,
	// is saved with `migrate` to a file and restored with `-incoming`,
	// alternating with Kiln's restores.
	QEMU string
	// Logger is the sandboxes'; slog.Default() when nil.
	Logger *slog.Logger
}

// Normalize fills in the defaults and checks the spec.
func (s SnapshotSpec) Normalize() (SnapshotSpec, error) {
	if s.CPUs == 0 {
		s.CPUs = 1
	}
	if s.SaveSizesMiB == nil {
		s.SaveSizesMiB = DefaultSaveSizesMiB
	}
	if s.MemoryMiB == 0 {
		s.MemoryMiB = DefaultSnapshotMemoryMiB
	}
	if s.ColdBoots == 0 {
		s.ColdBoots = 1
	}
	if s.Restores == 0 {
		s.Restores = DefaultRestores
	}
	if s.Forks == nil {
		s.Forks = DefaultForks
	}
	if s.PSSFork == 0 {
		s.PSSFork = DefaultPSSFork
	}
	if s.BootTimeout <= 0 {
		s.BootTimeout = 5 * time.Minute
	}
	if s.CPUs < 0 || s.MemoryMiB < 0 || s.ColdBoots < 0 || s.Restores < 0 || s.PSSFork < 0 {
		return s, fmt.Errorf("bench: snapshot spec: negative value (%d vCPUs, %d MiB, %d cold boots, %d restores, PSS fork %d)",
			s.CPUs, s.MemoryMiB, s.ColdBoots, s.Restores, s.PSSFork)
	}
	for _, m := range s.SaveSizesMiB {
		if m < 1 {
			return s, fmt.Errorf("bench: snapshot spec: memory size %d MiB", m)
		}
	}
	for _, n := range append(slices.Clone(s.Forks), s.PSSFork) {
		if n < 1 || n > 1024 {
			return s, fmt.Errorf("bench: snapshot spec: fork of %d: want 1 to 1024", n)
		}
	}
	return s, nil
}

// LoadAverage returns the host's 1, 5 and 15 minute load averages as
// "1.00 2.00 3.00", or "?".
func LoadAverage() string {
	fs, err := procfs.NewDefaultFS()
	if err != nil {
		return "?"
	}
	l, err := fs.LoadAvg()
	if err != nil {
		return "?"
	}
	return fmt.Sprintf("%.2f %.2f %.2f", l.Load1, l.Load5, l.Load15)
}

// allocated returns a file's logical size and the bytes allocated to it.
func allocated(path string) (size, alloc int64, err error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, 0, fmt.Errorf("bench: stat %s: %w", path, err)
	}
	return st.Size, st.Blocks * 512, nil
}

// fdAllocated is allocated for an open descriptor (a memfd).
func fdAllocated(fd int) (size, alloc int64, err error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return 0, 0, fmt.Errorf("bench: fstat: %w", err)
	}
	return st.Size, st.Blocks * 512, nil
}

// SaveResult is one memory size's cold boot and save.
type SaveResult struct {
	MemoryMiB int
	// ColdStart is sandbox.Start to the first exec of true's result.
	ColdStart time.Duration
	// Guest is the sandbox's guest memory before the save.
	Guest MemUsage
	// Save is Sandbox.Save (quiesce, pause, write, sync, resume).
	Save time.Duration
	// FileSize is the memory file's logical size (the guest's RAM);
	// FileAllocated what it takes on disk (pages of zeros are holes).
	FileSize, FileAllocated int64
}

// ForkResult is one Sandbox.Fork of N children.
type ForkResult struct {
	N int
	// Copied says the parent's memory was already copy-on-write (it was
	// forked before), so Fork first copied it into a new base; the first
	// fork of a booted sandbox copies nothing.
	Copied bool
	// Fork is Sandbox.Fork: pause, freeze, N VMs, every child's agent
	// answering with fresh entropy, clock and host name.
	Fork time.Duration
	// AllExec is the same start to the last child's first exec result.
	AllExec time.Duration
	// Err is why the fork failed ("" when it did not).
	Err string
}

// PSSResult is the guest memory of a fork's children beside a standalone VM.
type PSSResult struct {
	N int
	// Standalone is the parent's guest memory while it was a standalone
	// booted VM (before any fork), Parent its memory after this fork.
	Standalone, Parent MemUsage
	// Children are each child's guest memory once it answered an exec.
	Children []MemUsage
	// BaseSize and BaseAllocated describe the frozen base file every
	// child maps; its pages that no VM has touched since the fork are in
	// no one's PSS.
	BaseSize, BaseAllocated int64
	// ProcessBefore and ProcessAfter are the whole process's smaps_rollup
	// before the fork and after every child answered.
	ProcessBefore, ProcessAfter procfs.ProcSMapsRollup
}

// ChildPSS is the children's mean guest-memory PSS.
func (p PSSResult) ChildPSS() uint64 {
	if len(p.Children) == 0 {
		return 0
	}
	var sum MemUsage
	for _, c := range p.Children {
		sum = sum.Add(c)
	}
	return sum.Pss / uint64(len(p.Children))
}

// ChildAnonymous is the children's mean private (written) guest memory.
func (p PSSResult) ChildAnonymous() uint64 {
	if len(p.Children) == 0 {
		return 0
	}
	var sum MemUsage
	for _, c := range p.Children {
		sum = sum.Add(c)
	}
	return sum.Anonymous / uint64(len(p.Children))
}

// GuestTotal is all the guest memory the parent and its children hold
// after the fork: the base file once, and each VM's own copies.
func (p PSSResult) GuestTotal() uint64 {
	t := uint64(max(p.BaseAllocated, 0)) + p.Parent.Anonymous
	for _, c := range p.Children {
		t += c.Anonymous
	}
	return t
}

// GuestPerVM is GuestTotal shared out over the parent and its children:
// what each of N+1 VMs costs, against Standalone.Rss for a booted VM.
func (p PSSResult) GuestPerVM() uint64 {
	return p.GuestTotal() / uint64(len(p.Children)+1)
}

// RestoreResult is one restore.
type RestoreResult struct {
	// Exec is sandbox.Restore (load, agent answering, reseed, clock) to
	// the first exec of true's result.
	Exec time.Duration
	// Guest is the restored VM's guest memory after the exec.
	Guest MemUsage
	// Phases are where sandbox.Restore's time went (Sandbox.Phases),
	// and FirstExec the exec of true after it.
	Phases    []sandbox.Phase
	FirstExec time.Duration
}

// RestorePhaseMedians are the median of each phase over restores, in the order
// of the first one's phases, then the first exec's ("exec").
func RestorePhaseMedians(restores []RestoreResult) []sandbox.Phase {
	if len(restores) == 0 {
		return nil
	}
	var out []sandbox.Phase
	for _, p := range restores[0].Phases {
		var ds []time.Duration
		for _, r := range restores {
			for _, q := range r.Phases {
				if q.Name == p.Name {
					ds = append(ds, q.Took)
				}
			}
		}
		out = append(out, sandbox.Phase{Name: p.Name, Took: Median(ds)})
	}
	execs := make([]time.Duration, len(restores))
	for i, r := range restores {
		execs[i] = r.FirstExec
	}
	return append(out, sandbox.Phase{Name: "exec", Took: Median(execs)})
}

// restorePhases prints phases as "name 12ms, ...".
func restorePhases(phases []sandbox.Phase) string {
	parts := make([]string, len(phases))
	for i, p := range phases {
		parts[i] = fmt.Sprintf("%s %v", p.Name, p.Took.Round(time.Millisecond))
	}
	return strings.Join(parts, ", ")
}

// SnapshotReport is what RunSnapshot measured.
type SnapshotReport struct {
	Spec SnapshotSpec
	// Saves are per memory size, in SaveSizesMiB's order.
	Saves []SaveResult
	// Base is the cold boot and save of the sandbox at Spec.MemoryMiB.
	Base SaveResult
	// ColdStarts are the cold boots to first exec at Spec.MemoryMiB:
	// Spec.ColdBoots-1 alone, then Base's.
	ColdStarts []time.Duration
	// Restores each check the snapshot in full (its manifest, state and
	// every page of its memory file, copied into a sealed memfd), as a
	// process's first restore of a snapshot does.
	Restores []RestoreResult
	// CachedRestores are repeat restores in one process
	// (RestoreOptions.SnapshotCache, kilnd's case): the sealed copy made
	// by the first is mapped copy-on-write again, without reading the
	// memory file. No peer figure: QEMU reads its stream every time.
	CachedRestores []RestoreResult
	Forks          []ForkResult
	PSS            *PSSResult
	// Peer is QEMU microvm's save and restore (nil without Spec.QEMU).
	Peer *PeerSnapshot
}

// PeerSnapshot is QEMU microvm's save (migrate to a file) and restore
// (-incoming from it) of the same guest.
type PeerSnapshot struct {
	// ColdStart is process start to the first exec of true's result.
	ColdStart time.Duration
	// Save is `migrate` of the running guest to "exec:cat > file", to
	// its completion.
	Save time.Duration
	// FileSize and FileAllocated describe the migration stream's file.
	FileSize, FileAllocated int64
	// Restores are process start (with -incoming) to the first exec of
	// true's result.
	Restores []time.Duration
	// Running are process start to the guest running (QMP's RESUME:
	// the migration stream loaded), per restore; 0 where QMP did not say.
	Running []time.Duration
	// Err is why the peer's measurements stopped ("" when they did not).
	Err string
}

// RestoreRatio is the median restore over the cold start.
func (p PeerSnapshot) RestoreRatio() float64 {
	if p.ColdStart <= 0 {
		return 0
	}
	return float64(Median(p.Restores)) / float64(p.ColdStart)
}

// RestoreMedian is the median restore to first exec.
func (r SnapshotReport) RestoreMedian() time.Duration { return Median(Execs(r.Restores)) }

// CachedRestoreMedian is the median cached restore to first exec.
func (r SnapshotReport) CachedRestoreMedian() time.Duration { return Median(Execs(r.CachedRestores)) }

// Execs returns each restore's Exec.
func Execs(rs []RestoreResult) []time.Duration {
	ds := make([]time.Duration, len(rs))
	for i, x := range rs {
		ds[i] = x.Exec
	}
	return ds
}

// ColdStart is the median cold boot to first exec at Spec.MemoryMiB.
func (r SnapshotReport) ColdStart() time.Duration {
	if len(r.ColdStarts) == 0 {
		return r.Base.ColdStart
	}
	return Median(r.ColdStarts)
}

// RestoreRatio is the median restore to first exec over the median cold
// boot to first exec at the same memory size (below 1: restore is faster).
func (r SnapshotReport) RestoreRatio() float64 {
	c := r.ColdStart()
	if c <= 0 {
		return 0
	}
	return float64(r.RestoreMedian()) / float64(c)
}

// snapExecTrue runs true in the sandbox and checks that it succeeded.
func snapExecTrue(ctx context.Context, sb *sandbox.Sandbox) error {
	ctx, cancel := context.WithTimeout(ctx, snapExecTimeout)
	defer cancel()
	st, err := sb.Client().Exec(ctx, client.ExecOptions{Argv: []string{"true"}})
	if err != nil {
		return fmt.Errorf("exec true: %w", err)
	}
	if !st.Success() {
		return fmt.Errorf("exec true: %v", st)
	}
	return nil
}

// closeAll closes sandboxes concurrently.
func closeAll(sbs []*sandbox.Sandbox) error {
	errs := make([]error, len(sbs))
	var wg sync.WaitGroup
	for i, sb := range sbs {
		if sb == nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			errs[i] = sb.Close(ctx)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// snapRunner holds what every measurement shares.
type snapRunner struct {
	spec     SnapshotSpec
	runtime  sandbox.Runtime
	dir      string
	progress io.Writer
}

func (r *snapRunner) logf(format string, args ...any) {
	if r.progress != nil {
		fmt.Fprintf(r.progress, format+"\n", args...)
	}
}

// boot cold-starts a sandbox of memMiB and times it to the first exec.
func (r *snapRunner) boot(ctx context.Context, memMiB int) (*sandbox.Sandbox, time.Duration, error) {
	start := time.Now()
	sb, err := sandbox.Start(ctx, sandbox.Options{
		Runtime: r.runtime,
		CPUs:    r.spec.CPUs, MemoryMiB: memMiB, BootTimeout: r.spec.BootTimeout, Logger: r.spec.Logger,
	})
	if err != nil {
		return nil, 0, fmt.Errorf("cold boot of %d MiB: %w", memMiB, err)
	}
	if err := snapExecTrue(ctx, sb); err != nil {
		sb.Close(context.Background())
		return nil, 0, fmt.Errorf("cold boot of %d MiB: first %w", memMiB, err)
	}
	return sb, time.Since(start), nil
}

// bootAndSave cold-starts a sandbox, reads its guest memory and times its
// save into dir.
func (r *snapRunner) bootAndSave(ctx context.Context, memMiB int, dir string) (*sandbox.Sandbox, SaveResult, error) {
	res := SaveResult{MemoryMiB: memMiB}
	sb, cold, err := r.boot(ctx, memMiB)
	if err != nil {
		return nil, res, err
	}
	res.ColdStart = cold
	if res.Guest, err = GuestUsage(sb); err != nil {
		sb.Close(context.Background())
		return nil, res, err
	}
	start := time.Now()
	if err := sb.Save(ctx, dir); err != nil {
		sb.Close(context.Background())
		return nil, res, fmt.Errorf("save of %d MiB: %w", memMiB, err)
	}
	res.Save = time.Since(start)
	if res.FileSize, res.FileAllocated, err = allocated(filepath.Join(dir, snapshot.MemoryFile)); err != nil {
		sb.Close(context.Background())
		return nil, res, err
	}
	r.logf("%d MiB: cold boot to first exec %v; guest memory %v; save %v, memory file %.1f MiB allocated of %.0f MiB",
		memMiB, cold.Round(time.Millisecond), res.Guest, res.Save.Round(time.Millisecond),
		MiB(uint64(res.FileAllocated)), MiB(uint64(res.FileSize)))
	return sb, res, nil
}

// restore times one restore to its first exec; cache, when set, is the
// sealed memory copies kept between restores.
func (r *snapRunner) restore(ctx context.Context, dir string, cache *snapshot.Cache) (RestoreResult, error) {
	var res RestoreResult
	start := time.Now()
	sb, err := sandbox.Restore(ctx, dir, sandbox.RestoreOptions{Timeout: r.spec.BootTimeout, Logger: r.spec.Logger, SnapshotCache: cache})
	if err != nil {
		return res, fmt.Errorf("restore: %w", err)
	}
	defer sb.Close(context.Background())
	res.Phases = sb.Phases()
	restored := time.Now()
	if err := snapExecTrue(ctx, sb); err != nil {
		return res, fmt.Errorf("restore: first %w", err)
	}
	res.FirstExec = time.Since(restored)
	res.Exec = time.Since(start)
	if res.Guest, err = GuestUsage(sb); err != nil {
		return res, err
	}
	if err := sb.Close(ctx); err != nil {
		return res, fmt.Errorf("restore: %w", err)
	}
	return res, nil
}

// fork forks parent into n children and times every child's first exec;
// with pss set it also reads the memory figures before closing them.
func (r *snapRunner) fork(ctx context.Context, parent *sandbox.Sandbox, n int, pss *PSSResult) (ForkResult, error) {
	res := ForkResult{N: n, Copied: parent.VM().Memory().Private()}
	if pss != nil {
		var err error
		if pss.ProcessBefore, err = ProcessUsage(); err != nil {
			return res, err
		}
	}
	start := time.Now()
	kids, err := parent.Fork(ctx, n, sandbox.ForkOptions{})
	if err != nil {
		return res, fmt.Errorf("fork of %d: %w", n, err)
	}
	defer closeAll(kids)
	res.Fork = time.Since(start)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, k := range kids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = snapExecTrue(ctx, k)
		}()
	}
	wg.Wait()
	res.AllExec = time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return res, fmt.Errorf("fork of %d: %w", n, err)
	}
	if pss != nil {
		pss.N = n
		if pss.ProcessAfter, err = ProcessUsage(); err != nil {
			return res, err
		}
		if pss.Parent, err = GuestUsage(parent); err != nil {
			return res, err
		}
		for _, k := range kids {
			u, err := GuestUsage(k)
			if err != nil {
				return res, err
			}
			pss.Children = append(pss.Children, u)
		}
		if pss.BaseSize, pss.BaseAllocated, err = fdAllocated(parent.VM().Memory().FD()); err != nil {
			return res, err
		}
	}
	if err := closeAll(kids); err != nil {
		return res, fmt.Errorf("fork of %d: %w", n, err)
	}
	return res, nil
}

// RunSnapshot measures what spec says, printing each figure to progress
// (nil: nowhere) as it comes. A fork that fails is recorded in its
// ForkResult and the rest goes on; any other failure ends the run, with
// what was measured so far.
func RunSnapshot(ctx context.Context, spec SnapshotSpec, progress io.Writer) (rep SnapshotReport, err error) {
	if spec, err = spec.Normalize(); err != nil {
		return rep, err
	}
	rep.Spec = spec
	r := &snapRunner{spec: spec, progress: progress}
	// The agent initramfs is built (or found in its cache) before any
	// clock starts.
	if r.spec.Agent == "" {
		if r.spec.Agent, err = sandbox.FindAgent(); err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
	}
	var k *guestkernel.Kernel
	if spec.Kernel == "" {
		if k, err = guestkernel.Find(); err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
	}
	rc := sandbox.RuntimeConfig{Kernel: k, KernelPath: spec.Kernel, Agent: r.spec.Agent, CacheDir: initrdCache()}
	if r.runtime, err = sandbox.NewRuntime(rc); err != nil {
		return rep, fmt.Errorf("bench: %w", err)
	}
	r.dir = spec.Dir
	if r.dir == "" {
		if r.dir, err = os.MkdirTemp("", "kiln-bench-snapshot-"); err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
		defer os.RemoveAll(r.dir)
	}
	snapDir := func(memMiB int, what string) string {
		return filepath.Join(r.dir, fmt.Sprintf("%s-%dmib", what, memMiB))
	}

	// Save against memory size: one cold boot each, closed after its save
	// (and its snapshot removed: under emulation /tmp is RAM).
	for _, m := range spec.SaveSizesMiB {
		if m == spec.MemoryMiB {
			continue
		}
		dir := snapDir(m, "save")
		sb, res, err := r.bootAndSave(ctx, m, dir)
		if err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
		rep.Saves = append(rep.Saves, res)
		if err := sb.Close(ctx); err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
		if spec.Dir == "" {
			os.RemoveAll(dir)
		}
	}

	// Further cold boots at the measured size, for the ratio.
	for i := 1; i < spec.ColdBoots; i++ {
		sb, d, err := r.boot(ctx, spec.MemoryMiB)
		if err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
		if err := sb.Close(ctx); err != nil {
			return rep, fmt.Errorf("bench: %w", err)
		}
		rep.ColdStarts = append(rep.ColdStarts, d)
		r.logf("%d MiB: cold boot %d to first exec %v", spec.MemoryMiB, i, d.Round(time.Millisecond))
	}

	// The measured sandbox: its cold boot is one of the ratio's, its
	// guest memory the standalone VM's, its snapshot the one restored.
	base := snapDir(spec.MemoryMiB, "base")
	parent, res, err := r.bootAndSave(ctx, spec.MemoryMiB, base)
	if err != nil {
		return rep, fmt.Errorf("bench: %w", err)
	}
	defer func() {
		if cerr := parent.Close(context.Background()); cerr != nil && err == nil {
			err = fmt.Errorf("bench: %w", cerr)
		}
	}()
	rep.Base = res
	rep.ColdStarts = append(rep.ColdStarts, res.ColdStart)
	if slices.Contains(spec.SaveSizesMiB, spec.MemoryMiB) {
		rep.Saves = append(rep.Saves, res)
		slices.SortStableFunc(rep.Saves, func(a, b SaveResult) int {
			return slices.Index(spec.SaveSizesMiB, a.MemoryMiB) - slices.Index(spec.SaveSizesMiB, b.MemoryMiB)
		})
	}
	standalone := res.Guest

	// Restores, with the parent paused so that it takes no CPU from them.
	if err := parent.VM().Pause(ctx); err != nil {
		return rep, fmt.Errorf("bench: pause the parent: %w", err)
	}
	// The peer, if any, is booted and saved now, and its restores
	// alternate with Kiln's; when it fails, Kiln's figures go on alone.
	var peer *qemuPeer
	if spec.QEMU != "" {
		rep.Peer = &PeerSnapshot{}
		peer, err = r.newQEMUPeer(k, spec.MemoryMiB)
		if err == nil {
			err = r.peerColdAndSave(ctx, peer, rep.Peer)
		}
		if err != nil {
			rep.Peer.Err = err.Error()
			r.logf("qemu microvm: %v", err)
			peer = nil
		}
	}
	for i := range spec.Restores {
		rr, err := r.restore(ctx, base, nil)
		if err != nil {
			if rerr := parent.VM().Resume(); rerr != nil {
				err = errors.Join(err, rerr)
			}
			return rep, fmt.Errorf("bench: restore %d: %w", i+1, err)
		}
		rep.Restores = append(rep.Restores, rr)
		r.logf("restore %d: to first exec %v (%s); guest memory %v", i+1, rr.Exec.Round(time.Millisecond), restorePhases(rr.Phases), rr.Guest)
		if peer == nil {
			continue
		}
		d, running, err := r.peerRestore(ctx, peer)
		if err != nil {
			rep.Peer.Err = fmt.Sprintf("restore %d: %v", i+1, err)
			r.logf("qemu microvm: %s", rep.Peer.Err)
			peer = nil
			continue
		}
		rep.Peer.Restores = append(rep.Peer.Restores, d)
		rep.Peer.Running = append(rep.Peer.Running, running)
		r.logf("qemu microvm restore %d: to first exec %v (guest running after %v)", i+1, d.Round(time.Millisecond), running.Round(time.Millisecond))
	}
	if peer != nil {
		os.Remove(peer.state)
	}
	// Repeat restores from a cache: one untimed restore fills it.
	cache := snapshot.NewCache(1)
	for i := range spec.Restores + 1 {
		rr, err := r.restore(ctx, base, cache)
		if err != nil {
			if rerr := parent.VM().Resume(); rerr != nil {
				err = errors.Join(err, rerr)
			}
			cache.Close()
			return rep, fmt.Errorf("bench: cached restore %d: %w", i, err)
		}
		if i == 0 {
			r.logf("restore filling the cache: to first exec %v", rr.Exec.Round(time.Millisecond))
			continue
		}
		rep.CachedRestores = append(rep.CachedRestores, rr)
		r.logf("cached restore %d: to first exec %v (%s); guest memory %v", i, rr.Exec.Round(time.Millisecond), restorePhases(rr.Phases), rr.Guest)
	}
	cache.Close()
	if err := parent.VM().Resume(); err != nil {
		return rep, fmt.Errorf("bench: resume the parent: %w", err)
	}
	if len(rep.Restores) > 0 {
		r.logf("restore to first exec: median %v over %d; cold boot to first exec: median %v over %d; ratio %.3f",
			rep.RestoreMedian().Round(time.Millisecond), len(rep.Restores),
			rep.ColdStart().Round(time.Millisecond), len(rep.ColdStarts), rep.RestoreRatio())
		r.logf("restore phases, medians: %s", restorePhases(RestorePhaseMedians(rep.Restores)))
	}
	if len(rep.CachedRestores) > 0 {
		r.logf("cached restore to first exec: median %v over %d", rep.CachedRestoreMedian().Round(time.Millisecond), len(rep.CachedRestores))
		r.logf("cached restore phases, medians: %s", restorePhases(RestorePhaseMedians(rep.CachedRestores)))
	}
	if p := rep.Peer; p != nil && len(p.Restores) > 0 {
		r.logf("qemu microvm: restore to first exec: median %v over %d; cold boot to first exec %v; ratio %.3f",
			Median(p.Restores).Round(time.Millisecond), len(p.Restores), p.ColdStart.Round(time.Millisecond), p.RestoreRatio())
	}

	// Forks, in order, from the one running parent; the PSS fork on its
	// own at the end when it is not one of them.
	forks := slices.Clone(spec.Forks)
	if !slices.Contains(forks, spec.PSSFork) {
		forks = append(forks, spec.PSSFork)
	}
	for i, n := range forks {
		var pss *PSSResult
		if n == spec.PSSFork && rep.PSS == nil {
			pss = &PSSResult{Standalone: standalone}
		}
		fr, err := r.fork(ctx, parent, n, pss)
		if err != nil {
			fr.Err = err.Error()
			r.logf("fork of %d: failed: %v", n, err)
		} else {
			r.logf("fork of %d (memory copied first: %v): children answering after %v, all first execs after %v",
				n, fr.Copied, fr.Fork.Round(time.Millisecond), fr.AllExec.Round(time.Millisecond))
			if pss != nil {
				rep.PSS = pss
				r.logf("after the fork of %d: child guest memory PSS %.1f MiB (own copies %.1f MiB) each; standalone VM %v; parent now %v; base file %.1f MiB; guest memory in all %.1f MiB, %.1f MiB per VM",
					n, MiB(pss.ChildPSS()), MiB(pss.ChildAnonymous()), pss.Standalone, pss.Parent,
					MiB(uint64(pss.BaseAllocated)), MiB(pss.GuestTotal()), MiB(pss.GuestPerVM()))
			}
		}
		if i < len(spec.Forks) {
			rep.Forks = append(rep.Forks, fr)
		}
		if ctx.Err() != nil {
			return rep, fmt.Errorf("bench: %w", ctx.Err())
		}
	}
	return rep, nil
}

// qemuPeer saves and restores the guest on QEMU microvm.
type qemuPeer struct {
	qemu        string
	args        []string // QEMUStartArgs: no -qmp, no -incoming
	cid         uint32
	qmpPath     string
	state       string // the migration stream's file
	bootTimeout time.Duration
}

// qemuVM is one running QEMU with a connected agent.
type qemuVM struct {
	cmd     *exec.Cmd
	out     *markerWriter
	client  *client.Client
	stopped chan struct{}
	waitErr error
	// resumed gets process start to QMP's RESUME event (the guest
	// running), when start was asked to watch for it; closed without a
	// value when that was not seen.
	resumed chan time.Duration
}

// stop closes the client and kills QEMU.
func (vm *qemuVM) stop() {
	if vm.client != nil {
		vm.client.Close()
	}
	select {
	case <-vm.stopped:
		return
	default:
	}
	vm.cmd.Process.Kill()
	<-vm.stopped
}

// start runs QEMU with the peer's arguments and extra, and times process
// start to the result of the first exec of true. With watch set, extra
// must open QMP on p.qmpPath, and vm.resumed says when the guest ran.
func (p *qemuPeer) start(ctx context.Context, watch bool, extra ...string) (*qemuVM, time.Duration, error) {
	vm := &qemuVM{out: newMarkerWriter(), stopped: make(chan struct{}), resumed: make(chan time.Duration, 1)}
	vm.cmd = exec.Command(p.qemu, append(slices.Clone(p.args), extra...)...)
	vm.cmd.Stdout, vm.cmd.Stderr = vm.out, vm.out
	start := time.Now()
	if err := vm.cmd.Start(); err != nil {
		return nil, 0, fmt.Errorf("qemu: start %s: %w", p.qemu, err)
	}
	go func() {
		vm.waitErr = vm.cmd.Wait()
		close(vm.stopped)
	}()
	if watch {
		go watchResume(ctx, p.qmpPath, start, vm.stopped, vm.resumed)
	} else {
		close(vm.resumed)
	}
	wctx, cancel := context.WithTimeout(ctx, p.bootTimeout)
	defer cancel()
	go func() {
		select {
		case <-vm.stopped:
			cancel()
		case <-wctx.Done():
		}
	}()
	c, err := client.WaitReadyFunc(wctx, AFVsockDialer(p.cid))
	if err != nil {
		select {
		case <-vm.stopped:
			return nil, 0, fmt.Errorf("qemu exited before the agent answered (%v): %s", vm.waitErr, vm.out.tail())
		default:
		}
		vm.stop()
		return nil, 0, fmt.Errorf("qemu: agent did not answer within %v: %w; console: %s", p.bootTimeout, err, vm.out.tail())
	}
	vm.client = c
	ectx, ecancel := context.WithTimeout(ctx, snapExecTimeout)
	defer ecancel()
	st, err := c.Exec(ectx, client.ExecOptions{Argv: []string{"true"}})
	if err == nil && !st.Success() {
		err = fmt.Errorf("%v", st)
	}
	if err != nil {
		vm.stop()
		return nil, 0, fmt.Errorf("qemu: first exec of true: %w; console: %s", err, vm.out.tail())
	}
	return vm, time.Since(start), nil
}

// save migrates the running guest of vm (started with -qmp on p.qmpPath)
// into p.state, at full speed, and times it.
func (p *qemuPeer) save(ctx context.Context) (time.Duration, error) {
	q, err := dialQMP(ctx, p.qmpPath)
	if err != nil {
		return 0, err
	}
	defer q.conn.Close()
	// QEMU throttles migration to 128 MiB/s by default.
	if _, err := q.do("migrate-set-parameters", map[string]any{"max-bandwidth": int64(1) << 40}); err != nil {
		return 0, err
	}
	start := time.Now()
	if _, err := q.do("migrate", map[string]any{"uri": "exec:cat > '" + p.state + "'"}); err != nil {
		return 0, err
	}
	for {
		b, err := q.do("query-migrate", nil)
		if err != nil {
			return 0, err
		}
		var st struct {
			Status    string `json:"status"`
			ErrorDesc string `json:"error-desc"`
		}
		if err := json.Unmarshal(b, &st); err != nil {
			return 0, fmt.Errorf("qmp: query-migrate: %w", err)
		}
		switch st.Status {
		case "completed":
			return time.Since(start), nil
		case "failed", "cancelled":
			return 0, fmt.Errorf("qemu: migrate: %s: %s", st.Status, st.ErrorDesc)
		}
		select {
		case <-ctx.Done():
			return 0, fmt.Errorf("qemu: migrate: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// newQEMUPeer prepares the peer for the guest Kiln boots at memMiB.
func (r *snapRunner) newQEMUPeer(k *guestkernel.Kernel, memMiB int) (*qemuPeer, error) {
	kernel := r.spec.Kernel
	if kernel == "" {
		kernel = k.Image
		if k.Vmlinux != "" {
			kernel = k.Vmlinux
		}
	}
	if err := EnsureVhostVsock(); err != nil {
		return nil, err
	}
	p := &qemuPeer{
		qemu:        r.spec.QEMU,
		cid:         1000 + rand.Uint32N(1<<30),
		qmpPath:     filepath.Join(r.dir, "qmp.sock"),
		state:       filepath.Join(r.dir, fmt.Sprintf("qemu-%dmib.migration", memMiB)),
		bootTimeout: r.spec.BootTimeout,
	}
	if strings.ContainsAny(r.dir, ",'") {
		return nil, fmt.Errorf("qemu: the snapshot directory %q has a comma or quote, which QEMU's options cannot take", r.dir)
	}
	p.args = QEMUStartArgs(StartSpec{Kernel: kernel, Initrd: r.runtime.Initrd, CPUs: r.spec.CPUs, MemoryMiB: memMiB}, p.cid)
	return p, nil
}

// peerColdAndSave boots the peer, times it to the first exec, and saves it.
func (r *snapRunner) peerColdAndSave(ctx context.Context, p *qemuPeer, ps *PeerSnapshot) error {
	os.Remove(p.qmpPath)
	vm, d, err := p.start(ctx, false, "-qmp", "unix:"+p.qmpPath+",server=on,wait=off")
	if err != nil {
		return fmt.Errorf("cold boot: %w", err)
	}
	defer vm.stop()
	ps.ColdStart = d
	if ps.Save, err = p.save(ctx); err != nil {
		return fmt.Errorf("save: %w; console: %s", err, vm.out.tail())
	}
	if ps.FileSize, ps.FileAllocated, err = allocated(p.state); err != nil {
		return err
	}
	r.logf("qemu microvm %d MiB: cold boot to first exec %v; save (migrate to a file) %v, file %.1f MiB allocated of %.1f MiB",
		r.spec.MemoryMiB, d.Round(time.Millisecond), ps.Save.Round(time.Millisecond),
		MiB(uint64(ps.FileAllocated)), MiB(uint64(ps.FileSize)))
	return nil
}

// peerRestore times one restore of the peer to its first exec, and to
// the guest running (0 when QMP did not say).
func (r *snapRunner) peerRestore(ctx context.Context, p *qemuPeer) (exec, running time.Duration, err error) {
	os.Remove(p.qmpPath)
	vm, d, err := p.start(ctx, true, "-incoming", "exec:cat '"+p.state+"'", "-qmp", "unix:"+p.qmpPath+",server=on,wait=off")
	if err != nil {
		return 0, 0, fmt.Errorf("restore: %w", err)
	}
	select {
	case running = <-vm.resumed:
	case <-time.After(5 * time.Second):
	}
	vm.stop()
	return d, running, nil
}
