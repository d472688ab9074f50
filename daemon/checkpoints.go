package daemon

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// maxFork is the most children one Fork makes.
const maxFork = 256

// forkRequest is what a fork's request ID made.
type forkRequest struct {
	key      string
	children []string
	done     chan struct{} // closed once the fork has finished
	err      error
}

func isForkKey(key string) bool { return strings.HasPrefix(key, "fork:") }

// forgetForkChildLocked drops the pruned child id from the fork request
// req's index entry, and the entry once it has no child left and its fork
// has finished: a request ID is remembered as long as one of the
// children it made is, and is then forgotten (a retry with it is a new
// fork, not an empty success). s.mu is held.
func (s *Server) forgetForkChildLocked(req, id string) {
	f := s.forks[req]
	if f == nil {
		return
	}
	f.children = slices.DeleteFunc(f.children, func(c string) bool { return c == id })
	s.pruneForkLocked(req, f)
}

// pruneForkLocked forgets the fork request req when it has finished and
// none of its children is left. s.mu is held.
func (s *Server) pruneForkLocked(req string, f *forkRequest) {
	if len(f.children) > 0 || s.forks[req] != f {
		return
	}
	select {
	case <-f.done:
		delete(s.forks, req)
	default: // in flight: Fork prunes it when it finishes
	}
}

func (s *Server) checkpointPath(id string) string {
	return filepath.Join(s.cfg.StateDir, checkpointsDir, id+".json")
}

// checkpoint returns the checkpoint id names.
func (s *Server) checkpoint(id string) (*checkpointRecord, error) {
	if err := checkID("checkpoint ID", id); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	c := s.checkpoints[id]
	if c == nil {
		return nil, status.Errorf(codes.NotFound, "no checkpoint %q", id)
	}
	cc := *c
	return &cc, nil
}

func (s *Server) checkpointResources(c *checkpointRecord) (cpus, mem uint32) {
	return c.CPUs, c.MemoryMiB
}

func checkpointInfo(c *checkpointRecord) *kilnpb.CheckpointInfo {
	return &kilnpb.CheckpointInfo{Id: c.ID, SandboxId: c.SandboxID, ParentId: c.ParentID,
		CreatedUnixMs: c.CreatedUnixMS, Persisted: c.Persisted, Keep: c.Keep}
}

// Checkpoint saves a running sandbox's state (memory, devices, the
// guest's files in RAM) as a checkpoint, the child of its last
// checkpoint or rollback target; the sandbox runs on. By default the
// checkpoint is in memory: a frozen base the sandbox's VMM process holds
// (Instance.Hold), no memory file written, gone with the sandbox. With
// persist (or keep, which outlives the sandbox) it is written to the
// state folder.
func (s *Server) Checkpoint(ctx context.Context, req *kilnpb.CheckpointRequest) (*kilnpb.CheckpointInfo, error) {
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	defer done()
	persist := req.GetPersist() || req.GetKeep()
	b.mu.Lock()
	if len(b.rec.Volumes) > 0 {
		b.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "checkpoint sandbox %s: it mounts volume %s, whose files a checkpoint would not keep (a restore would see them as they were)", b.id, b.rec.Volumes[0].ID)
	}
	c := &checkpointRecord{
		ID: newID("ck-"), SandboxID: b.id, ParentID: b.rec.LastCheckpoint,
		Persisted: persist, Keep: req.GetKeep(),
		CPUs: b.rec.CPUs, MemoryMiB: b.rec.MemoryMiB, Image: b.rec.Image, Env: b.rec.Env,
	}
	if n := b.rec.Net; n != nil {
		eg := n.Egress.clone()
		c.Net, c.Egress = true, &eg
	}
	b.mu.Unlock()
	if persist {
		c.Dir = filepath.Join(s.cfg.StateDir, checkpointsDir, c.ID)
		if err := inst.Save(ctx, c.Dir); err != nil {
			os.RemoveAll(c.Dir)
			return nil, callErr("checkpoint sandbox "+b.id, err)
		}
	} else {
		// The hold's base is the VMM process's to pay for, and the
		// guest's writes after it are copies on top: room for both first.
		s.growCgroup(b, 1)
		if err := inst.Hold(ctx, c.ID); err != nil {
			return nil, callErr("checkpoint sandbox "+b.id+" in memory", err)
		}
	}
	c.CreatedUnixMS = s.clock.Now().UnixMilli()
	// An in-memory checkpoint's record needs no sync: a crash of the
	// host takes its VMM process (and the checkpoint) too.
	if err := writeRecord(s.checkpointPath(c.ID), c, persist); err != nil {
		s.dropCheckpointData(c, inst)
		return nil, status.Errorf(codes.Internal, "checkpoint sandbox %s: %v", b.id, err)
	}
	s.mu.Lock()
	s.checkpoints[c.ID] = c
	s.mu.Unlock()
	b.mu.Lock()
	b.rec.LastCheckpoint = c.ID
	s.persistLocked(b)
	b.mu.Unlock()
	return checkpointInfo(c), nil
}

