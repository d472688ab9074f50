package daemon

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Hibernation: a sandbox's whole state written to the state folder
// (Instance.Save into StateDir/hibernated/ID/), its VMM process stopped
// and its cgroup removed, so that it holds no memory and admission no
// longer counts it; its network attachment stays (the same netns, tap,
// address and MAC come back) and its record says PAUSED, hibernated,
// which a restarted server takes over as it is. Its lifetime stands
// still meanwhile. Its in-memory checkpoints, which the stopped VMM
// process held, are written to the state folder first (persisted). A
// resume restores it from that snapshot under the same ID in a new VMM
// process and cgroup, on its network, with its secrets kept again: the
// guest's processes (background execs included) and files are as they
// were.

// A hibernation that keeps only files (PauseSandboxRequest.files_only)
// writes, instead of the snapshot, the guest's ExportWritable tar to
// HibernateDir/writableFile; its resume boots the sandbox's image again
// (record.Image, its writable cap and init), applies the tar
// (ImportWritable) and writes its secret files again: files stay,
// processes and memory do not.

// writableFile is a files-only hibernation's tar in its folder.
const writableFile = "writable.tar"

// writableSlackMiB is what a files-only hibernation's tar may hold beyond
// the guest's memory (tar headers; /tmp and the writable layer are guest
// RAM).
const writableSlackMiB = 64

// hibernateCall is PauseSandbox with hibernate.
func (s *Server) hibernateCall(ctx context.Context, id string, filesOnly bool) (*kilnpb.Sandbox, error) {
	b, err := s.lookup(id)
	if err != nil {
		return nil, err
	}
	if err := s.hibernate(ctx, b, false, "", filesOnly); err != nil {
		return nil, err
	}
	return s.describe(b), nil
}

