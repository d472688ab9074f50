package daemon

// This file is a new server's take-over of the sandboxes its state folder
// records (load, adopt).

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sync"
	"time"
)

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