// dropCheckpointData removes what c keeps: its folder, or its hold in
// inst (the sandbox's instance, nil once it ended).
func (s *Server) dropCheckpointData(c *checkpointRecord, inst Instance) error {
	if c.Persisted {
		return os.RemoveAll(c.Dir)
	}
	if inst == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	return inst.Release(ctx, c.ID)
}

// frozen hands out the in-memory checkpoint c from its sandbox's VMM
// process.
func (s *Server) frozen(ctx context.Context, c *checkpointRecord) (Frozen, error) {
	b, err := s.lookup(c.SandboxID)
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "checkpoint %s is gone with its sandbox %s", c.ID, c.SandboxID)
	}
	b.mu.Lock()
	st, err := b.life.check(lendOp)
	inst := b.inst
	b.mu.Unlock()
	if err != nil {
		return nil, status.Errorf(codes.FailedPrecondition, "checkpoint %s is held in memory by sandbox %s, which is %s now", c.ID, c.SandboxID, st)
	}
	return frozenOf(ctx, inst, c)
}

// frozenOf hands out the in-memory checkpoint c from inst, its holder.
func frozenOf(ctx context.Context, inst Instance, c *checkpointRecord) (Frozen, error) {
	f, err := inst.Frozen(ctx, c.ID)
	if errors.Is(err, ErrNotHeld) {
		return nil, status.Errorf(codes.NotFound, "checkpoint %s: its sandbox %s no longer holds it", c.ID, c.SandboxID)
	}
	if err != nil {
		return nil, callErr("checkpoint "+c.ID, err)
	}
	return f, nil
}

// source fills spec from checkpoint c: its folder, or a Frozen of it
// that the caller closes (release).
func (s *Server) source(ctx context.Context, c *checkpointRecord, spec *CreateSpec) (release func(), err error) {
	if c.Persisted {
		spec.Checkpoint = c.Dir
		return func() {}, nil
	}
	f, err := s.frozen(ctx, c)
	if err != nil {
		return nil, err
	}
	spec.Frozen = f
	return func() { f.Close() }, nil
}

// ListCheckpoints lists a sandbox's checkpoints, oldest first: a tree by
// parent_id.
func (s *Server) ListCheckpoints(ctx context.Context, req *kilnpb.ListCheckpointsRequest) (*kilnpb.ListCheckpointsResponse, error) {
	if _, err := s.lookup(req.GetSandboxId()); err != nil {
		if status.Code(err) != codes.NotFound {
			return nil, err
		}
		// A forgotten sandbox may have left checkpoints it kept.
		if !s.hasCheckpoints(req.GetSandboxId()) {
			return nil, err
		}
	}
	s.mu.Lock()
	var out []*kilnpb.CheckpointInfo
	for _, c := range s.checkpoints {
		if c.SandboxID == req.GetSandboxId() {
			out = append(out, checkpointInfo(c))
		}
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool {
		if out[i].CreatedUnixMs != out[j].CreatedUnixMs {
			return out[i].CreatedUnixMs < out[j].CreatedUnixMs
		}
		return out[i].Id < out[j].Id
	})
	return &kilnpb.ListCheckpointsResponse{Checkpoints: out}, nil
}

