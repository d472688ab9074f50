package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/cgroup"
)

// Cgroups is the host's cgroup v2 tree of sandboxes (*cgroup.Manager over
// kilnd's delegated subtree): the server makes a cgroup per sandbox,
// named for the sandbox's folder, before the sandbox starts (its VMM
// process starts in it), and removes it once the sandbox's VMM process is
// gone.
type Cgroups interface {
	// Create makes sandbox id's cgroup with limits l.
	Create(id string, l cgroup.Limits) (*cgroup.Group, error)
	// Events reads sandbox id's memory.events.
	Events(id string) (cgroup.Events, error)
	// Remove kills what is left in sandbox id's cgroup and removes it.
	Remove(ctx context.Context, id string) error
	// List returns the IDs of the cgroups there are.
	List() ([]string, error)
	// SetMemoryMax changes sandbox id's memory.max.
	SetMemoryMax(id string, bytes uint64) error
}

var _ Cgroups = (*cgroup.Manager)(nil)

// Defaults of the cgroup and admission settings.
const (
	// A VMM process's own memory, measured in L1 (TestKVMDaemonMemory):
	// ~10 MiB anonymous (Go heap, stacks) and ~3 MiB of kernel memory.
	// (The ~95 MiB once measured was a boot's kernel and initrd left in
	// the heap, now freed; its binary's and the kernel's page cache are
	// kilnd's.)
	defaultVMMOverheadMiB = 64
	defaultPidsMax        = 1024
)

// chargeRuntime reads the kernel and initrd, which every boot's VMM
// process reads, into the page cache from kilnd's cgroup, before any
// sandbox starts (chargePageCache): else the first sandbox booted pays
// for them (an uncompressed vmlinux: 63 MiB of memory.stat's file, in L1).
func (s *Server) chargeRuntime() {
	if s.cfg.Cgroups == nil {
		return
	}
	sf, ok := s.backend.(SharedFiles)
	if !ok {
		return
	}
	for _, p := range sf.BootFiles() {
		if p == "" {
			continue
		}
		if _, err := chargePageCache(s.ctx, p, false); err != nil {
			s.log.Warn("not read into kilnd's page cache: the first sandbox that boots is charged for it", "file", p, "err", err)
		}
	}
}

// cgroupRemoveTimeout bounds the removal of a sandbox's cgroup.
const cgroupRemoveTimeout = 30 * time.Second

// setCgroupDefaults fills the zero cgroup and admission settings of cfg.
func (cfg *Config) setCgroupDefaults() error {
	if cfg.VMMOverheadMiB == 0 {
		cfg.VMMOverheadMiB = defaultVMMOverheadMiB
	}
	if cfg.PidsMax == 0 {
		cfg.PidsMax = defaultPidsMax
	}
	if cfg.MemoryOvercommit == 0 {
		cfg.MemoryOvercommit = 1
	}
	if cfg.PidsMax < 0 {
		return fmt.Errorf("daemon: PidsMax %d is negative", cfg.PidsMax)
	}
	if !(cfg.MemoryOvercommit > 0) || cfg.MemoryOvercommit > 1000 {
		return fmt.Errorf("daemon: MemoryOvercommit %v: want a ratio above 0 (1: commit no more than the host's memory)", cfg.MemoryOvercommit)
	}
	return nil
}

// cgroupLimits are the limits of a sandbox with cpus vCPUs and mem MiB of
// guest memory.
func (s *Server) cgroupLimits(cpus, mem int) cgroup.Limits {
	return cgroup.Limits{CPUs: cpus, MemoryMiB: uint64(mem), OverheadMiB: s.cfg.VMMOverheadMiB, PidsMax: s.cfg.PidsMax, IO: s.cfg.SandboxIO}
}

// makeCgroup makes the cgroup of a sandbox whose folder is named id (with
// cpus vCPUs and mem MiB) and returns its folder: "" without cgroups.
func (s *Server) makeCgroup(id string, cpus, mem int) (string, error) {
	if s.cfg.Cgroups == nil {
		return "", nil
	}
	g, err := s.cfg.Cgroups.Create(id, s.cgroupLimits(cpus, mem))
	if errors.Is(err, fs.ErrExist) {
		// Left by a sandbox of this folder that is gone (a rollback's
		// old machine, a kilnd killed mid-create): nothing of it runs.
		ctx, cancel := context.WithTimeout(s.ctx, cgroupRemoveTimeout)
		err = s.cfg.Cgroups.Remove(ctx, id)
		cancel()
		if err == nil {
			g, err = s.cfg.Cgroups.Create(id, s.cgroupLimits(cpus, mem))
		}
	}
	if err != nil {
		return "", status.Errorf(codes.Internal, "sandbox %s's cgroup: %v", id, err)
	}
	return g.Path, nil
}

// removeCgroup removes sandbox id's cgroup (after its VMM process is
// gone), logging a failure.
func (s *Server) removeCgroup(id string) {
	if s.cfg.Cgroups == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), cgroupRemoveTimeout)
	defer cancel()
	if err := s.cfg.Cgroups.Remove(ctx, id); err != nil {
		s.log.Warn("sandbox cgroup not removed", "cgroup", id, "err", err)
	}
}

