package daemon

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/limits"
)

// Limits of the request fields.
const (
	maxRequestID = 128
	maxIDLen     = 128
	maxLabelKey  = 128
	maxLabelVal  = 1024
	maxLabels    = 64
	maxEnv       = 1024
)

// checkID refuses an empty, long or odd ID.
func checkID(what, id string) error {
	if id == "" {
		return status.Errorf(codes.InvalidArgument, "%s is empty", what)
	}
	if len(id) > maxIDLen {
		return status.Errorf(codes.InvalidArgument, "%s is %d bytes: at most %d", what, len(id), maxIDLen)
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') || c == '.' && id[0] == '.' {
			return status.Errorf(codes.InvalidArgument, "%s %q: only letters, digits, '-', '_' and '.' (not first)", what, id)
		}
	}
	return nil
}

// checkRequestID refuses a missing or oversized request ID.
func checkRequestID(id string) error {
	if id == "" {
		return status.Error(codes.InvalidArgument, "request_id is empty: give a client-chosen ID of 1 to 128 bytes, so that a retry returns what the first request made")
	}
	if len(id) > maxRequestID {
		return status.Errorf(codes.InvalidArgument, "request_id is %d bytes: at most %d", len(id), maxRequestID)
	}
	if strings.ContainsRune(id, 0) {
		return status.Error(codes.InvalidArgument, "request_id has a NUL byte")
	}
	return nil
}

func checkEnv(field string, env []string) error {
	if len(env) > maxEnv {
		return status.Errorf(codes.InvalidArgument, "%s has %d entries: at most %d", field, len(env), maxEnv)
	}
	for i, e := range env {
		k, _, ok := strings.Cut(e, "=")
		if !ok || k == "" {
			return status.Errorf(codes.InvalidArgument, "%s[%d] %q: want NAME=VALUE", field, i, e)
		}
		if strings.ContainsRune(e, 0) {
			return status.Errorf(codes.InvalidArgument, "%s[%d] has a NUL byte", field, i)
		}
	}
	return nil
}

func checkLabels(field string, labels map[string]string) error {
	if len(labels) > maxLabels {
		return status.Errorf(codes.InvalidArgument, "%s has %d labels: at most %d", field, len(labels), maxLabels)
	}
	for k, v := range labels {
		if k == "" || len(k) > maxLabelKey || strings.ContainsRune(k, 0) {
			return status.Errorf(codes.InvalidArgument, "%s: label key %q: want 1 to %d bytes, no NUL", field, k, maxLabelKey)
		}
		if len(v) > maxLabelVal || strings.ContainsRune(v, 0) {
			return status.Errorf(codes.InvalidArgument, "%s: label %q's value: want at most %d bytes, no NUL", field, k, maxLabelVal)
		}
	}
	return nil
}