func (s *Server) hasCheckpoints(sandboxID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.checkpoints {
		if c.SandboxID == sandboxID {
			return true
		}
	}
	return false
}

// DeleteCheckpoint deletes a checkpoint that has no child checkpoints.
// Sandboxes restored from it run on (their memory is theirs).
func (s *Server) DeleteCheckpoint(ctx context.Context, req *kilnpb.DeleteCheckpointRequest) (*kilnpb.DeleteCheckpointResponse, error) {
	c, err := s.checkpoint(req.GetId())
	if err != nil {
		return nil, err
	}
	s.mu.Lock()
	for _, o := range s.checkpoints {
		if o.ParentID == c.ID {
			s.mu.Unlock()
			return nil, status.Errorf(codes.FailedPrecondition, "checkpoint %s has a child checkpoint %s: delete that first", c.ID, o.ID)
		}
	}
	delete(s.checkpoints, c.ID)
	s.mu.Unlock()
	var inst Instance
	if b, err := s.lookup(c.SandboxID); err == nil {
		b.mu.Lock()
		inst = b.inst
		b.mu.Unlock()
	}
	if err := s.removeCheckpoint(c, inst); err != nil {
		return nil, status.Errorf(codes.Internal, "delete checkpoint %s: %v", c.ID, err)
	}
	return &kilnpb.DeleteCheckpointResponse{}, nil
}

// removeCheckpoint removes c's record and what it keeps (inst holds it
// when it is in memory and its sandbox runs).
func (s *Server) removeCheckpoint(c *checkpointRecord, inst Instance) error {
	return errors.Join(os.Remove(s.checkpointPath(c.ID)), s.dropCheckpointData(c, inst))
}

// gcCheckpoints deletes the checkpoints of the ended sandbox id but those
// it was asked to keep (which are persisted: its in-memory ones went with
// its VMM process).
func (s *Server) gcCheckpoints(id string) {
	s.mu.Lock()
	var gone []*checkpointRecord
	for _, c := range s.checkpoints {
		if c.SandboxID == id && !c.Keep {
			gone = append(gone, c)
			delete(s.checkpoints, c.ID)
		}
	}
	s.mu.Unlock()
	for _, c := range gone {
		if err := s.removeCheckpoint(c, nil); err != nil {
			s.log.Warn("checkpoint not removed", "checkpoint", c.ID, "err", err)
		}
	}
}

