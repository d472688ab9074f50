package daemon

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/limits"
)

// Config configures a Server.
type Config struct {
	// StateDir holds the server's records and the sandboxes' folders
	// (required; kilnd uses /var/lib/kiln).
	StateDir string
	// Backend runs the sandboxes (required): kilnd's is a
	// vmmbackend.Backend, VMM processes over StateDir.
	Backend Backend

	// Defaults of a CreateSandboxRequest's zero fields (limits.DefaultCPUs
	// and DefaultMemoryMiB: 1 vCPU, 512 MiB when zero), and its lifetime
	// (no limit when zero).
	DefaultCPUs      uint32
	DefaultMemoryMiB uint32
	DefaultLifetime  time.Duration

	// Host limits: at most MaxSandboxes live sandboxes (0: 1024) with at
	// most MaxMemoryMiB of guest memory among them (0: the host's memory).
	// HostMemoryMiB is the host's memory (0: /proc/meminfo's MemTotal);
	// HostCPUs its CPUs (0: runtime.NumCPU).
	MaxSandboxes  int
	MaxMemoryMiB  uint64
	HostMemoryMiB uint64
	HostCPUs      int

	// MaxStarting is how many sandboxes start at once (boots, restores,
	// fork children, pool refills); more wait their turn, so that a burst
	// of creates does not thrash the host (0: 4 per host CPU).
	MaxStarting int
	// BootTimeout bounds a sandbox's start from when it has a start slot
	// (the wait for one does not count) (0: 5 minutes).
	BootTimeout time.Duration
	// TemplateTimeout bounds a template's build: its boot, setup and
	// snapshot (0: 30 minutes).
	TemplateTimeout time.Duration
	// KeepEnded is how many ended sandboxes GetSandbox still describes
	// (0: 4096); older ones are forgotten.
	KeepEnded int

	// Network, when set, gives every sandbox a network of its own (a
	// network namespace with a tap, an address, NAT and an egress policy:
	// package hostnet through HostNetwork); nil: sandboxes have no
	// network card, and a request's egress policy is refused.
	Network Network
	// DefaultEgress is the egress policy of a sandbox whose request gives
	// none (the zero value: allow-all).
	DefaultEgress EgressPolicy

	// Host cgroups and memory admission (daemon/cgroups.go). Cgroups,
	// when set, gives each sandbox's VMM process a cgroup of its own
	// with cpu.max from its vCPUs, memory.max from its memory plus
	// VMMOverheadMiB (0: 64) and pids.max PidsMax (0: 1024); nil: no
	// cgroups. The overhead is the VMM process's own memory beyond the
	// guest's RAM (counted in the guest's MiB, copy-on-write copies
	// included): its Go heap and stacks (~10 MiB in L1 once a boot's
	// kernel and initrd are freed), page tables and KVM's kernel memory
	// (~3 MiB), with slack; what sandboxes share (the kernel, initrd and
	// templates' memory files) the server reads into the page cache
	// first, charged to its own cgroup. Whether or not they are on, a create, fork or pool fill
	// that would commit more than MemoryOvercommit (0: 1.0) × the host's
	// memory, counting each sandbox's guest memory plus VMMOverheadMiB,
	// is refused (pools wait). SandboxIO, when set, caps each sandbox's
	// VMM process on those block devices (io.max: the disks of StateDir
	// and Images, say).
	Cgroups          Cgroups
	VMMOverheadMiB   uint64
	PidsMax          int
	MemoryOvercommit float64
	SandboxIO        []cgroup.IOLimit

	// SampleInterval is how often each running sandbox's CPU, memory
	// and disk are sampled for GetSandboxMetrics (0: 5 s; negative:
	// never, only at the call).
	SampleInterval time.Duration

	Logger *slog.Logger
	// Clock is the server's time; nil: the real one.
	Clock Clock
}