// createInCgroup starts spec through the backend in a cgroup of its own,
// named for its folder; the instance it returns removes the cgroup when
// closed.
func (s *Server) createInCgroup(ctx context.Context, spec CreateSpec) (Instance, error) {
	if s.cfg.Cgroups == nil {
		return s.backend.Create(ctx, spec)
	}
	id := filepath.Base(spec.Dir)
	path, err := s.makeCgroup(id, spec.CPUs, spec.MemoryMiB)
	if err != nil {
		return nil, err
	}
	spec.Host.Cgroup = path
	inst, err := s.backend.Create(ctx, spec)
	if err != nil {
		s.removeCgroup(id)
		return nil, err
	}
	return s.inCgroup(inst, id, path, spec.MemoryMiB), nil
}

// forkHosts makes the cgroups of a fork's children boxes (each with the
// parent's share: cpus, mem) and returns their HostSpecs and an undo for
// a fork that failed.
func (s *Server) forkHosts(boxes []*box, cpus, mem int) ([]HostSpec, func(), error) {
	hosts := make([]HostSpec, len(boxes))
	undo := func() {
		for i, b := range boxes {
			if hosts[i].Cgroup != "" {
				s.removeCgroup(b.id)
			}
		}
	}
	for i, b := range boxes {
		path, err := s.makeCgroup(b.id, cpus, mem)
		if err != nil {
			undo()
			return nil, func() {}, err
		}
		hosts[i].Cgroup = path
	}
	return hosts, undo, nil
}

// cgroupInstance is an instance whose VMM process runs in a cgroup the
// server made: Close removes the cgroup once the process is gone.
type cgroupInstance struct {
	Instance
	s      *Server
	id     string // the cgroup's ID
	path   string
	memMiB int // the guest's memory, for memory.max
}

// inCgroup makes inst, whose VMM process runs in cgroup id (at path), an
// instance that removes the cgroup when closed.
func (s *Server) inCgroup(inst Instance, id, path string, memMiB int) Instance {
	if s.cfg.Cgroups == nil || id == "" {
		return inst
	}
	return &cgroupInstance{Instance: inst, s: s, id: id, path: path, memMiB: memMiB}
}

func (in *cgroupInstance) Close(ctx context.Context) error {
	err := in.Instance.Close(ctx)
	in.s.removeCgroup(in.id)
	return err
}

// cgroupOf is the cgroup folder of inst's VMM process, "" when the server
// made none.
func cgroupOf(inst Instance) string {
	if in, ok := inst.(*cgroupInstance); ok {
		return in.path
	}
	return ""
}

// oomReason says that sandbox cgroup id's processes were killed by its
// memory limit (memMiB of guest memory), "" when its memory.events shows
// no OOM kill.
func (s *Server) oomReason(id string, memMiB int) string {
	if s.cfg.Cgroups == nil || id == "" {
		return ""
	}
	ev, err := s.cfg.Cgroups.Events(id)
	if err != nil || ev.OOMKill == 0 {
		return ""
	}
	max := uint64(memMiB) + s.cfg.VMMOverheadMiB
	return fmt.Sprintf("killed by its memory limit: memory.max %d MiB (%d MiB of guest memory and %d of VMM overhead), memory.events oom_kill %d",
		max, memMiB, s.cfg.VMMOverheadMiB, ev.OOMKill)
}

// stoppedReason is why inst, b's instance, stopped on its own.
func (s *Server) stoppedReason(inst Instance) string {
	if r := s.oomOf(inst); r != "" {
		return "the sandbox was " + r + " (" + inst.Exited() + ")"
	}
	return "the sandbox stopped on its own: " + inst.Exited()
}

// oomOf is oomReason for inst's cgroup, "" when it has none or was not
// OOM-killed.
func (s *Server) oomOf(inst Instance) string {
	if in, ok := inst.(*cgroupInstance); ok {
		return s.oomReason(in.id, in.memMiB)
	}
	return ""
}

// adoptCgroup makes inst, a sandbox of a previous server taken over, keep
// its cgroup (its record's).
func (s *Server) adoptCgroup(inst Instance, r *record) Instance {
	if r.Cgroup == "" {
		return inst
	}
	return s.inCgroup(inst, filepath.Base(r.Cgroup), r.Cgroup, int(r.MemoryMiB))
}

// pruneCgroups removes the cgroups of sandboxes that are gone: those no
// live sandbox's record names (what is left in them is killed).
func (s *Server) pruneCgroups() {
	if s.cfg.Cgroups == nil {
		return
	}
	ids, err := s.cfg.Cgroups.List()
	if err != nil {
		s.log.Warn("sandbox cgroups not listed: leftovers stay", "err", err)
		return
	}
	keep := map[string]bool{}
	s.mu.Lock()
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.life.get().live() && b.rec.Cgroup != "" {
			keep[filepath.Base(b.rec.Cgroup)] = true
		}
		b.mu.Unlock()
	}
	s.mu.Unlock()
	for _, id := range ids {
		if !keep[id] {
			s.log.Info("removing the cgroup of a sandbox that is gone", "cgroup", id)
			s.removeCgroup(id)
		}
	}
}

