package daemon

// This file is how a sandbox ends: on its own (watch) or by an operation
// (end), recorded in its final state (finish).

import (
	"context"
	"errors"
	"os"
	"time"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

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
	// A running guest answers a freeze of its volumes; a paused one
	// would not.
	freeze := b.life.get() == boxRunning && writableVolume(b.rec.Volumes) != nil
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
		if freeze {
			// Left clean, so that a read-only mount elsewhere needs no
			// journal replay; a guest that does not answer in time
			// leaves them to the next read-write mount's replay.
			fctx, fcancel := context.WithTimeout(ctx, volumeFreezeTimeout)
			if err := inst.FreezeVolumes(fctx); err != nil {
				s.log.Warn("sandbox volumes not frozen before its end: the next read-write mount replays their journals", "sandbox", b.id, "err", err)
			}
			fcancel()
		}
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