// Server implements kilnpb.KilnServer.
type Server struct {
	kilnpb.UnimplementedKilnServer

	cfg     Config
	log     *slog.Logger
	starts  chan struct{} // a slot per sandbox starting (Config.MaxStarting)
	clock   Clock
	backend Backend
	events  *broker
	metrics *metrics

	// ctx ends with Close: watchers and event streams stop.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// mu guards the maps; a box's own mutex is taken after it, never
	// before.
	mu          sync.Mutex
	boxes       map[string]*box
	requests    map[string]*box         // create request ID → sandbox
	forks       map[string]*forkRequest // fork request ID → children
	checkpoints map[string]*checkpointRecord
	// Templates: ready ones by ID, and every one (building too) by the
	// request ID that made it.
	templates    map[string]*template
	templateReqs map[string]*template
	// What template builders and pools hold of the host, beyond the
	// boxes: sandboxes and their memory.
	building, pooled       int
	buildingMiB, pooledMiB uint64
	closed                 bool
}

// The folders under StateDir.
const (
	sandboxesDir   = "sandboxes"
	checkpointsDir = "checkpoints"
	templatesDir   = "templates"
	hibernatedDir  = "hibernated" // ID/ per hibernated sandbox: its snapshot
)

// New makes a server over cfg.StateDir, taking over every sandbox its
// records list as live: one whose VMM process still runs is listed again
// with its ID and state; one whose process is gone becomes failed, with
// the reason.
func New(cfg Config) (*Server, error) {
	if cfg.StateDir == "" {
		return nil, errors.New("daemon: no state folder (Config.StateDir)")
	}
	abs, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return nil, fmt.Errorf("daemon: state folder: %w", err)
	}
	cfg.StateDir = abs
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Clock == nil {
		cfg.Clock = realClock{}
	}
	if cfg.DefaultCPUs == 0 {
		cfg.DefaultCPUs = limits.DefaultCPUs
	}
	if cfg.DefaultMemoryMiB == 0 {
		cfg.DefaultMemoryMiB = limits.DefaultMemoryMiB
	}
	if cfg.MaxSandboxes == 0 {
		cfg.MaxSandboxes = 1024
	}
	if cfg.HostMemoryMiB == 0 {
		if cfg.HostMemoryMiB = hostMemoryMiB(); cfg.HostMemoryMiB == 0 {
			cfg.HostMemoryMiB = 1 << 40 // unknown: no limit of its own
		}
	}
	if cfg.MaxMemoryMiB == 0 {
		cfg.MaxMemoryMiB = cfg.HostMemoryMiB
	}
	if cfg.HostCPUs == 0 {
		cfg.HostCPUs = hostCPUs()
	}
	if cfg.MaxStarting == 0 {
		cfg.MaxStarting = 4 * cfg.HostCPUs
	}
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = 5 * time.Minute
	}
	if cfg.SampleInterval == 0 {
		cfg.SampleInterval = defaultSampleInterval
	}
	if cfg.KeepEnded == 0 {
		cfg.KeepEnded = 4096
	}
	if err := cfg.setCgroupDefaults(); err != nil {
		return nil, err
	}
	if cfg.Backend == nil {
		return nil, errors.New("daemon: no backend (Config.Backend: kilnd's is a vmmbackend.Backend)")
	}
	if cfg.TemplateTimeout == 0 {
		cfg.TemplateTimeout = 30 * time.Minute
	}
	if err := checkEgress("default egress policy", cfg.DefaultEgress); err != nil {
		return nil, fmt.Errorf("daemon: %s", status.Convert(err).Message())
	}
	for _, d := range []string{sandboxesDir, checkpointsDir, templatesDir, hibernatedDir} {
		if err := os.MkdirAll(filepath.Join(cfg.StateDir, d), 0o700); err != nil {
			return nil, fmt.Errorf("daemon: state folder: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg: cfg, log: cfg.Logger, clock: cfg.Clock, backend: cfg.Backend, events: newBroker(),
		starts: make(chan struct{}, cfg.MaxStarting),
		ctx:    ctx, cancel: cancel,
		boxes: map[string]*box{}, requests: map[string]*box{}, forks: map[string]*forkRequest{},
		checkpoints: map[string]*checkpointRecord{},
		templates:   map[string]*template{}, templateReqs: map[string]*template{},
	}
	s.metrics = newMetrics(s)
	s.chargeRuntime()
	s.loadTemplates()
	if err := s.load(); err != nil {
		cancel()
		return nil, err
	}
	s.cleanLeftovers()
	s.pruneNets()
	s.pruneCgroups()
	s.pruneHibernated()
	s.startPools()
	return s, nil
}

// create starts a sandbox through the backend. Its caller holds a start
// slot (bootCtx, takeStartSlot); a ctx that ended while it waited for one
// says why (its cause).
func (s *Server) create(ctx context.Context, spec CreateSpec) (Instance, error) {
	if ctx.Err() != nil {
		return nil, context.Cause(ctx)
	}
	return s.createInCgroup(ctx, spec)
}

// takeStartSlot waits under ctx for one of the Config.MaxStarting start
// slots and returns the func that frees it (once, however often called).
func (s *Server) takeStartSlot(ctx context.Context) (release func(), err error) {
	select {
	case s.starts <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for a start slot (%d sandboxes are starting): %w", s.cfg.MaxStarting, ctx.Err())
	}
	var once sync.Once
	return func() { once.Do(func() { <-s.starts }) }, nil
}

// bootCtx waits under parent for a start slot, then returns a context
// bounded by Config.BootTimeout from that moment, so that a sandbox queued
// behind a burst of others does not spend its boot's time in the queue
// (100 creates at once on a slow host timed out waiting, before), and a
// cancel that ends it and frees the slot. When parent ends before a slot
// is free, the context is done already, its cause saying so (create
// returns it).
func (s *Server) bootCtx(parent context.Context) (context.Context, context.CancelFunc) {
	release, err := s.takeStartSlot(parent)
	if err != nil {
		ctx, cancel := context.WithCancelCause(parent)
		cancel(err)
		return ctx, func() {}
	}
	ctx, cancel := context.WithTimeout(parent, s.cfg.BootTimeout)
	return ctx, func() { cancel(); release() }
}

// Register registers the Kiln service on r.
func (s *Server) Register(r grpc.ServiceRegistrar) { kilnpb.RegisterKilnServer(r, s) }

// Close stops the server's timers, watchers and event streams, and the
// templates' pools (their sandboxes are closed: a later server refills
// them). The sandboxes run on: a server made later over the same state
// folder takes them over.
func (s *Server) Close(ctx context.Context) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	boxes := make([]*box, 0, len(s.boxes))
	for _, b := range s.boxes {
		boxes = append(boxes, b)
	}
	s.mu.Unlock()
	s.cancel()
	for _, b := range boxes {
		b.mu.Lock()
		if b.timer != nil {
			b.timer.Stop()
		}
		inst := b.inst
		b.mu.Unlock()
		if inst != nil {
			inst.Detach()
		}
	}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("daemon: close: %w", ctx.Err())
	}
}

