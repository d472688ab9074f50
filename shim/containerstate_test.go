package shim

import (
	"errors"
	"testing"

	"github.com/containerd/containerd/errdefs"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// allCtrStates are every state a container can be in.
var allCtrStates = []ctrState{ctrCreating, ctrReady, ctrPaused, ctrCheckpointing, ctrDeleted}

// wantCtrMove is what TestCtrTable expects of an operation, written out
// here rather than read from ctrMoves, so that a change of the table
// shows.
type wantCtrMove struct {
	from          []ctrState
	via, ok, fail ctrState // ctrStay: it has no state while it runs; ok, fail ctrStay: where it began
}

var wantCtrMoves = map[ctrOp]wantCtrMove{
	createOp:     {nil, ctrCreating, ctrReady, ctrDeleted}, // a container is born in it
	pauseOp:      {[]ctrState{ctrReady, ctrPaused}, ctrStay, ctrPaused, ctrStay},
	resumeOp:     {[]ctrState{ctrReady, ctrPaused}, ctrStay, ctrReady, ctrStay},
	checkpointOp: {[]ctrState{ctrReady, ctrPaused}, ctrCheckpointing, ctrStay, ctrStay},
	deleteOp:     {[]ctrState{ctrReady, ctrPaused}, ctrStay, ctrDeleted, ctrStay},
	useOp:        {[]ctrState{ctrReady, ctrPaused, ctrCheckpointing}, ctrStay, ctrStay, ctrStay},
	signalOp:     {[]ctrState{ctrReady, ctrCheckpointing}, ctrStay, ctrStay, ctrStay},
	joinOp:       {[]ctrState{ctrCreating, ctrReady, ctrPaused}, ctrStay, ctrStay, ctrStay},
}

func (w wantCtrMove) allows(s ctrState) bool {
	for _, f := range w.from {
		if f == s {
			return true
		}
	}
	return false
}

// lifeIn is a container's life in s, with no operation in progress.
func lifeIn(s ctrState) ctrLife {
	return ctrLife{id: "c1", state: s}
}

// TestCtrTable walks every (state, operation) pair through the gate: a
// refused one fails with a *ctrStateError (FailedPrecondition for
// containerd) and changes nothing; an allowed one moves to its
// in-progress state, and its done to its outcome for success and for
// failure.
func TestCtrTable(t *testing.T) {
	if len(wantCtrMoves) != int(numCtrOps)-1 {
		t.Fatalf("the test knows %d operations, the gate %d", len(wantCtrMoves), numCtrOps-1)
	}
	failure := errors.New("it failed")
	for op := createOp; op < numCtrOps; op++ {
		w := wantCtrMoves[op]
		for _, s := range allCtrStates {
			t.Run(op.String()+"/"+s.String(), func(t *testing.T) {
				l := lifeIn(s)
				checkErr := l.check(op)
				from, err := l.begin(op)
				if from != s {
					t.Errorf("begin returned %v, want %v", from, s)
				}
				if (checkErr == nil) != (err == nil) {
					t.Errorf("check said %v, begin %v", checkErr, err)
				}
				if !w.allows(s) {
					var se *ctrStateError
					if !errors.As(err, &se) || se.Op != op || se.State != s || se.ID != "c1" {
						t.Fatalf("begin: %v, want a *ctrStateError for %v in %v", err, op, s)
					}
					if !errdefs.IsFailedPrecondition(err) || status.Code(errdefs.ToGRPC(err)) != codes.FailedPrecondition {
						t.Errorf("%v: not a FailedPrecondition", err)
					}
					if l.state != s || l.op != noCtrOp {
						t.Errorf("a refused %v moved it to %v (op %v)", op, l.state, l.op)
					}
					return
				}
				if err != nil {
					t.Fatalf("begin: %v", err)
				}
				via := w.via
				if via == ctrStay {
					via = s
				}
				if l.state != via {
					t.Fatalf("in progress it is %v, want %v", l.state, via)
				}
				for _, c := range []struct {
					err  error
					want ctrState
				}{{nil, w.ok}, {failure, w.fail}} {
					if c.want == ctrStay {
						c.want = s
					}
					l := lifeIn(s)
					l.begin(op)
					if got := l.done(op, c.err); got != c.want || l.state != c.want {
						t.Errorf("done(%v) = %v (state %v); want %v", c.err, got, l.state, c.want)
					}
					if l.op != noCtrOp {
						t.Errorf("after done, %v is still in progress", l.op)
					}
					if got := l.done(op, c.err); got != c.want {
						t.Errorf("a second done moved it to %v", got)
					}
				}
			})
		}
	}
}

// TestCtrLifeBorn: a container is born creating, its create in progress;
// it is ready once the create is done, deleted if it failed.
func TestCtrLifeBorn(t *testing.T) {
	l := newCtrLife("c1")
	if l.state != ctrCreating || l.op != createOp {
		t.Fatalf("born %v with %v in progress; want creating, create", l.state, l.op)
	}
	if err := l.check(useOp); !errdefs.IsFailedPrecondition(err) {
		t.Errorf("a call while creating: %v, want FailedPrecondition", err)
	}
	if err := l.check(joinOp); err != nil {
		t.Errorf("joining a VM being created: %v", err)
	}
	if got := l.done(pauseOp, nil); got != ctrCreating {
		t.Errorf("done of an op not in progress moved it to %v", got)
	}
	if got := l.done(createOp, nil); got != ctrReady {
		t.Errorf("create done: %v, want ready", got)
	}
	l = newCtrLife("c1")
	if got := l.done(createOp, errors.New("boot failed")); got != ctrDeleted {
		t.Errorf("a failed create: %v, want deleted", got)
	}
}

// TestCtrLifePaused: what containerd sees as paused, a checkpoint's
// in-progress state included.
func TestCtrLifePaused(t *testing.T) {
	for _, s := range allCtrStates {
		l := lifeIn(s)
		if got, want := l.paused(), s == ctrPaused; got != want {
			t.Errorf("paused() in %v = %v, want %v", s, got, want)
		}
	}
	for _, tt := range []struct {
		from ctrState
		want bool
	}{{ctrReady, false}, {ctrPaused, true}} {
		l := lifeIn(tt.from)
		if _, err := l.begin(checkpointOp); err != nil {
			t.Fatal(err)
		}
		if got := l.paused(); got != tt.want {
			t.Errorf("checkpointing from %v: paused() = %v, want %v", tt.from, got, tt.want)
		}
		if got := l.done(checkpointOp, nil); got != tt.from {
			t.Errorf("checkpoint done: %v, want %v", got, tt.from)
		}
	}
}

func TestCtrStateError(t *testing.T) {
	tests := []struct {
		op   ctrOp
		s    ctrState
		want string
	}{
		{useOp, ctrCreating, "container c1 is being created: cannot call it until that is done"},
		{pauseOp, ctrCheckpointing, "container c1 is being checkpointed: cannot pause it until that is done"},
		{signalOp, ctrPaused, "container c1 is paused: cannot signal its processes"},
		{deleteOp, ctrDeleted, "container c1 is deleted: cannot delete it"},
	}
	for _, tt := range tests {
		l := lifeIn(tt.s)
		if err := l.check(tt.op); err == nil || err.Error() != tt.want {
			t.Errorf("%v in %v: %v, want %q", tt.op, tt.s, err, tt.want)
		}
	}
}