// hibernate hibernates b, running or vCPU-paused; one hibernated already
// is left so. byTimeout says its lifetime ended (its timeout action): it
// then gets its whole lifetime again when resumed, and calls in flight
// do not stop it. why is the PAUSED event's reason.
func (s *Server) hibernate(ctx context.Context, b *box, byTimeout bool, why string, filesOnly bool) error {
	select {
	case <-b.ready:
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	}
	b.mu.Lock()
	st, err := b.life.check(hibernateOp)
	switch {
	case st == boxHibernated:
		b.mu.Unlock()
		return nil
	case err != nil:
		b.mu.Unlock()
		return err
	case b.busy > b.streams && !byTimeout:
		b.mu.Unlock()
		return status.Errorf(codes.FailedPrecondition, "sandbox %s has %d calls in flight: cannot hibernate it", b.id, b.busy-b.streams)
	}
	if filesOnly && b.rec.Image == "" {
		b.mu.Unlock()
		return status.Errorf(codes.FailedPrecondition, "sandbox %s has no image root: only an image root's files can be kept without its memory", b.id)
	}
	b.beginLocked(hibernateOp) // checked above, under b.mu
	old, wasPaused := b.inst, st == boxPaused
	maxTar := (int64(b.rec.MemoryMiB) + writableSlackMiB) << 20
	n := b.rec.Net.clone()
	b.inst = nil // the hibernation holds it: an end meanwhile leaves it to the hibernation
	if b.timer != nil {
		b.timer.Stop()
	}
	b.mu.Unlock()
	log := s.log.With("sandbox", b.id)

	// Until its VM stops, a failure leaves the sandbox as it was.
	var frozen []Frozen
	undo := func(err error) error {
		for _, f := range frozen {
			f.Close()
		}
		b.mu.Lock()
		_, mine := b.doneLocked(hibernateOp, err) // back to running or paused
		if mine {
			b.inst = old
			s.scheduleLocked(b)
		}
		b.mu.Unlock()
		if !mine {
			// Destroyed meanwhile, while its machine was out of the
			// box's hands: it goes here.
			cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			old.Close(cctx)
			cancel()
		} else if wasPaused {
			pctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			if perr := old.Pause(pctx); perr != nil {
				log.Warn("hibernate failed, and the sandbox could not be paused again", "err", perr)
			}
			cancel()
		}
		return err
	}
	if wasPaused {
		// Save needs the agent: the guest runs while it is written.
		if err := old.Resume(ctx); err != nil {
			return undo(callErr("hibernate sandbox "+b.id+": resume its vCPUs for the save", err))
		}
	}
	// Its in-memory checkpoints go with its VMM process: hand them out
	// first (their bases stay in this process's descriptors) and write
	// them to disk once the VM is stopped (its tap is free then).
	for _, id := range s.heldCheckpoints(b.id) {
		f, err := old.Frozen(ctx, id)
		if errors.Is(err, ErrNotHeld) {
			s.forgetCheckpoint(id)
			continue
		}
		if err != nil {
			return undo(callErr("hibernate sandbox "+b.id+": hand out its checkpoint "+id, err))
		}
		frozen = append(frozen, f)
	}
	dir := filepath.Join(s.cfg.StateDir, hibernatedDir, b.id)
	os.RemoveAll(dir) // an earlier attempt's
	if filesOnly {
		if err := exportWritable(ctx, old, dir, maxTar); err != nil {
			os.RemoveAll(dir)
			return undo(callErr("hibernate sandbox "+b.id+": keep its files", err))
		}
	} else if err := old.Save(ctx, dir); err != nil {
		os.RemoveAll(dir)
		return undo(callErr("hibernate sandbox "+b.id+": save its state", err))
	}

	// From here on the sandbox is its snapshot.
	b.mu.Lock()
	b.cancel()
	b.ctx, b.cancel = context.WithCancel(context.Background())
	b.mu.Unlock()
	cctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	if err := old.Close(cctx); err != nil {
		log.Warn("hibernate: closing the VMM process", "err", err)
	}
	cancel()
	pctx := context.WithoutCancel(ctx)
	for _, f := range frozen {
		if err := s.persistFrozen(pctx, b, f, n); err != nil {
			log.Error("hibernate: an in-memory checkpoint could not be written to disk: it is lost", "checkpoint", f.ID(), "err", err)
			s.forgetCheckpoint(f.ID())
		}
		f.Close()
	}

	b.mu.Lock()
	if _, mine := b.doneLocked(hibernateOp, nil); !mine {
		b.mu.Unlock()
		os.RemoveAll(dir)
		return status.Errorf(codes.FailedPrecondition, "sandbox %s ended during its hibernation", b.id)
	}
	now := s.clock.Now()
	b.rec.ResumeLifeMS = 0
	if exp := b.rec.ExpiresUnixMS; exp > 0 {
		if byTimeout {
			b.rec.ResumeLifeMS = b.rec.LifetimeMS
			if b.rec.ResumeLifeMS <= 0 {
				b.rec.ResumeLifeMS = exp - b.rec.CreatedUnixMS
			}
		} else {
			b.rec.ResumeLifeMS = max(exp-now.UnixMilli(), 1)
		}
	}
	b.rec.ExpiresUnixMS = 0
	b.rec.Hibernated, b.rec.HibernateDir, b.rec.FilesOnly = true, dir, filesOnly
	b.rec.PID, b.rec.Cgroup = 0, ""
	b.cgroupMax.path, b.cgroupMax.bytes = "", 0
	b.lastActive = now
	s.persistLocked(b)
	pb := s.protoLocked(b)
	b.mu.Unlock()
	s.publish(kilnpb.Event_KIND_PAUSED, pb, why)
	log.Info("sandbox hibernated", "dir", dir, "checkpoints_persisted", len(frozen), "by_timeout", byTimeout, "files_only", filesOnly)
	return nil
}

// exportWritable writes inst's ExportWritable tar into the new folder
// dir (writableFile, synced), refusing more than max bytes.
func exportWritable(ctx context.Context, inst Instance, dir string, max int64) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(filepath.Join(dir, writableFile), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer f.Close()
	lw := &limitWriter{w: f, left: max}
	if _, err := inst.ExportWritable(ctx, lw); err != nil {
		if lw.over {
			return status.Errorf(codes.ResourceExhausted, "the guest sent more than %d MiB, more than its memory holds", max>>20)
		}
		return err
	}
	if err := f.Sync(); err != nil {
		return err
	}
	return f.Close()
}

// limitWriter writes at most left bytes to w; over says it was asked for
// more.
type limitWriter struct {
	w    io.Writer
	left int64
	over bool
}

func (l *limitWriter) Write(p []byte) (int, error) {
	if int64(len(p)) > l.left {
		l.over = true
		return 0, errors.New("over the bound")
	}
	l.left -= int64(len(p))
	return l.w.Write(p)
}

// heldCheckpoints lists the in-memory checkpoints of sandbox id.
func (s *Server) heldCheckpoints(id string) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for _, c := range s.checkpoints {
		if c.SandboxID == id && !c.Persisted {
			out = append(out, c.ID)
		}
	}
	return out
}