// box is a sandbox the server knows, live or ended.
type box struct {
	id string
	mu sync.Mutex
	// rec is the record as the state folder has it (after persist).
	rec record
	// life is its state (boxstate.go): every operation asks its gate.
	life *boxLife
	// inst is its machine: set while it is running or paused (and while
	// an end closes it); nil while it starts, hibernates, is hibernated,
	// wakes or rolls back (the operation holds the machine), and once it
	// has ended.
	inst Instance
	// ctx ends when the sandbox does (or rolls back): its background
	// execs go with it. A rollback replaces it, under mu.
	ctx    context.Context
	cancel context.CancelFunc
	// ready is closed once the create that made it has finished.
	ready     chan struct{}
	createErr error
	// cgroupMax is the memory.max growCgroup last set on the cgroup at
	// path (a rollback's new machine has a cgroup of its own).
	cgroupMax struct {
		path  string
		bytes uint64
	}
	// lastActive and busy (calls in flight) drive the idle timeout.
	lastActive time.Time
	busy       int
	// streams are the calls of busy that follow the sandbox for as long
	// as it runs (background execs' streams, AttachExec, WatchDir): a
	// pause or hibernation does not wait for them (a hibernation ends
	// them; the processes run on in the guest).
	streams int
	timer   Timer
	execs   *execTable
	// secrets are the sandbox's secrets, in this process's memory only
	// (its VMM process keeps them too: see secrets.go); rec names them.
	secrets []secret
	// samples are its metrics (sandboxmetrics.go).
	samples sampleRing
}