// hasLabels says labels has every entry of want.
func hasLabels(labels, want map[string]string) bool {
	for k, v := range want {
		if got, ok := labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

// lifetimes resolves a request's lifetime and idle timeout (ms): 0 is the
// default lifetime, negative none; a finite lifetime shorter than the idle
// timeout is refused.
func (s *Server) lifetimes(lifetimeMS, idleMS int64) (time.Duration, time.Duration, error) {
	if idleMS < 0 {
		return 0, 0, status.Errorf(codes.InvalidArgument, "idle_timeout_ms %d is negative: 0 means none", idleMS)
	}
	life := time.Duration(lifetimeMS) * time.Millisecond
	switch {
	case lifetimeMS == 0:
		life = s.cfg.DefaultLifetime
	case lifetimeMS < 0:
		life = 0
	}
	idle := time.Duration(idleMS) * time.Millisecond
	if life > 0 && idle > 0 && life < idle {
		return 0, 0, status.Errorf(codes.InvalidArgument, "a lifetime of %v is shorter than the idle timeout of %v: the idle timeout could never fire", life, idle)
	}
	return life, idle, nil
}

// CreateSandbox starts a sandbox from an image or a checkpoint.
func (s *Server) CreateSandbox(ctx context.Context, req *kilnpb.CreateSandboxRequest) (sb *kilnpb.Sandbox, err error) {
	created := time.Now()
	defer func() { s.metrics.createDone(createSource(req), created, sb, err) }()
	if err := checkRequestID(req.GetRequestId()); err != nil {
		return nil, err
	}
	secrets, err := checkSecrets("secrets", req.GetSecrets())
	if err != nil {
		return nil, err
	}
	r := record{Env: req.GetEnv(), Labels: req.GetLabels(), SecretNames: secretNames(secrets)}
	spec := CreateSpec{}
	var tmpl *template
	var fromCk *checkpointRecord
	res := req.GetResources()
	// Whether the source has a network card: an image's sandbox has one
	// when the server has networks.
	srcWhat, srcNIC := "image", s.cfg.Network != nil
	switch src := req.GetSource().(type) {
	case nil:
		return nil, status.Error(codes.InvalidArgument, "no source: give one of image, template or checkpoint")
	case *kilnpb.CreateSandboxRequest_Template:
		t, err := s.template(src.Template)
		if err != nil {
			return nil, err
		}
		if err := fromTemplate(t, res, &r, &spec); err != nil {
			return nil, err
		}
		res = &kilnpb.Resources{Cpus: t.rec.CPUs, MemoryMib: t.rec.MemoryMiB, DiskMib: t.rec.DiskMiB}
		tmpl = t
		srcWhat, srcNIC = "template "+t.rec.ID, t.rec.Net
	case *kilnpb.CreateSandboxRequest_Image:
		if src.Image == "" || strings.ContainsRune(src.Image, 0) {
			return nil, status.Errorf(codes.InvalidArgument, "image %q: want an image reference or manifest digest", src.Image)
		}
		spec.Image, r.ImageRef = src.Image, src.Image
	case *kilnpb.CreateSandboxRequest_Checkpoint:
		ck, err := s.checkpoint(src.Checkpoint)
		if err != nil {
			return nil, err
		}
		if res.GetCpus() != 0 || res.GetMemoryMib() != 0 || res.GetDiskMib() != 0 {
			return nil, status.Errorf(codes.InvalidArgument, "resources: a sandbox from checkpoint %s has the checkpointed sandbox's CPUs, memory and writable layer; leave them 0", ck.ID)
		}
		fromCk, r.Checkpoint = ck, ck.ID
		r.LastCheckpoint, r.Image = ck.ID, ck.Image
		r.Env = append(append([]string{}, ck.Env...), req.GetEnv()...)
		cpus, mem := s.checkpointResources(ck)
		res = &kilnpb.Resources{Cpus: cpus, MemoryMib: mem}
		srcWhat, srcNIC = "checkpoint "+ck.ID, ck.Net
	}
	init, err := checkInit(req.GetInit())
	if err != nil {
		return nil, err
	}
	switch {
	case tmpl != nil && req.GetInit() != "" && init != tmpl.rec.Init:
		return nil, status.Errorf(codes.InvalidArgument, "init %q: a sandbox from template %s has the template's process 1 (%s)", req.GetInit(), tmpl.rec.ID, initName(tmpl.rec.Init))
	case tmpl != nil:
		init = tmpl.rec.Init
	case fromCk != nil && init != "":
		return nil, status.Errorf(codes.InvalidArgument, "init %q: a sandbox from checkpoint %s keeps the process 1 its sandbox booted; leave init empty", req.GetInit(), fromCk.ID)
	}
	spec.Init, r.Init = init, init
	egress, err := s.requestEgress("egress", req.GetEgress())
	if err != nil {
		return nil, err
	}
	withNet, err := s.sourceNet(srcWhat, srcNIC, req.GetEgress() != nil)
	if err != nil {
		return nil, err
	}
	cpus, mem, err := s.resources(res)
	if err != nil {
		return nil, err
	}
	if err := checkEnv("env", req.GetEnv()); err != nil {
		return nil, err
	}
	if err := checkLabels("labels", req.GetLabels()); err != nil {
		return nil, err
	}
	if r.Volumes, err = s.checkVolumeMounts("volumes", req.GetVolumes()); err != nil {
		return nil, err
	}
	spec.Volumes = s.volumeAttaches(r.Volumes)
	life, idle, err := s.lifetimes(req.GetLifetimeMs(), req.GetIdleTimeoutMs())
	if err != nil {
		return nil, err
	}
	spec.CPUs, spec.MemoryMiB, spec.WritableMiB = int(cpus), int(mem), int(res.GetDiskMib())
	r.CPUs, r.MemoryMiB, r.DiskMiB = cpus, mem, res.GetDiskMib()
	r.IdleTimeoutMS = idle.Milliseconds()
	r.LifetimeMS = life.Milliseconds()
	if err := checkTimeoutAction(req.GetTimeoutAction()); err != nil {
		return nil, err
	}
	r.TimeoutAction = req.GetTimeoutAction()
	keyReq := proto.Clone(req).(*kilnpb.CreateSandboxRequest)
	keyReq.RequestId = ""
	keyReq.Secrets = withoutValues(keyReq.Secrets) // no digest of a value on disk
	r.RequestID, r.RequestKey = req.GetRequestId(), requestKey("create", keyReq)

	began := time.Now()
	b, existing, warm, err := s.reserve(&r, life, tmpl)
	if err != nil {
		return nil, err
	}
	if existing {
		<-b.ready
		b.mu.Lock()
		key, cerr := b.rec.RequestKey, b.createErr
		b.mu.Unlock()
		if key != r.RequestKey {
			return nil, status.Errorf(codes.AlreadyExists, "request_id %q made sandbox %s with other parameters", r.RequestID, b.id)
		}
		if cerr != nil {
			return nil, cerr
		}
		return s.describe(b), nil
	}
	b.mu.Lock()
	b.secrets = secrets
	b.mu.Unlock()
	spec.Dir = b.rec.Dir
	spec.Hostname = hostname(b.id)
	if fromCk != nil {
		release, err := s.source(ctx, fromCk, &spec)
		if err != nil {
			s.mu.Lock()
			delete(s.requests, b.rec.RequestID) // a retry starts afresh
			s.mu.Unlock()
			s.failStart(b, err)
			return nil, err
		}
		defer release()
	}
	if warm != nil {
		if sb, err := s.handOut(b, warm, egress, began); err == nil {
			return sb, nil
		}
	}
	if withNet {
		n, err := s.attachNet(b.ctx, b.id, egress)
		if err != nil {
			s.mu.Lock()
			delete(s.requests, b.rec.RequestID) // a retry starts afresh
			s.mu.Unlock()
			s.failStart(b, err)
			return nil, err
		}
		b.mu.Lock()
		b.rec.Net = n
		s.persistLocked(b)
		b.mu.Unlock()
	}
	return s.start(b, spec)
}

// handOut makes the pool's sandbox w the reserved box b: its network's
// policy becomes egress (it waited with deny-all), and a new identity
// (entropy, clock, host name). When that fails the pool's sandbox is
// closed and the caller restores one instead.
func (s *Server) handOut(b *box, w *warmSandbox, egress EgressPolicy, began time.Time) (*kilnpb.Sandbox, error) {
	inst := w.inst
	ctx, cancel := context.WithTimeout(b.ctx, s.cfg.BootTimeout)
	var err error
	if w.net != nil {
		if err = s.cfg.Network.SetPolicy(ctx, w.net.ID, egress); err != nil {
			err = fmt.Errorf("set its egress policy: %w", err)
		}
	}
	if err == nil {
		err = inst.Refresh(ctx, hostname(b.id))
	}
	if err == nil {
		err = s.installSecrets(ctx, b, inst, true)
	}
	if err == nil {
		b.mu.Lock()
		vs := s.volumeAttaches(b.rec.Volumes)
		b.mu.Unlock()
		err = attachVolumes(ctx, inst, vs)
	}
	cancel()
	if err != nil {
		s.log.Warn("a pool's sandbox could not be handed out; restoring one instead", "sandbox", b.id, "err", err)
		s.closeWarm(w)
		return nil, err
	}
	os.RemoveAll(b.rec.Dir) // the pool's sandbox has a folder of its own
	b.mu.Lock()
	b.rec.FromPool = true
	if w.net != nil {
		b.rec.Net = w.net.clone()
		b.rec.Net.Egress = egress.clone()
	}
	s.publish(kilnpb.Event_KIND_CREATED, s.protoLocked(b), "")
	b.mu.Unlock()
	s.runningAs(b, startOp, inst, time.Since(began), kilnpb.Event_KIND_READY, nil) // an end waits for b.ready: none takes a start over
	close(b.ready)
	return s.describe(b), nil
}

// hostname is a sandbox's guest host name.
func hostname(id string) string { return strings.ReplaceAll(id, "_", "-") }

// resources resolves and checks a request's resources.
func (s *Server) resources(res *kilnpb.Resources) (cpus, mem uint32, err error) {
	cpus, mem = res.GetCpus(), res.GetMemoryMib()
	if cpus == 0 {
		cpus = s.cfg.DefaultCPUs
	}
	if mem == 0 {
		mem = s.cfg.DefaultMemoryMiB
	}
	if disk := res.GetDiskMib(); disk > mem {
		return 0, 0, status.Errorf(codes.InvalidArgument, "resources.disk_mib %d: the writable layer is guest RAM, at most memory_mib (%d)", disk, mem)
	}
	if int(cpus) > s.cfg.HostCPUs {
		return 0, 0, status.Errorf(codes.InvalidArgument, "resources.cpus %d: the host has %d CPUs", cpus, s.cfg.HostCPUs)
	}
	if err := limits.CheckCPUs(int(cpus)); err != nil {
		return 0, 0, status.Errorf(codes.InvalidArgument, "resources.cpus: %v", err)
	}
	if uint64(mem) > s.cfg.HostMemoryMiB {
		return 0, 0, status.Errorf(codes.InvalidArgument, "resources.memory_mib %d is more than the host has (%d MiB)", mem, s.cfg.HostMemoryMiB)
	}
	if err := limits.CheckMemory(int(mem)); err != nil {
		return 0, 0, status.Errorf(codes.InvalidArgument, "resources.memory_mib: %v", err)
	}
	return cpus, mem, nil
}

// reserve finds the sandbox r's request ID made, or makes a new starting
// one within the host's limits, recorded in the state folder. A create
// from template t gets a sandbox of its pool, when one is ready (warm).
func (s *Server) reserve(r *record, life time.Duration, t *template) (_ *box, existing bool, warm *warmSandbox, _ error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, false, nil, status.Error(codes.Unavailable, "kilnd is shutting down")
	}
	if b := s.requests[r.RequestID]; b != nil {
		return b, true, nil, nil
	}
	if t != nil {
		if t.deleting || s.templates[t.rec.ID] != t {
			return nil, false, nil, status.Errorf(codes.FailedPrecondition, "template %s is being deleted", t.rec.ID)
		}
		if t.pool != nil {
			warm = t.pool.takeLocked()
		}
	}
	err := s.admitLocked(1, uint64(r.MemoryMiB))
	if err == nil {
		err = s.admitVolumesLocked(r.Volumes)
	}
	if err != nil {
		if warm != nil {
			go s.closeWarm(warm)
		}
		return nil, false, nil, err
	}
	b := newBox(newID("sb-"))
	b.rec = *r
	b.rec.ID = b.id
	b.rec.Dir = filepath.Join(s.cfg.StateDir, sandboxesDir, b.id)
	now := s.clock.Now()
	b.rec.CreatedUnixMS = now.UnixMilli()
	if life > 0 {
		b.rec.ExpiresUnixMS = now.Add(life).UnixMilli()
	}
	b.lastActive = now
	if err := os.MkdirAll(b.rec.Dir, 0o700); err != nil {
		if warm != nil {
			go s.closeWarm(warm)
		}
		return nil, false, nil, status.Errorf(codes.Internal, "sandbox folder: %v", err)
	}
	s.boxes[b.id] = b
	s.requests[r.RequestID] = b
	b.mu.Lock()
	b.syncStateLocked() // starting
	s.persistLocked(b)
	b.mu.Unlock()
	return b, false, warm, nil
}

// admitLocked refuses n more sandboxes of mem MiB each beyond the host's
// limits: MaxSandboxes, MaxMemoryMiB of guest memory, and the memory
// commit (guest memory plus VMM overhead each) past MemoryOvercommit ×
// the host's memory; s.mu is held.
func (s *Server) admitLocked(n int, mem uint64) error {
	live, used, committed := s.commitLocked()
	if live+n > s.cfg.MaxSandboxes {
		return status.Errorf(codes.ResourceExhausted, "the host runs %d sandboxes (pools' and template builders' included), its limit is %d: %d more do not fit", live, s.cfg.MaxSandboxes, n)
	}
	if used+uint64(n)*mem > s.cfg.MaxMemoryMiB {
		return status.Errorf(codes.ResourceExhausted, "the host's sandboxes have %d MiB of guest memory; %d more MiB would pass its limit of %d MiB", used, uint64(n)*mem, s.cfg.MaxMemoryMiB)
	}
	add := uint64(n) * (mem + s.cfg.VMMOverheadMiB)
	if limit := s.commitLimit(); committed+add > limit {
		return status.Errorf(codes.ResourceExhausted, "the host's sandboxes commit %d MiB (guest memory plus %d MiB of VMM overhead each); %d more MiB would pass %d MiB, %g × the host's %d MiB (the memory overcommit ratio)",
			committed, s.cfg.VMMOverheadMiB, add, limit, s.cfg.MemoryOvercommit, s.cfg.HostMemoryMiB)
	}
	return nil
}

// start starts the reserved sandbox b and returns it running.
func (s *Server) start(b *box, spec CreateSpec) (*kilnpb.Sandbox, error) {
	b.mu.Lock()
	s.publish(kilnpb.Event_KIND_CREATED, s.protoLocked(b), "")
	b.mu.Unlock()
	began := time.Now()
	// Not the caller's context: a client that gives up leaves a sandbox
	// that a retry with the same request ID finds.
	ctx, cancel := s.bootCtx(b.ctx)
	b.mu.Lock()
	n := b.rec.Net.clone()
	b.mu.Unlock()
	inst, err := s.createNet(ctx, spec, n)
	if err == nil {
		if err = s.installSecrets(ctx, b, inst, true); err != nil {
			cctx, ccancel := context.WithTimeout(context.Background(), time.Minute)
			inst.Close(cctx)
			ccancel()
		}
	}
	cancel()
	if err != nil {
		err = callErr("sandbox "+b.id+" did not start", err)
		s.mu.Lock()
		delete(s.requests, b.rec.RequestID) // a retry starts afresh
		s.mu.Unlock()
		s.failStart(b, err)
		return nil, err
	}
	s.runningAs(b, startOp, inst, time.Since(began), kilnpb.Event_KIND_READY, nil) // an end waits for b.ready: none takes a start over
	close(b.ready)
	return s.describe(b), nil
}

// runningAs ends op (b's start, its wake from hibernation or its
// rollback) with b running as inst, ready after ready, and publishes
// kind; edit, when set, changes b's record under b.mu first. When b ended
// during op (an end took it over), inst is closed and runningAs says so.
func (s *Server) runningAs(b *box, op boxOp, inst Instance, ready time.Duration, kind kilnpb.Event_Kind, edit func(r *record)) error {
	b.mu.Lock()
	if _, ok := b.doneLocked(op, nil); !ok {
		b.mu.Unlock()
		cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		inst.Close(cctx)
		cancel()
		return status.Errorf(codes.FailedPrecondition, "sandbox %s ended during its %s", b.id, op)
	}
	if edit != nil {
		edit(&b.rec)
	}
	b.inst = inst
	b.rec.PID = inst.PID()
	b.rec.Dir = inst.Dir()
	b.rec.Cgroup = cgroupOf(inst)
	if d := inst.Image(); d != "" {
		b.rec.Image = d
	}
	b.rec.ReadyMS = ready.Milliseconds()
	b.lastActive = s.clock.Now()
	s.persistLocked(b)
	s.scheduleLocked(b)
	pb := s.protoLocked(b)
	b.mu.Unlock()
	s.watch(b, inst)
	s.sample(b, inst)
	s.publish(kind, pb, "")
	s.log.Info("sandbox running", "sandbox", b.id, "event", strings.ToLower(strings.TrimPrefix(kind.String(), "KIND_")), "ready_ms", pb.ReadyMs, "pid", pb.Pid)
	return nil
}

func (s *Server) describe(b *box) *kilnpb.Sandbox {
	b.mu.Lock()
	defer b.mu.Unlock()
	return s.protoLocked(b)
}

// GetSandbox describes a sandbox, live or ended.
func (s *Server) GetSandbox(ctx context.Context, req *kilnpb.GetSandboxRequest) (*kilnpb.Sandbox, error) {
	b, err := s.lookup(req.GetId())
	if err != nil {
		return nil, err
	}
	return s.describe(b), nil
}

// ListSandboxes lists the sandboxes with all of the labels asked for, in
// the states asked for (live ones when none), oldest first.
func (s *Server) ListSandboxes(ctx context.Context, req *kilnpb.ListSandboxesRequest) (*kilnpb.ListSandboxesResponse, error) {
	states := map[kilnpb.SandboxState]bool{}
	for _, st := range req.GetStates() {
		if _, ok := kilnpb.SandboxState_name[int32(st)]; !ok || st == kilnpb.SandboxState_SANDBOX_STATE_UNSPECIFIED {
			return nil, status.Errorf(codes.InvalidArgument, "states: %d is not a sandbox state", st)
		}
		states[st] = true
	}
	s.mu.Lock()
	boxes := make([]*box, 0, len(s.boxes))
	for _, b := range s.boxes {
		boxes = append(boxes, b)
	}
	s.mu.Unlock()
	var out []*kilnpb.Sandbox
	for _, b := range boxes {
		sb := s.describe(b)
		if len(states) > 0 && !states[sb.State] || len(states) == 0 && !isLive(sb.State) {
			continue
		}
		if hasLabels(sb.Labels, req.GetLabels()) {
			out = append(out, sb)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].CreatedUnixMs != out[j].CreatedUnixMs {
			return out[i].CreatedUnixMs < out[j].CreatedUnixMs
		}
		return out[i].Id < out[j].Id
	})
	return &kilnpb.ListSandboxesResponse{Sandboxes: out}, nil
}