// Rollback restores a sandbox in place to one of its checkpoints: the
// same ID, its processes and memory as they were at the checkpoint. Its
// execs end.
func (s *Server) Rollback(ctx context.Context, req *kilnpb.RollbackRequest) (_ *kilnpb.Sandbox, err error) {
	called := time.Now()
	defer func() { s.metrics.opDone(opRollback, called, err) }()
	b, err := s.lookup(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	c, err := s.checkpoint(req.GetCheckpointId())
	if err != nil {
		return nil, err
	}
	b.mu.Lock()
	origin := b.rec.Checkpoint
	b.mu.Unlock()
	if c.SandboxID != b.id && c.ID != origin {
		return nil, status.Errorf(codes.FailedPrecondition, "checkpoint %s is sandbox %s's: a sandbox rolls back only to its own checkpoints and the one it was made from (create or fork from it instead)", c.ID, c.SandboxID)
	}
	b.mu.Lock()
	if _, err := b.life.check(rollbackOp); err != nil {
		b.mu.Unlock()
		return nil, err // only a running sandbox rolls back
	}
	// In place on its network: the old machine lets go of the tap (it
	// is closed below) before the new one opens it, with the same
	// address and MAC.
	n := b.rec.Net.clone()
	if c.Net != (n != nil) {
		b.mu.Unlock()
		return nil, status.Errorf(codes.FailedPrecondition, "checkpoint %s and sandbox %s differ in having a network card", c.ID, b.id)
	}
	b.beginLocked(rollbackOp) // checked above, under b.mu
	old := b.inst
	b.inst = nil // the rollback holds it: an end meanwhile leaves it to the rollback
	if b.timer != nil {
		b.timer.Stop()
	}
	dir := b.rec.Dir
	b.mu.Unlock()

	began := time.Now()
	// What the new machine starts from, and the sandbox's in-memory
	// checkpoints, which the old machine's VMM process holds: the new
	// one's holds them next.
	spec := CreateSpec{Dir: dir, Hostname: hostname(b.id), CPUs: int(b.rec.CPUs), MemoryMiB: int(b.rec.MemoryMiB)}
	release, moved, err := s.rollbackSources(ctx, b, old, c, &spec)
	if err != nil {
		// Nothing changed: it runs on as it was.
		b.mu.Lock()
		_, mine := b.doneLocked(rollbackOp, err)
		if mine {
			b.inst = old
			s.scheduleLocked(b)
		}
		b.mu.Unlock()
		if !mine {
			// Destroyed (or timed out) meanwhile, while the old machine
			// was out of its box's hands: it goes here.
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			old.Close(cctx)
			cancel()
		}
		return nil, err
	}
	defer release()
	defer func() {
		for _, f := range moved {
			f.Close()
		}
	}()
	b.mu.Lock()
	b.cancel()
	b.ctx, b.cancel = context.WithCancel(context.Background())
	bctx := b.ctx
	b.mu.Unlock()
	cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	if err := old.Close(cctx); err != nil {
		s.log.Warn("rollback: closing the old machine", "sandbox", b.id, "err", err)
	}
	cancel()
	// Its old machine is gone: a failure from here on ends it as
	// failed, unless an end (a destroy, say) took it over meanwhile:
	// that stands (its gate refuses this one).
	fail := func(err error) (*kilnpb.Sandbox, error) {
		err = callErr("roll sandbox "+b.id+" back to "+c.ID, err)
		s.end(b, failOp, status.Convert(err).Message())
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fail(err)
	}
	rctx, cancel := s.bootCtx(bctx)
	inst, err := s.createNet(rctx, spec, n)
	if err == nil {
		// The sandbox keeps its secrets: kept by the new VMM process,
		// its files written again (the target may predate them).
		if err = s.installSecrets(rctx, b, inst, true); err != nil {
			inst.Close(context.Background())
		}
	}
	cancel()
	if err != nil {
		return fail(err)
	}
	for _, f := range moved {
		actx, cancel := context.WithTimeout(bctx, time.Minute)
		if err := inst.Adopt(actx, f); err != nil {
			s.log.Warn("rollback: an in-memory checkpoint is lost", "sandbox", b.id, "checkpoint", f.ID(), "err", err)
			s.forgetCheckpoint(f.ID())
		}
		cancel()
	}
	// Destroyed meanwhile: runningAs closes the new machine too.
	err = s.runningAs(b, rollbackOp, inst, time.Since(began), kilnpb.Event_KIND_ROLLED_BACK, func(r *record) {
		r.Checkpoint, r.LastCheckpoint = c.ID, c.ID
	})
	if err != nil {
		return nil, err
	}
	return s.describe(b), nil
}

// rollbackSources fills spec from the rollback target c and hands out
// the in-memory checkpoints that b's old machine holds (moved), for the
// new machine to adopt. release lets go of the target's Frozen.
func (s *Server) rollbackSources(ctx context.Context, b *box, old Instance, c *checkpointRecord, spec *CreateSpec) (release func(), moved []Frozen, err error) {
	release = func() {}
	switch {
	case c.Persisted:
		spec.Checkpoint = c.Dir
	case c.SandboxID == b.id:
		f, err := frozenOf(ctx, old, c)
		if err != nil {
			return nil, nil, err
		}
		spec.Frozen, release = f, func() { f.Close() }
	default:
		if release, err = s.source(ctx, c, spec); err != nil {
			return nil, nil, err
		}
	}
	s.mu.Lock()
	var mine []string
	for _, o := range s.checkpoints {
		if o.SandboxID == b.id && !o.Persisted {
			mine = append(mine, o.ID)
		}
	}
	s.mu.Unlock()
	for _, id := range mine {
		f, err := old.Frozen(ctx, id)
		if errors.Is(err, ErrNotHeld) {
			s.forgetCheckpoint(id)
			continue
		}
		if err != nil {
			release()
			for _, m := range moved {
				m.Close()
			}
			return nil, nil, callErr("roll sandbox "+b.id+" back: hand over checkpoint "+id, err)
		}
		moved = append(moved, f)
	}
	return release, moved, nil
}

// forgetCheckpoint drops the record of a checkpoint whose data is gone.
func (s *Server) forgetCheckpoint(id string) {
	s.mu.Lock()
	delete(s.checkpoints, id)
	s.mu.Unlock()
	os.Remove(s.checkpointPath(id))
}

// Fork makes children of a running sandbox (as it is now) or of a
// checkpoint, streaming each once it answers.
func (s *Server) Fork(req *kilnpb.ForkRequest, stream kilnpb.Kiln_ForkServer) (err error) {
	forked := time.Now()
	defer func() {
		s.metrics.opDone(opFork, forked, err)
		if err == nil {
			s.metrics.forkChildren.Add(float64(req.GetCount()))
		}
	}()
	if err := checkRequestID(req.GetRequestId()); err != nil {
		return err
	}
	n := int(req.GetCount())
	if n < 1 || n > maxFork {
		return status.Errorf(codes.InvalidArgument, "count %d: want 1 to %d children", req.GetCount(), maxFork)
	}
	if err := checkLabels("labels", req.GetLabels()); err != nil {
		return err
	}
	life, idle, err := s.lifetimes(req.GetLifetimeMs(), req.GetIdleTimeoutMs())
	if err != nil {
		return err
	}
	tmpl := record{Labels: req.GetLabels(), IdleTimeoutMS: idle.Milliseconds(), RequestID: req.GetRequestId()}
	keyReq := proto.Clone(req).(*kilnpb.ForkRequest)
	keyReq.RequestId = ""
	tmpl.RequestKey = requestKey("fork", keyReq)

	var parent Instance
	var parentSecrets []secret // the children's (a fork from a sandbox)
	var ck *checkpointRecord
	// The children's networks: the parent's policy, each its own
	// attachment (nil: the parent has no card).
	var egress *EgressPolicy
	switch src := req.GetSource().(type) {
	case nil:
		return status.Error(codes.InvalidArgument, "no source: give a sandbox_id or a checkpoint_id")
	case *kilnpb.ForkRequest_SandboxId:
		saved, secs, eg, release, err := s.savedSource(src.SandboxId, &tmpl)
		if err != nil {
			return err
		}
		if saved != nil { // hibernated: the children restore its saved state
			defer release()
			ck, parentSecrets, egress = saved, secs, eg
			if _, err := s.sourceNet("sandbox "+src.SandboxId, egress != nil, false); err != nil {
				return err
			}
			break
		}
		b, inst, done, err := s.use(src.SandboxId)
		if err != nil {
			return err
		}
		defer done()
		parent = inst
		b.mu.Lock()
		if err := forkVolumes(b, &tmpl); err != nil {
			b.mu.Unlock()
			return err
		}
		tmpl.Parent, tmpl.CPUs, tmpl.MemoryMiB, tmpl.Image, tmpl.Env = b.id, b.rec.CPUs, b.rec.MemoryMiB, b.rec.Image, b.rec.Env
		tmpl.LastCheckpoint = b.rec.LastCheckpoint
		tmpl.SecretNames, parentSecrets = b.rec.SecretNames, cloneSecrets(b.secrets)
		if n := b.rec.Net; n != nil {
			eg := n.Egress.clone()
			egress = &eg
		}
		b.mu.Unlock()
		if _, err := s.sourceNet("sandbox "+b.id, egress != nil, false); err != nil {
			return err
		}
		// The fork freezes the parent's memory into a base its VMM
		// process keeps; its writes after it are copies on top.
		b.mu.Lock()
		b.rec.Frozen = true
		s.persistLocked(b)
		b.mu.Unlock()
		s.growCgroup(b, 0)
	case *kilnpb.ForkRequest_CheckpointId:
		if ck, err = s.checkpoint(src.CheckpointId); err != nil {
			return err
		}
		tmpl.Checkpoint, tmpl.LastCheckpoint = ck.ID, ck.ID
		tmpl.CPUs, tmpl.MemoryMiB, tmpl.Image, tmpl.Env = ck.CPUs, ck.MemoryMiB, ck.Image, ck.Env
		if _, err := s.sourceNet("checkpoint "+ck.ID, ck.Net, false); err != nil {
			return err
		}
		if ck.Net {
			eg := s.cfg.DefaultEgress.clone()
			if ck.Egress != nil {
				eg = ck.Egress.clone()
			}
			egress = &eg
		}
	}

	var sendMu sync.Mutex
	send := func(sb *kilnpb.Sandbox) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return stream.Send(sb)
	}
	f, boxes, existing, err := s.reserveFork(&tmpl, n, life)
	if err != nil {
		return err
	}
	if existing {
		<-f.done
		if f.key != tmpl.RequestKey {
			return status.Errorf(codes.AlreadyExists, "request_id %q made a fork with other parameters", tmpl.RequestID)
		}
		s.mu.Lock()
		children := slices.Clone(f.children) // pruning edits them
		s.mu.Unlock()
		for _, id := range children {
			if b, err := s.lookup(id); err == nil {
				if err := send(s.describe(b)); err != nil {
					return err
				}
			}
		}
		return f.err
	}
	defer func() {
		close(f.done)
		// Children that failed to start and were pruned meanwhile.
		s.mu.Lock()
		s.pruneForkLocked(tmpl.RequestID, f)
		s.mu.Unlock()
	}()
	for _, b := range boxes {
		b.mu.Lock()
		b.secrets = cloneSecrets(parentSecrets)
		b.mu.Unlock()
	}
	for _, b := range boxes {
		s.publish(kilnpb.Event_KIND_CREATED, s.describe(b), "")
	}
	began := time.Now()
	if parent != nil {
		f.err = s.forkSandbox(stream.Context(), parent, boxes, egress, began, send)
	} else {
		f.err = s.forkCheckpoint(context.WithoutCancel(stream.Context()), ck, boxes, egress, began, send)
	}
	return f.err
}

