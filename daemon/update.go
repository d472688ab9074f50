package daemon

import (
	"context"
	"maps"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// checkTimeoutAction refuses a value that is not a TimeoutAction.
func checkTimeoutAction(a kilnpb.TimeoutAction) error {
	if _, ok := kilnpb.TimeoutAction_name[int32(a)]; !ok {
		return status.Errorf(codes.InvalidArgument, "timeout_action %d: want destroy (0) or hibernate (1)", int32(a))
	}
	return nil
}

// UpdateSandbox changes a live sandbox's lifetime (from now; negative:
// none), timeout action or labels (checked as a create's), persists
// them and returns the sandbox. A hibernated sandbox's lifetime is what
// it gets once resumed (it stands still until then).
func (s *Server) UpdateSandbox(ctx context.Context, req *kilnpb.UpdateSandboxRequest) (*kilnpb.Sandbox, error) {
	b, err := s.lookup(req.GetId())
	if err != nil {
		return nil, err
	}
	if req.LifetimeMs != nil && req.GetLifetimeMs() == 0 {
		return nil, status.Error(codes.InvalidArgument, "lifetime_ms 0: give how long from now (ms), or a negative value for no lifetime")
	}
	if req.TimeoutAction != nil {
		if err := checkTimeoutAction(req.GetTimeoutAction()); err != nil {
			return nil, err
		}
	}
	if req.GetSetLabels() {
		if err := checkLabels("labels", req.GetLabels()); err != nil {
			return nil, err
		}
	} else if len(req.GetLabels()) > 0 {
		return nil, status.Error(codes.InvalidArgument, "labels given without set_labels: set it to replace the labels")
	}
	select {
	case <-b.ready:
	case <-ctx.Done():
		return nil, status.FromContextError(ctx.Err()).Err()
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	st, err := b.life.check(updateOp)
	if err != nil {
		return nil, err
	}
	if req.LifetimeMs != nil {
		life := req.GetLifetimeMs()
		if life < 0 {
			life = 0
		}
		b.rec.LifetimeMS = life
		switch {
		case st == boxHibernated || st == boxWaking:
			// A hibernating one's is turned into this at its end.
			b.rec.ResumeLifeMS = life
		case life == 0:
			b.rec.ExpiresUnixMS = 0
		default:
			b.rec.ExpiresUnixMS = s.clock.Now().Add(time.Duration(life) * time.Millisecond).UnixMilli()
		}
	}
	if req.TimeoutAction != nil {
		b.rec.TimeoutAction = req.GetTimeoutAction()
	}
	if req.GetSetLabels() {
		b.rec.Labels = nil
		if len(req.GetLabels()) > 0 {
			b.rec.Labels = maps.Clone(req.GetLabels())
		}
	}
	s.persistLocked(b)
	s.scheduleLocked(b) // a running or paused one's
	return s.protoLocked(b), nil
}