// DestroySandbox stops a sandbox and removes everything it held on the
// host. Destroying an ended sandbox succeeds and changes nothing.
func (s *Server) DestroySandbox(ctx context.Context, req *kilnpb.DestroySandboxRequest) (*kilnpb.DestroySandboxResponse, error) {
	b, err := s.lookup(req.GetId())
	if err != nil {
		return nil, err
	}
	s.end(b, destroyOp, "destroyed on request")
	return &kilnpb.DestroySandboxResponse{}, nil
}

// PauseSandbox pauses a running sandbox's vCPUs or, with hibernate,
// hibernates it (hibernate.go).
func (s *Server) PauseSandbox(ctx context.Context, req *kilnpb.PauseSandboxRequest) (*kilnpb.Sandbox, error) {
	if req.GetHibernate() {
		return s.hibernateCall(ctx, req.GetId(), req.GetFilesOnly())
	}
	if req.GetFilesOnly() {
		return nil, status.Error(codes.InvalidArgument, "files_only is a hibernation's: set hibernate too")
	}
	return s.pauseResume(ctx, req.GetId(), true)
}

// ResumeSandbox resumes a paused sandbox, or restores a hibernated one.
func (s *Server) ResumeSandbox(ctx context.Context, req *kilnpb.ResumeSandboxRequest) (*kilnpb.Sandbox, error) {
	b, err := s.lookup(req.GetId())
	if err != nil {
		return nil, err
	}
	if b.life.get() == boxHibernated {
		return s.wake(ctx, b)
	}
	return s.pauseResume(ctx, req.GetId(), false)
}