// savedSource is what a fork of sandbox id restores its children from
// when the sandbox is hibernated: its saved state, linked (not copied)
// into a folder of the fork's own under the gate's forkSavedOp, so that a
// resume or destroy of the sandbox meanwhile takes nothing from under
// the children (release removes the links). It fills tmpl as a fork of
// the sandbox would and returns the sandbox's secrets and egress policy
// for the children. A sandbox that is not hibernated returns no source
// (its machine is forked).
func (s *Server) savedSource(id string, tmpl *record) (c *checkpointRecord, secrets []secret, egress *EgressPolicy, release func(), err error) {
	b, err := s.lookup(id)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.life.check(forkSavedOp); err != nil {
		return nil, nil, nil, nil, nil
	}
	if err := forkVolumes(b, tmpl); err != nil {
		return nil, nil, nil, nil, err
	}
	dir, err := os.MkdirTemp(filepath.Join(s.cfg.StateDir, hibernatedDir), ".fork-"+b.id+"-")
	if err != nil {
		return nil, nil, nil, nil, status.Errorf(codes.Internal, "fork of hibernated sandbox %s: %v", id, err)
	}
	if err := linkTree(b.rec.HibernateDir, dir); err != nil {
		os.RemoveAll(dir)
		return nil, nil, nil, nil, status.Errorf(codes.Internal, "fork of hibernated sandbox %s: its saved state: %v", id, err)
	}
	c = &checkpointRecord{SandboxID: b.id, Dir: dir, Persisted: true,
		CPUs: b.rec.CPUs, MemoryMiB: b.rec.MemoryMiB, Image: b.rec.Image, Env: b.rec.Env, Net: b.rec.Net != nil,
		FilesOnly: b.rec.FilesOnly, DiskMiB: b.rec.DiskMiB, Init: b.rec.Init}
	if n := b.rec.Net; n != nil {
		eg := n.Egress.clone()
		c.Egress, egress = &eg, &eg
	}
	tmpl.Parent, tmpl.CPUs, tmpl.MemoryMiB, tmpl.Image, tmpl.Env = b.id, b.rec.CPUs, b.rec.MemoryMiB, b.rec.Image, b.rec.Env
	tmpl.DiskMiB, tmpl.Init = b.rec.DiskMiB, b.rec.Init
	tmpl.LastCheckpoint = b.rec.LastCheckpoint
	tmpl.SecretNames = b.rec.SecretNames
	return c, cloneSecrets(b.secrets), egress, func() { os.RemoveAll(dir) }, nil
}