func newBox(id string) *box {
	ctx, cancel := context.WithCancel(context.Background())
	return &box{id: id, life: newBoxLife(id, boxStarting), ctx: ctx, cancel: cancel, ready: make(chan struct{}), execs: newExecTable()}
}

// load reads the records and takes the live sandboxes over.
func (s *Server) load() error {
	recs, err := readRecords[record](filepath.Join(s.cfg.StateDir, sandboxesDir))
	if err != nil {
		s.log.Warn("some sandbox records could not be read", "err", err)
	}
	cks, err := readRecords[checkpointRecord](filepath.Join(s.cfg.StateDir, checkpointsDir))
	if err != nil {
		s.log.Warn("some checkpoint records could not be read", "err", err)
	}
	for _, c := range cks {
		s.checkpoints[c.ID] = c
	}
	var live []*box
	for _, r := range recs {
		if err := checkID("record", r.ID); err != nil {
			s.log.Warn("skipping a sandbox record", "err", err)
			continue
		}
		b := newBox(r.ID)
		b.rec = *r
		b.life = newBoxLife(r.ID, stateOfRecord(r))
		b.syncStateLocked() // b is not shared yet
		b.lastActive = s.clock.Now()
		close(b.ready)
		s.boxes[r.ID] = b
		s.indexRequest(b)
		if b.life.get().live() {
			live = append(live, b)
		} else {
			b.cancel()
		}
	}
	// Every box is in the maps before any is taken over (or fails).
	var wg sync.WaitGroup
	for _, b := range live {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.adopt(b)
		}()
	}
	wg.Wait()
	s.pruneHeldCheckpoints()
	return nil
}

// pruneHeldCheckpoints forgets the in-memory checkpoints whose sandbox
// did not come back (its VMM process, which held them, is gone) or no
// longer holds them.
func (s *Server) pruneHeldCheckpoints() {
	s.mu.Lock()
	bySandbox := map[string][]string{}
	for _, c := range s.checkpoints {
		if !c.Persisted {
			bySandbox[c.SandboxID] = append(bySandbox[c.SandboxID], c.ID)
		}
	}
	s.mu.Unlock()
	for id, cks := range bySandbox {
		var inst Instance
		if b, err := s.lookup(id); err == nil {
			b.mu.Lock()
			inst = b.inst
			b.mu.Unlock()
		}
		held := map[string]bool{}
		if inst != nil {
			ctx, cancel := context.WithTimeout(s.ctx, time.Minute)
			ids, err := inst.Held(ctx)
			cancel()
			if err != nil {
				s.log.Warn("the in-memory checkpoints of a sandbox taken over could not be listed", "sandbox", id, "err", err)
				continue
			}
			for _, h := range ids {
				held[h] = true
			}
		}
		for _, ck := range cks {
			if !held[ck] {
				s.log.Info("in-memory checkpoint gone with its VMM process", "checkpoint", ck, "sandbox", id)
				s.forgetCheckpoint(ck)
			}
		}
	}
}

// indexRequest remembers the request ID that made b.
func (s *Server) indexRequest(b *box) {
	r := &b.rec
	if r.RequestID == "" {
		return
	}
	if isForkKey(r.RequestKey) {
		f := s.forks[r.RequestID]
		if f == nil {
			f = &forkRequest{key: r.RequestKey, done: make(chan struct{})}
			close(f.done)
			s.forks[r.RequestID] = f
		}
		f.children = append(f.children, b.id)
		sort.Strings(f.children)
		return
	}
	s.requests[r.RequestID] = b
}