// persistFrozen writes the in-memory checkpoint f of b (whose VMM process
// is gone) to the state folder: a machine restored from it (on b's tap
// n, free now, when it has a card) saves it, and its record says it is
// persisted from then on.
func (s *Server) persistFrozen(ctx context.Context, b *box, f Frozen, n *netRecord) error {
	c, err := s.checkpoint(f.ID())
	if err != nil {
		return nil // deleted meanwhile
	}
	tmp := filepath.Join(s.cfg.StateDir, sandboxesDir, builderPrefix+"hb-"+c.ID) // a leftover goes at the next start
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o700); err != nil {
		return err
	}
	defer os.RemoveAll(tmp)
	b.mu.Lock()
	spec := CreateSpec{Dir: tmp, Frozen: f, Hostname: hostname(b.id), CPUs: int(b.rec.CPUs), MemoryMiB: int(b.rec.MemoryMiB)}
	b.mu.Unlock()
	if c.Net {
		spec.Host.Net = hostSpec(n).Net
	}
	rctx, cancel := s.bootCtx(ctx)
	defer cancel()
	inst, err := s.create(rctx, spec)
	if err != nil {
		return err
	}
	dir := filepath.Join(s.cfg.StateDir, checkpointsDir, c.ID)
	os.RemoveAll(dir)
	err = inst.Save(rctx, dir)
	cctx, ccancel := context.WithTimeout(context.Background(), time.Minute)
	inst.Close(cctx)
	ccancel()
	if err != nil {
		os.RemoveAll(dir)
		return err
	}
	s.mu.Lock()
	cur := s.checkpoints[c.ID]
	var rec checkpointRecord
	if cur != nil {
		rec = *cur
		rec.Persisted, rec.Dir = true, dir
		s.checkpoints[c.ID] = &rec
	}
	s.mu.Unlock()
	if cur == nil {
		os.RemoveAll(dir) // deleted meanwhile
		return nil
	}
	return writeJSON(s.checkpointPath(c.ID), &rec)
}

// wake resumes the hibernated sandbox b: restored from its snapshot in
// a new VMM process (and cgroup) under its ID, on its network, its
// secrets kept again, its exec table synced with the guest's background
// processes, its lifetime armed with what was left of it. A failure
// leaves it hibernated.
func (s *Server) wake(ctx context.Context, b *box) (*kilnpb.Sandbox, error) {
	<-b.ready
	b.mu.Lock()
	if st, err := b.life.check(wakeOp); err != nil {
		b.mu.Unlock()
		if st == boxRunning || st == boxPaused {
			return s.pauseResume(ctx, b.id, false) // woken meanwhile
		}
		return nil, err
	}
	hib, n := b.rec.HibernateDir, b.rec.Net.clone()
	cpus, mem := b.rec.CPUs, b.rec.MemoryMiB
	filesOnly, image, disk, init := b.rec.FilesOnly, b.rec.Image, b.rec.DiskMiB, b.rec.Init
	volumes := s.volumeAttaches(b.rec.Volumes) // its still: a hibernated sandbox has not ended
	b.mu.Unlock()
	stays := "resume sandbox " + b.id + " (it stays hibernated)"
	// Admitted and begun at once, under s.mu: the host's limits count a
	// waking sandbox (boxLife.counts), and did not count it while it
	// was admitted.
	s.mu.Lock()
	err := s.admitLocked(1, uint64(mem))
	if s.closed {
		err = status.Error(codes.Unavailable, "kilnd is shutting down")
	}
	if err != nil {
		s.mu.Unlock()
		return nil, status.Errorf(status.Code(err), "%s: %s", stays, status.Convert(err).Message())
	}
	b.mu.Lock()
	_, err = b.beginLocked(wakeOp) // refused when something came first
	b.mu.Unlock()
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*kilnpb.Sandbox, error) {
		b.mu.Lock()
		b.doneLocked(wakeOp, err) // hibernated again, unless it ended meanwhile
		b.mu.Unlock()
		return nil, err
	}
	if n != nil && s.cfg.Network == nil {
		return fail(status.Errorf(codes.FailedPrecondition, "%s: it has a network, and kilnd runs without sandbox networks now (start it with %s)", stays, netFlag))
	}
	if _, err := os.Stat(hib); err != nil {
		return fail(status.Errorf(codes.Internal, "%s: its state: %v", stays, err))
	}
	dir := filepath.Join(s.cfg.StateDir, sandboxesDir, b.id)
	os.RemoveAll(dir) // its last machine's, gone
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fail(status.Errorf(codes.Internal, "%s: sandbox folder: %v", stays, err))
	}
	b.mu.Lock()
	bctx := b.ctx
	b.mu.Unlock()
	began := time.Now()
	rctx, cancel := s.bootCtx(bctx)
	spec := CreateSpec{Dir: dir, Checkpoint: hib, Hostname: hostname(b.id), CPUs: int(cpus), MemoryMiB: int(mem), Volumes: volumes}
	if filesOnly {
		// Booted anew from its image, with its files applied.
		spec.Checkpoint, spec.Image, spec.WritableMiB, spec.Init = "", image, int(disk), init
	}
	inst, err := s.createNet(rctx, spec, n)
	if err == nil && filesOnly {
		if err = importWritable(rctx, inst, filepath.Join(hib, writableFile)); err != nil {
			inst.Close(context.Background())
		}
	}
	if err == nil {
		// Its memory has its secret files (a boot's has not: they are
		// written again); its new VMM process keeps the secrets again.
		if err = s.installSecrets(rctx, b, inst, filesOnly); err != nil {
			inst.Close(context.Background())
		}
	}
	cancel()
	if err != nil {
		os.RemoveAll(dir)
		return fail(callErr(stays, err))
	}
	b.mu.Lock()
	if len(b.rec.SecretNames) > 0 && len(b.secrets) == 0 {
		s.log.Warn("the secrets of a sandbox hibernated before a kilnd restart are lost: its execs run without them", "sandbox", b.id, "secrets", b.rec.SecretNames)
	}
	b.mu.Unlock()
	// Ended meanwhile: runningAs closes the new machine (its end
	// removed the snapshot).
	err = s.runningAs(b, wakeOp, inst, time.Since(began), kilnpb.Event_KIND_RESUMED, func(r *record) {
		if life := r.ResumeLifeMS; life > 0 {
			r.ExpiresUnixMS = s.clock.Now().Add(time.Duration(life) * time.Millisecond).UnixMilli()
		}
		r.ResumeLifeMS = 0
		r.Hibernated, r.HibernateDir, r.FilesOnly = false, "", false
	})
	if err != nil {
		return nil, err
	}
	os.RemoveAll(hib)
	if filesOnly {
		b.execs.endBefore(inst) // its processes went with its memory
	}
	sctx, scancel := context.WithTimeout(ctx, time.Minute)
	s.syncExecs(sctx, b) // its background execs, still running in the guest
	scancel()
	return s.describe(b), nil
}