func (s *Server) pauseResume(ctx context.Context, id string, pause bool) (*kilnpb.Sandbox, error) {
	b, err := s.lookup(id)
	if err != nil {
		return nil, err
	}
	op, kind := pauseOp, kilnpb.Event_KIND_PAUSED
	if !pause {
		op, kind = resumeOp, kilnpb.Event_KIND_RESUMED
	}
	// b.mu is held throughout, the call to its machine included: no
	// other call sees it pausing or resuming.
	b.mu.Lock()
	defer b.mu.Unlock()
	st, err := b.life.check(op)
	if pause && (st == boxPaused || st == boxHibernated) || !pause && st == boxRunning {
		return s.protoLocked(b), nil // already so (a hibernated one too)
	}
	if err != nil {
		return nil, err
	}
	if b.busy > b.streams && pause {
		return nil, status.Errorf(codes.FailedPrecondition, "sandbox %s has %d calls in flight: cannot pause it", id, b.busy-b.streams)
	}
	b.beginLocked(op) // checked above, under b.mu
	call := b.inst.Resume
	if pause {
		call = b.inst.Pause
	}
	err = call(ctx)
	b.doneLocked(op, err)
	if err != nil {
		return nil, callErr(op.String()+" sandbox "+id, err)
	}
	b.lastActive = s.clock.Now()
	s.persistLocked(b)
	pb := s.protoLocked(b)
	s.publish(kind, pb, "")
	return pb, nil
}