// adopt takes over a live sandbox of a previous server.
func (s *Server) adopt(b *box) {
	if b.life.get() == boxHibernated {
		// No VMM process to take over: its state is on disk. Its
		// network stays, for the resume.
		s.adoptNet(b)
		s.log.Info("hibernated sandbox taken over", "sandbox", b.id)
		return
	}
	b.mu.Lock()
	from, err := b.beginLocked(attachOp) // running or paused, as recorded
	b.mu.Unlock()
	if err != nil {
		s.log.Error("sandbox not taken over", "sandbox", b.id, "err", err)
		return
	}
	ctx, cancel := context.WithTimeout(s.ctx, time.Minute)
	defer cancel()
	inst, err := s.backend.Attach(ctx, b.rec.Dir, from == boxPaused)
	if err != nil {
		s.log.Warn("sandbox lost while kilnd was down", "sandbox", b.id, "err", err)
		if inst != nil {
			inst.Close(context.Background())
		} else {
			os.RemoveAll(b.rec.Dir)
		}
		reason := "its VMM process could not be taken over after a kilnd restart: " + err.Error()
		var ferr error = err
		if oom := s.oomReason(filepath.Base(b.rec.Cgroup), int(b.rec.MemoryMiB)); b.rec.Cgroup != "" && oom != "" {
			reason = "the sandbox was " + oom + " while kilnd was down (" + err.Error() + ")"
			ferr = errors.New(reason)
		}
		s.metrics.failed(opSandbox, ferr)
		s.finish(b, attachOp, ferr, reason)
		return
	}
	inst = s.adoptCgroup(inst, &b.rec)
	secs := s.adoptSecrets(ctx, b, inst)
	b.mu.Lock()
	b.doneLocked(attachOp, nil) // running or paused, as recorded
	b.inst = inst
	b.secrets = secs
	b.rec.PID = inst.PID()
	s.persistLocked(b)
	s.scheduleLocked(b)
	b.mu.Unlock()
	s.adoptNet(b)
	s.watch(b, inst)
	s.sample(b, inst)
	s.log.Info("sandbox taken over", "sandbox", b.id, "pid", inst.PID())
}

// watch waits for inst, b's instance, to stop on its own: b has failed.
func (s *Server) watch(b *box, inst Instance) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		select {
		case <-inst.Done():
		case <-s.ctx.Done():
			return
		}
		b.mu.Lock()
		mine := b.inst == inst // not one it let go of (a hibernation, a rollback, its end)
		b.mu.Unlock()
		if !mine {
			return
		}
		// Once per sandbox: a guest that crashes its VM logs one line.
		if inst.PoweredOff() && s.oomOf(inst) == "" {
			// The guest's own poweroff: a clean end, not a failure.
			reason := "its guest powered off: " + inst.Exited()
			s.log.Info("sandbox stopped by its guest", "sandbox", b.id, "exit", inst.Exited())
			s.end(b, stopOp, reason)
			return
		}
		reason := s.stoppedReason(inst)
		s.log.Info("sandbox stopped on its own", "sandbox", b.id, "exit", inst.Exited(), "reason", reason)
		s.metrics.failed(opSandbox, errors.New(reason))
		s.end(b, failOp, reason)
	}()
}