// importWritable applies the files-only hibernation's tar at path to
// inst, freshly booted.
func importWritable(ctx context.Context, inst Instance, path string) error {
	f, err := os.Open(path)
	if err != nil {
		return status.Errorf(codes.Internal, "its kept files: %v", err)
	}
	defer f.Close()
	return inst.ImportWritable(ctx, f)
}

// timeoutHibernate hibernates b, whose lifetime ended (reason) and whose
// timeout action is to hibernate (filesOnly: keeping only files); when
// that fails it is destroyed, with a reason that says why.
func (s *Server) timeoutHibernate(b *box, reason string, filesOnly bool) {
	ctx, cancel := context.WithTimeout(s.ctx, s.cfg.BootTimeout)
	defer cancel()
	err := s.hibernate(ctx, b, true, reason+": hibernated (its timeout action)", filesOnly)
	if err == nil || s.ctx.Err() != nil {
		return
	}
	// It times out unless it is no longer running or paused (hibernated
	// or hibernating by another call, woken, ending, ended).
	if !timeoutOp.allows(b.life.get()) {
		return
	}
	s.log.Warn("a sandbox whose lifetime ended could not be hibernated: destroying it", "sandbox", b.id, "err", err)
	s.end(b, timeoutOp, reason+"; hibernating it (its timeout action) failed, so it was destroyed: "+status.Convert(err).Message())
}

// pruneHibernated removes the hibernated states no live sandbox's
// record names (a sandbox destroyed while kilnd was down, a hibernation
// cut short).
func (s *Server) pruneHibernated() {
	keep := map[string]bool{}
	s.mu.Lock()
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.life.get() == boxHibernated {
			keep[b.rec.HibernateDir] = true
		}
		b.mu.Unlock()
	}
	s.mu.Unlock()
	for _, d := range globDirs(filepath.Join(s.cfg.StateDir, hibernatedDir, "*")) {
		if !keep[d] {
			s.log.Info("removing the state of a hibernated sandbox that is gone", "dir", d)
			os.RemoveAll(d)
		}
	}
}