// linkTree hard-links the files of folder src into folder dst (which
// exists), its subfolders made anew.
func linkTree(src, dst string) error {
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil || rel == "." {
			return err
		}
		to := filepath.Join(dst, rel)
		switch {
		case d.IsDir():
			return os.Mkdir(to, 0o700)
		case d.Type().IsRegular():
			return os.Link(p, to)
		}
		return fmt.Errorf("%s is neither a file nor a folder", p)
	})
}

// forkSandbox makes the children boxes of the running parent, each in a
// cgroup of its own and, when the parent has a network, on a network of
// its own with policy egress.
func (s *Server) forkSandbox(ctx context.Context, parent Instance, boxes []*box, egress *EgressPolicy, began time.Time, send func(*kilnpb.Sandbox) error) error {
	hosts, undoHosts, err := s.forkHosts(boxes, int(boxes[0].rec.CPUs), int(boxes[0].rec.MemoryMiB))
	if err != nil {
		for _, b := range boxes {
			s.failStart(b, err)
		}
		return err
	}
	nets := make([]*netRecord, len(boxes))
	if egress != nil {
		for i, b := range boxes {
			// Not the caller's context: the fork goes on without it.
			n, err := s.attachNet(context.WithoutCancel(ctx), b.id, *egress)
			if err != nil {
				undoHosts()
				for _, b := range boxes {
					s.failStart(b, err) // and detaches those attached
				}
				return err
			}
			b.mu.Lock()
			b.rec.Net = n
			s.persistLocked(b)
			b.mu.Unlock()
			nets[i], hosts[i].Net = n, hostSpec(n).Net
		}
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), s.cfg.BootTimeout)
	kids, err := parent.Fork(fctx, hosts)
	if err != nil {
		cancel()
		undoHosts()
		err = callErr("fork", err)
		for _, b := range boxes {
			s.failStart(b, err)
		}
		return err
	}
	errs := make([]error, len(boxes))
	var wg sync.WaitGroup
	for i := range boxes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = configureNet(fctx, kids[i], nets[i])
		}()
	}
	wg.Wait()
	cancel()
	var firstErr error
	for i, b := range boxes {
		kids[i] = s.inCgroup(kids[i], b.id, hosts[i].Cgroup, int(b.rec.MemoryMiB))
		if errs[i] == nil {
			os.RemoveAll(b.rec.Dir) // the child has a folder of its own
			// The child's memory has its parent's secret files; its VMM
			// process keeps the secrets too.
			kctx, kcancel := context.WithTimeout(b.ctx, time.Minute)
			errs[i] = s.installSecrets(kctx, b, kids[i], false)
			kcancel()
		}
		if errs[i] != nil {
			err := callErr("fork child "+b.id, errs[i])
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			kids[i].Close(cctx)
			cancel()
			s.failStart(b, err)
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		s.runningAs(b, startOp, kids[i], time.Since(began), kilnpb.Event_KIND_READY, nil) // an end waits for b.ready
		close(b.ready)
	}
	for i, b := range boxes {
		if errs[i] != nil {
			continue
		}
		if err := send(s.describe(b)); err != nil {
			return err
		}
	}
	return firstErr
}