// end ends the live sandbox b by op (destroy, timeout, stop or fail):
// its instance is closed (nothing of it left on the host) and it is
// recorded in op's final state with reason. It returns false when b's
// state refuses op: it was ending or ended already (or, for a timeout,
// is not running or paused).
func (s *Server) end(b *box, op boxOp, reason string) bool {
	<-b.ready
	b.mu.Lock()
	if _, err := b.beginLocked(op); err != nil {
		b.mu.Unlock()
		return false
	}
	if b.timer != nil {
		b.timer.Stop()
	}
	inst, cancel, hib := b.inst, b.cancel, b.rec.HibernateDir
	b.mu.Unlock()
	cancel()
	if hib != "" {
		os.RemoveAll(hib) // a hibernated sandbox's state
	}
	if inst != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		if err := inst.Close(ctx); err != nil {
			s.log.Warn("sandbox close", "sandbox", b.id, "err", err)
		}
		cancel()
	} else if b.rec.Dir != "" {
		os.RemoveAll(b.rec.Dir)
	}
	s.finish(b, op, nil, reason)
	return true
}

// finish ends op, which ends b (an end, or a start or take-over that
// failed with err), in its final state: it records and publishes it, and
// forgets the oldest ended sandboxes beyond Config.KeepEnded.
func (s *Server) finish(b *box, op boxOp, err error, reason string) {
	b.mu.Lock()
	n := b.rec.Net.clone()
	b.mu.Unlock()
	s.detachNet(n) // its VMM process is gone: it ends with nothing left
	b.mu.Lock()
	state, ok := b.doneLocked(op, err)
	if !ok || !state.ended() {
		// Not possible: nothing takes over an end, a start or a
		// take-over, and they end only in final states.
		b.mu.Unlock()
		s.log.Error("sandbox end not recorded", "sandbox", b.id, "op", op, "state", state)
		return
	}
	b.inst = nil
	b.secrets = nil // the sandbox's end is its secrets' (execs still masking hold their own reference)
	b.rec.Reason = reason
	b.rec.EndedUnixMS = s.clock.Now().UnixMilli()
	s.persistLocked(b)
	pb := s.protoLocked(b)
	cancel := b.cancel
	b.mu.Unlock()
	cancel()
	kind := map[boxState]kilnpb.Event_Kind{
		boxDestroyed: kilnpb.Event_KIND_EXITED,
		boxFailed:    kilnpb.Event_KIND_FAILED,
		boxTimedOut:  kilnpb.Event_KIND_TIMED_OUT,
		boxStopped:   kilnpb.Event_KIND_STOPPED,
	}[state]
	s.publish(kind, pb, reason)
	s.pokePools()
	s.metrics.sandboxEnded(pb.State)
	s.log.Info("sandbox ended", "sandbox", b.id, "state", state.String(), "reason", reason)
	s.gcCheckpoints(b.id)
	s.pruneEnded()
}

// pruneEnded forgets the oldest ended sandboxes beyond Config.KeepEnded.
func (s *Server) pruneEnded() {
	s.mu.Lock()
	defer s.mu.Unlock()
	type endedBox struct {
		b     *box
		ended int64
		req   string
		fork  bool // req is a fork's (s.forks), not a create's
	}
	var ended []endedBox
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.life.get().ended() {
			ended = append(ended, endedBox{b, b.rec.EndedUnixMS, b.rec.RequestID, isForkKey(b.rec.RequestKey)})
		}
		b.mu.Unlock()
	}
	if len(ended) <= s.cfg.KeepEnded {
		return
	}
	sort.Slice(ended, func(i, j int) bool { return ended[i].ended < ended[j].ended })
	for _, x := range ended[:len(ended)-s.cfg.KeepEnded] {
		delete(s.boxes, x.b.id)
		if x.fork {
			s.forgetForkChildLocked(x.req, x.b.id)
		} else if s.requests[x.req] == x.b {
			delete(s.requests, x.req)
		}
		os.Remove(s.recordPath(x.b.id))
	}
}

func (s *Server) recordPath(id string) string {
	return filepath.Join(s.cfg.StateDir, sandboxesDir, id+".json")
}

// persistLocked writes b's record; b.mu is held. A failure is logged: the
// sandbox runs on, and the next change writes the record again.
func (s *Server) persistLocked(b *box) {
	if err := writeJSON(s.recordPath(b.id), &b.rec); err != nil {
		s.log.Error("sandbox record not written", "sandbox", b.id, "err", err)
	}
}