// MemoryCommit returns the host memory the server has committed to
// sandboxes (guest memory plus VMM overhead, of live sandboxes, pools'
// and template builders') and the most it commits (MemoryOvercommit ×
// HostMemoryMiB), in MiB.
func (s *Server) MemoryCommit() (committed, limit uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	_, _, committed = s.commitLocked()
	return committed, s.commitLimit()
}

// commitLocked counts the host's sandboxes, their guest memory and their
// commit (guest memory plus VMM overhead each); s.mu is held.
func (s *Server) commitLocked() (live int, guestMiB, committedMiB uint64) {
	live = s.building + s.pooled
	guestMiB = s.buildingMiB + s.pooledMiB
	for _, b := range s.boxes {
		b.mu.Lock()
		// A hibernated sandbox holds no memory, until a resume wakes it.
		if b.life.counts() {
			live++
			guestMiB += uint64(b.rec.MemoryMiB)
		}
		b.mu.Unlock()
	}
	return live, guestMiB, guestMiB + uint64(live)*s.cfg.VMMOverheadMiB
}

// commitLimit is the most memory the server commits to sandboxes, MiB.
func (s *Server) commitLimit() uint64 {
	return uint64(float64(s.cfg.HostMemoryMiB) * s.cfg.MemoryOvercommit)
}

// memoryMaxWithBases is the memory.max, in bytes, of a VMM process with
// mem MiB of guest memory that also pays for bases more guests' worth
// (frozen bases, or a snapshot's memory file it writes), and the overhead.
func (s *Server) memoryMaxWithBases(mem uint64, bases int) uint64 {
	return (mem*uint64(1+bases) + s.cfg.VMMOverheadMiB) << 20
}

// roomForSave raises the memory.max of the builder cgroup id, whose guest
// has mem MiB, by one guest's worth before its VMM process saves the
// template's snapshot. The memory file's pages are charged to the cgroup
// of the process that writes them, on top of the guest memory it holds;
// where the state folder is a tmpfs they are memory that cannot be
// reclaimed, and a builder whose guest had touched most of its RAM (a
// cold boot in 2 MiB pages does) was OOM-killed by its own limit in the
// middle of the save (measured in L1: 126 of 128 MiB of guest memory plus
// the file, against 128 + 64 MiB). The builder's cgroup goes with it, so
// the room lasts only for the save.
func (s *Server) roomForSave(id string, mem uint64) {
	if s.cfg.Cgroups == nil {
		return
	}
	if err := s.cfg.Cgroups.SetMemoryMax(id, s.memoryMaxWithBases(mem, 1)); err != nil {
		s.log.Warn("template builder's memory.max not raised for its snapshot: on a tmpfs state folder the save may be OOM-killed", "cgroup", id, "err", err)
	}
}

// growCgroup raises b's memory.max for what its VMM process holds: its
// guest memory and VMM overhead, plus one guest's worth per frozen base it
// pays for, counting pending bases about to be made. A hold (an in-memory
// checkpoint) or a fork freezes the guest's memory into a base the VMM
// process keeps (charged to its cgroup), and the guest's writes after it
// are copies on top (measured in L1, TestKVMDaemonMemory: a fork parent
// that rewrote 192 MiB was charged 687 MiB for a 512 MiB guest): without
// this, a sandbox that writes its memory after a checkpoint would be
// OOM-killed by its own limit. Bases are the in-memory checkpoints of b
// held now, at least one once it has been forked. The limit only grows in
// a sandbox's life: a released base may still be mapped by fork children,
// its pages charged here, and a lower limit would make the kernel reclaim
// or kill for them.
func (s *Server) growCgroup(b *box, pending int) {
	if s.cfg.Cgroups == nil {
		return
	}
	b.mu.Lock()
	path, mem, frozen := b.rec.Cgroup, uint64(b.rec.MemoryMiB), b.rec.Frozen
	b.mu.Unlock()
	if path == "" {
		return
	}
	bases := pending
	s.mu.Lock()
	for _, c := range s.checkpoints {
		if c.SandboxID == b.id && !c.Persisted {
			bases++
		}
	}
	s.mu.Unlock()
	if frozen && bases == 0 {
		bases = 1 // the base its memory maps since a fork
	}
	limit := s.memoryMaxWithBases(mem, bases)
	b.mu.Lock()
	if b.cgroupMax.path == path && b.cgroupMax.bytes >= limit {
		b.mu.Unlock()
		return
	}
	b.mu.Unlock()
	if err := s.cfg.Cgroups.SetMemoryMax(filepath.Base(path), limit); err != nil {
		s.log.Warn("sandbox cgroup's memory.max not raised for its checkpoints", "sandbox", b.id, "bases", bases, "err", err)
		return
	}
	b.mu.Lock()
	b.cgroupMax.path, b.cgroupMax.bytes = path, limit
	b.mu.Unlock()
}