// forkCheckpoint restores the children boxes from checkpoint c, all at
// once, each on a network of its own with policy egress when c has a
// card, sending each as it answers.
func (s *Server) forkCheckpoint(ctx context.Context, c *checkpointRecord, boxes []*box, egress *EgressPolicy, began time.Time, send func(*kilnpb.Sandbox) error) error {
	var base CreateSpec
	release, err := func() {}, error(nil)
	if c.FilesOnly {
		// Each child boots the image anew and applies the saved files.
		base = CreateSpec{Image: c.Image, WritableMiB: int(c.DiskMiB), Init: c.Init}
	} else {
		release, err = s.source(ctx, c, &base)
	}
	if err != nil {
		for _, b := range boxes {
			s.failStart(b, err)
		}
		return err
	}
	defer release()
	errs := make([]error, len(boxes))
	var wg sync.WaitGroup
	for i, b := range boxes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var n *netRecord
			if egress != nil {
				var err error
				if n, err = s.attachNet(b.ctx, b.id, *egress); err != nil {
					errs[i] = err
					s.failStart(b, err)
					return
				}
				b.mu.Lock()
				b.rec.Net = n
				s.persistLocked(b)
				b.mu.Unlock()
			}
			ctx, cancel := s.bootCtx(b.ctx)
			spec := base
			spec.Dir, spec.Hostname = b.rec.Dir, hostname(b.id)
			spec.Volumes = s.volumeAttaches(b.rec.Volumes)
			spec.CPUs, spec.MemoryMiB = int(b.rec.CPUs), int(b.rec.MemoryMiB)
			inst, err := s.createNet(ctx, spec, n)
			if err == nil && c.FilesOnly {
				if err = importWritable(ctx, inst, filepath.Join(c.Dir, writableFile)); err != nil {
					inst.Close(context.Background())
				}
			}
			if err == nil {
				// A hibernated sandbox's child: its memory has the
				// parent's secret files (a boot's has not: they are
				// written again); its VMM process keeps them too.
				if err = s.installSecrets(ctx, b, inst, c.FilesOnly); err != nil {
					inst.Close(context.Background())
				}
			}
			cancel()
			if err != nil {
				errs[i] = callErr("fork child "+b.id, err)
				s.failStart(b, errs[i])
				return
			}
			s.runningAs(b, startOp, inst, time.Since(began), kilnpb.Event_KIND_READY, nil) // an end waits for b.ready
			close(b.ready)
			errs[i] = send(s.describe(b))
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// failStart ends the reserved box b that did not start.
func (s *Server) failStart(b *box, err error) {
	b.mu.Lock()
	b.createErr = err
	b.mu.Unlock()
	close(b.ready)
	os.RemoveAll(b.rec.Dir)
	s.finish(b, startOp, err, status.Convert(err).Message())
}

// reserveFork finds what tmpl's request ID made, or reserves n starting
// children within the host's limits.
func (s *Server) reserveFork(tmpl *record, n int, life time.Duration) (*forkRequest, []*box, bool, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return nil, nil, false, status.Error(codes.Unavailable, "kilnd is shutting down")
	}
	if f := s.forks[tmpl.RequestID]; f != nil {
		return f, nil, true, nil
	}
	if err := s.admitLocked(n, uint64(tmpl.MemoryMiB)); err != nil {
		return nil, nil, false, err
	}
	if err := s.admitVolumesLocked(tmpl.Volumes); err != nil {
		return nil, nil, false, err
	}
	f := &forkRequest{key: tmpl.RequestKey, done: make(chan struct{})}
	now := s.clock.Now()
	boxes := make([]*box, n)
	for i := range boxes {
		b := newBox(newID("sb-"))
		b.rec = *tmpl
		b.rec.ID = b.id
		b.rec.Dir = filepath.Join(s.cfg.StateDir, sandboxesDir, b.id)
		b.rec.CreatedUnixMS = now.UnixMilli()
		if life > 0 {
			b.rec.ExpiresUnixMS = now.Add(life).UnixMilli()
		}
		b.lastActive = now
		if err := os.MkdirAll(b.rec.Dir, 0o700); err != nil {
			for _, o := range boxes[:i] {
				delete(s.boxes, o.id)
				os.RemoveAll(o.rec.Dir)
				os.Remove(s.recordPath(o.id))
			}
			return nil, nil, false, status.Errorf(codes.Internal, "sandbox folder: %v", err)
		}
		b.mu.Lock()
		b.syncStateLocked() // starting
		s.persistLocked(b)
		b.mu.Unlock()
		s.boxes[b.id] = b
		boxes[i] = b
		f.children = append(f.children, b.id)
	}
	s.forks[tmpl.RequestID] = f
	return f, boxes, false, nil
}