func (s *Server) publish(kind kilnpb.Event_Kind, sb *kilnpb.Sandbox, reason string) {
	s.events.publish(&kilnpb.Event{Kind: kind, SandboxId: sb.Id, Reason: reason, UnixMs: s.clock.Now().UnixMilli(), Sandbox: sb})
}

// protoLocked describes b; b.mu is held.
func (s *Server) protoLocked(b *box) *kilnpb.Sandbox {
	r := &b.rec
	st, hib := b.life.public()
	pb := &kilnpb.Sandbox{
		Id: r.ID, State: st, Reason: r.Reason, Image: r.Image, Checkpoint: r.Checkpoint,
		Template: r.Template, FromPool: r.FromPool,
		Resources:     &kilnpb.Resources{Cpus: r.CPUs, MemoryMib: r.MemoryMiB, DiskMib: r.DiskMiB},
		Labels:        r.Labels,
		CreatedUnixMs: r.CreatedUnixMS, ExpiresUnixMs: r.ExpiresUnixMS, IdleTimeoutMs: r.IdleTimeoutMS,
		LastActiveUnixMs: b.lastActive.UnixMilli(), Pid: int32(r.PID), ReadyMs: r.ReadyMS,
		SecretNames: r.SecretNames,
		Network:     netProto(r.Net),
		Cgroup:      r.Cgroup,
		Hibernated:  hib, TimeoutAction: r.TimeoutAction,
		Init: initName(r.Init),
	}
	if !isLive(st) {
		pb.Pid, pb.Cgroup = 0, ""
	}
	return proto.Clone(pb).(*kilnpb.Sandbox)
}

// newID returns a new random ID with prefix.
func newID(prefix string) string {
	b := make([]byte, 8)
	rand.Read(b) // never fails (crypto/rand)
	return prefix + hex.EncodeToString(b)
}

// requestKey is the digest of req's fields but its request ID: a retry
// must have the same.
func requestKey(kind string, req proto.Message) string {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return kind + ":unencodable"
	}
	h := sha256.Sum256(b)
	return kind + ":" + hex.EncodeToString(h[:])
}

// lookup returns the sandbox id names.
func (s *Server) lookup(id string) (*box, error) {
	if err := checkID("sandbox ID", id); err != nil {
		return nil, err
	}
	s.mu.Lock()
	b := s.boxes[id]
	s.mu.Unlock()
	if b == nil {
		return nil, status.Errorf(codes.NotFound, "no sandbox %q", id)
	}
	return b, nil
}

// following marks a call of b that use let in as one of its streams (see
// box.streams) until the returned func is called.
func (b *box) following() func() {
	b.mu.Lock()
	b.streams++
	b.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			b.streams--
			b.mu.Unlock()
		})
	}
}

// use returns the running instance of sandbox id for a call, marking the
// sandbox busy (the idle timer waits) until done is called.
func (s *Server) use(id string) (_ *box, _ Instance, done func(), _ error) {
	b, err := s.lookup(id)
	if err != nil {
		return nil, nil, nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.life.check(useOp); err != nil {
		return nil, nil, nil, err // not running
	}
	b.busy++
	b.lastActive = s.clock.Now()
	var once sync.Once
	return b, b.inst, func() {
		once.Do(func() {
			b.mu.Lock()
			b.busy--
			b.lastActive = s.clock.Now()
			b.mu.Unlock()
		})
	}, nil
}

// callErr turns a backend's error into a status: the agent's code when it
// gave one, else Internal; what names the call.
func callErr(what string, err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, context.Canceled) {
		return status.Errorf(codes.Canceled, "%s: %v", what, err)
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return status.Errorf(codes.DeadlineExceeded, "%s: %v", what, err)
	}
	code := codes.Internal
	if st, ok := status.FromError(err); ok && st.Code() != codes.Unknown && st.Code() != codes.OK {
		code = st.Code()
	}
	return status.Errorf(code, "%s: %v", what, err)
}