// scheduleLocked arms b's timer for its next deadline (lifetime or idle
// timeout); b.mu is held.
func (s *Server) scheduleLocked(b *box) {
	if b.timer != nil {
		b.timer.Stop()
		b.timer = nil
	}
	if st := b.life.get(); st != boxRunning && st != boxPaused {
		// Its start, wake or rollback arms it once it runs; a hibernated
		// one's lifetime stands still.
		return
	}
	var next time.Time
	if b.rec.ExpiresUnixMS > 0 {
		next = time.UnixMilli(b.rec.ExpiresUnixMS)
	}
	if idle := time.Duration(b.rec.IdleTimeoutMS) * time.Millisecond; idle > 0 {
		if t := b.lastActive.Add(idle); next.IsZero() || t.Before(next) {
			next = t
		}
	}
	if next.IsZero() {
		return
	}
	d := next.Sub(s.clock.Now())
	if d < 0 {
		d = 0
	}
	b.timer = s.clock.AfterFunc(d, func() { s.checkTimeouts(b) })
}

// checkTimeouts ends b if its lifetime or idle timeout has passed, and
// arms its timer for the next deadline otherwise.
func (s *Server) checkTimeouts(b *box) {
	if s.ctx.Err() != nil {
		return
	}
	b.mu.Lock()
	if _, err := b.life.check(timeoutOp); err != nil {
		b.mu.Unlock()
		return // only a running or paused sandbox times out
	}
	now := s.clock.Now()
	reason := ""
	idle := time.Duration(b.rec.IdleTimeoutMS) * time.Millisecond
	switch {
	case b.rec.ExpiresUnixMS > 0 && now.UnixMilli() >= b.rec.ExpiresUnixMS:
		life := time.Duration(b.rec.LifetimeMS) * time.Millisecond
		if life <= 0 {
			life = time.Duration(b.rec.ExpiresUnixMS-b.rec.CreatedUnixMS) * time.Millisecond
		}
		reason = fmt.Sprintf("its lifetime of %v ended", life)
		if act := b.rec.TimeoutAction; act == kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE || act == kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE_FILES {
			b.mu.Unlock()
			s.timeoutHibernate(b, reason, act == kilnpb.TimeoutAction_TIMEOUT_ACTION_HIBERNATE_FILES)
			return
		}
	case idle > 0 && b.busy == 0 && now.Sub(b.lastActive) >= idle:
		reason = fmt.Sprintf("no exec or file call for %v (its idle timeout)", idle)
	}
	if reason == "" {
		if idle > 0 && b.busy > 0 && now.Sub(b.lastActive) >= idle {
			b.lastActive = now // busy counts as active
		}
		s.scheduleLocked(b)
		b.mu.Unlock()
		return
	}
	b.mu.Unlock()
	s.end(b, timeoutOp, reason)
}

// hostMemoryMiB reads the host's memory from /proc/meminfo (0 when it
// cannot).
func hostMemoryMiB() uint64 {
	f, err := os.Open("/proc/meminfo")
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "MemTotal:" {
			kb, err := strconv.ParseUint(fields[1], 10, 64)
			if err == nil {
				return kb / 1024
			}
		}
	}
	return 0
}

func hostCPUs() int { return runtime.NumCPU() }
