package daemon

import (
	"errors"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// allBoxStates are every state a box can be in.
var allBoxStates = []boxState{
	boxStarting, boxRunning, boxPausing, boxPaused, boxResuming,
	boxHibernating, boxHibernated, boxWaking, boxRollingBack,
	boxEnding, boxDestroyed, boxFailed, boxTimedOut, boxStopped,
}

// wantMove is what TestBoxTable expects of an operation, written out here
// rather than read from boxMoves, so that a change of the table shows.
type wantMove struct {
	from          []boxState
	via, ok, fail boxState // via boxStay: it moves nothing; ok, fail boxStay: where it began
}

var (
	wantEndable = []boxState{boxRunning, boxPausing, boxPaused, boxResuming, boxHibernating, boxHibernated, boxWaking, boxRollingBack}
	wantMoves   = map[boxOp]wantMove{
		startOp:     {nil, boxStarting, boxRunning, boxFailed}, // a box is born in it
		attachOp:    {[]boxState{boxRunning, boxPaused}, boxStarting, boxStay, boxFailed},
		pauseOp:     {[]boxState{boxRunning}, boxPausing, boxPaused, boxRunning},
		resumeOp:    {[]boxState{boxPaused}, boxResuming, boxRunning, boxPaused},
		hibernateOp: {[]boxState{boxRunning, boxPaused}, boxHibernating, boxHibernated, boxStay},
		wakeOp:      {[]boxState{boxHibernated}, boxWaking, boxRunning, boxHibernated},
		rollbackOp:  {[]boxState{boxRunning}, boxRollingBack, boxRunning, boxRunning},
		destroyOp:   {wantEndable, boxEnding, boxDestroyed, boxDestroyed},
		timeoutOp:   {[]boxState{boxRunning, boxPaused}, boxEnding, boxTimedOut, boxTimedOut},
		stopOp:      {wantEndable, boxEnding, boxStopped, boxStopped},
		failOp:      {wantEndable, boxEnding, boxFailed, boxFailed},
		useOp:       {[]boxState{boxRunning}, boxStay, 0, 0},
		lendOp:      {[]boxState{boxRunning, boxPaused}, boxStay, 0, 0},
		forkSavedOp: {[]boxState{boxHibernated}, boxStay, 0, 0},
		updateOp:    {append([]boxState{boxStarting}, wantEndable...), boxStay, 0, 0},
		metricsOp:   {append([]boxState{boxStarting}, wantEndable...), boxStay, 0, 0},
	}
)

func (w wantMove) allows(s boxState) bool {
	for _, f := range w.from {
		if f == s {
			return true
		}
	}
	return false
}

// TestBoxTable walks every (state, operation) pair through the gate: a
// refused one fails with a *boxStateError (FailedPrecondition for the
// API) and changes nothing; an allowed one moves to its in-progress
// state, and its done to its outcome for success and for failure.
func TestBoxTable(t *testing.T) {
	if len(wantMoves) != int(numBoxOps)-1 {
		t.Fatalf("the test knows %d operations, the gate %d", len(wantMoves), numBoxOps-1)
	}
	failure := errors.New("it failed")
	for op := startOp; op < numBoxOps; op++ {
		w := wantMoves[op]
		for _, s := range allBoxStates {
			t.Run(op.String()+"/"+s.String(), func(t *testing.T) {
				l := newBoxLife("sb-t", s)
				l.op = noOp // a box born starting has its start in progress; this one is just in the state
				from, err := l.begin(op)
				if from != s {
					t.Errorf("begin returned %v, want %v", from, s)
				}
				if !w.allows(s) {
					var se *boxStateError
					if !errors.As(err, &se) || se.Op != op || se.State != s || se.ID != "sb-t" {
						t.Fatalf("begin: %v, want a *boxStateError for %v in %v", err, op, s)
					}
					if !errors.Is(err, errBoxState) || status.Code(err) != codes.FailedPrecondition {
						t.Errorf("%v: not errBoxState, or code %v", err, status.Code(err))
					}
					if got := l.get(); got != s {
						t.Errorf("a refused %v moved it to %v", op, got)
					}
					return
				}
				if err != nil {
					t.Fatalf("begin: %v", err)
				}
				if w.via == boxStay {
					if got := l.get(); got != s {
						t.Errorf("%v moved it to %v", op, got)
					}
					if got, ok := l.done(op, nil); got != s || !ok {
						t.Errorf("done = %v, %v; want %v, true", got, ok, s)
					}
					return
				}
				if got := l.get(); got != w.via {
					t.Fatalf("in progress it is %v, want %v", got, w.via)
				}
				for _, c := range []struct {
					err  error
					want boxState
				}{{nil, w.ok}, {failure, w.fail}} {
					if c.want == boxStay {
						c.want = s
					}
					l := newBoxLife("sb-t", s)
					l.op = noOp
					l.begin(op)
					if got, ok := l.done(op, c.err); got != c.want || !ok || l.get() != c.want {
						t.Errorf("done(%v) = %v, %v; want %v", c.err, got, ok, c.want)
					}
					if got, ok := l.done(op, c.err); ok {
						t.Errorf("a second done moved it to %v", got)
					}
				}
			})
		}
	}
}

// TestBoxStart: a box is born starting, its start in progress; its
// done makes it running, or failed.
func TestBoxStart(t *testing.T) {
	l := newBoxLife("sb-t", boxStarting)
	if got, ok := l.done(startOp, nil); got != boxRunning || !ok {
		t.Errorf("start done: %v, %v", got, ok)
	}
	l = newBoxLife("sb-t", boxStarting)
	if got, ok := l.done(startOp, errors.New("no boot")); got != boxFailed || !ok {
		t.Errorf("failed start done: %v, %v", got, ok)
	}
	l = newBoxLife("sb-t", boxStarting)
	if _, err := l.begin(destroyOp); err == nil {
		t.Error("a starting box was destroyed: its end waits for the start")
	}
}

// TestBoxEndTakesOver: an end may begin while any operation but a start
// is in progress; that operation's done then changes nothing and says
// so, and the end's outcome stands.
func TestBoxEndTakesOver(t *testing.T) {
	for op := startOp; op < numBoxOps; op++ {
		w := wantMoves[op]
		if w.via == boxStay || w.via == boxEnding || len(w.from) == 0 {
			continue
		}
		for _, err := range []error{nil, errors.New("it failed")} {
			l := newBoxLife("sb-t", w.from[0])
			l.begin(op)
			_, derr := l.begin(destroyOp)
			if w.via == boxStarting {
				if derr == nil {
					t.Errorf("a destroy began during %v, which is starting", op)
				}
				continue
			}
			if derr != nil {
				t.Fatalf("destroy during %v: %v", op, derr)
			}
			if got, ok := l.done(op, err); ok || got != boxEnding {
				t.Errorf("%v's done (err %v) under a destroy: %v, %v; want ending, false", op, err, got, ok)
			}
			if got, ok := l.done(destroyOp, nil); !ok || got != boxDestroyed {
				t.Errorf("the destroy's done: %v, %v", got, ok)
			}
		}
	}
}

// TestBoxDestroyDuringFailingRollback is c4fe7ad at the gate: a rollback
// whose new machine fails ends the sandbox as failed, unless a destroy
// came first: then it stays destroyed, whether the destroy had finished
// or was still closing.
func TestBoxDestroyDuringFailingRollback(t *testing.T) {
	for _, destroyFinished := range []bool{true, false} {
		l := newBoxLife("sb-t", boxRunning)
		if _, err := l.begin(rollbackOp); err != nil {
			t.Fatal(err)
		}
		if _, err := l.begin(destroyOp); err != nil {
			t.Fatalf("destroy during a rollback: %v", err)
		}
		if destroyFinished {
			l.done(destroyOp, nil)
		}
		// The rollback's new machine failed: it would end the sandbox as
		// failed.
		if _, err := l.begin(failOp); err == nil {
			t.Fatalf("a failing rollback ended as failed a sandbox being destroyed (finished %v)", destroyFinished)
		}
		if _, ok := l.done(rollbackOp, errors.New("no machine")); ok {
			t.Error("the rollback's done moved a destroyed sandbox")
		}
		if !destroyFinished {
			l.done(destroyOp, nil)
		}
		if got := l.get(); got != boxDestroyed {
			t.Errorf("destroyed during a failing rollback (finished %v): %v", destroyFinished, got)
		}
		if pub, _ := l.public(); pub != kilnpb.SandboxState_SANDBOX_STATE_DESTROYED {
			t.Errorf("the API shows %v", pub)
		}
	}
	// Without a destroy, the failing rollback ends it as failed.
	l := newBoxLife("sb-t", boxRunning)
	l.begin(rollbackOp)
	if _, err := l.begin(failOp); err != nil {
		t.Fatal(err)
	}
	l.done(failOp, nil)
	if got := l.get(); got != boxFailed {
		t.Errorf("a failed rollback left it %v", got)
	}
}

// TestBoxConflicts: of two conflicting operations begun at once, exactly
// one gets in (run it with -race).
func TestBoxConflicts(t *testing.T) {
	for _, c := range []struct {
		from boxState
		a, b boxOp
	}{
		{boxRunning, hibernateOp, rollbackOp},
		{boxRunning, pauseOp, hibernateOp},
		{boxRunning, destroyOp, timeoutOp},
		{boxPaused, resumeOp, hibernateOp},
		{boxHibernated, wakeOp, wakeOp},
		{boxHibernated, destroyOp, stopOp},
	} {
		for range 50 {
			l := newBoxLife("sb-t", c.from)
			var wg sync.WaitGroup
			start := make(chan struct{})
			var mu sync.Mutex
			var in []boxOp
			for _, op := range []boxOp{c.a, c.b, c.a, c.b} {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					if _, err := l.begin(op); err == nil {
						mu.Lock()
						in = append(in, op)
						mu.Unlock()
					}
				}()
			}
			close(start)
			wg.Wait()
			if len(in) != 1 {
				t.Fatalf("%v and %v from %v: %v got in, want exactly one", c.a, c.b, c.from, in)
			}
			if want := wantMoves[in[0]].via; l.get() != want {
				t.Fatalf("%v got in: the box is %v, want %v", in[0], l.get(), want)
			}
		}
	}
}

// TestBoxPublic: what the API shows while a box moves, and what the
// host's limits count.
func TestBoxPublic(t *testing.T) {
	const (
		running = kilnpb.SandboxState_SANDBOX_STATE_RUNNING
		paused  = kilnpb.SandboxState_SANDBOX_STATE_PAUSED
		start   = kilnpb.SandboxState_SANDBOX_STATE_STARTING
		gone    = kilnpb.SandboxState_SANDBOX_STATE_DESTROYED
	)
	l := newBoxLife("sb-t", boxRunning)
	type want struct {
		st     kilnpb.SandboxState
		hib    bool
		counts bool
	}
	check := func(step string, w want) {
		t.Helper()
		st, hib := l.public()
		if st != w.st || hib != w.hib || l.counts() != w.counts {
			t.Errorf("%s (%v): shows %v, hibernated %v, counts %v; want %+v", step, l.get(), st, hib, l.counts(), w)
		}
	}
	check("running", want{running, false, true})
	l.begin(hibernateOp)
	check("hibernating", want{running, false, true})
	l.done(hibernateOp, nil)
	check("hibernated", want{paused, true, false})
	l.begin(wakeOp)
	check("waking", want{paused, true, true})
	l.done(wakeOp, errors.New("no room"))
	check("woken in vain", want{paused, true, false})
	l.begin(destroyOp)
	check("ending from hibernated", want{paused, true, false})
	l.done(destroyOp, nil)
	check("destroyed", want{gone, false, false})

	l = newBoxLife("sb-t", boxRunning)
	l.begin(rollbackOp)
	check("rolling back", want{start, false, true})
	l.done(rollbackOp, nil)
	l.begin(pauseOp)
	check("pausing", want{running, false, true})
	l.done(pauseOp, nil)
	check("paused", want{paused, false, true})
	l.begin(timeoutOp)
	check("ending from paused", want{paused, false, true})
}

// TestStateOfRecord: a box read from its record is in the state it
// records.
func TestStateOfRecord(t *testing.T) {
	for _, c := range []struct {
		state string
		hib   bool
		want  boxState
	}{
		{"SANDBOX_STATE_STARTING", false, boxRunning},
		{"SANDBOX_STATE_RUNNING", false, boxRunning},
		{"SANDBOX_STATE_PAUSED", false, boxPaused},
		{"SANDBOX_STATE_PAUSED", true, boxHibernated},
		{"SANDBOX_STATE_DESTROYED", false, boxDestroyed},
		{"SANDBOX_STATE_DESTROYED", true, boxDestroyed},
		{"SANDBOX_STATE_TIMED_OUT", false, boxTimedOut},
		{"SANDBOX_STATE_STOPPED", false, boxStopped},
		{"SANDBOX_STATE_FAILED", false, boxFailed},
		{"SANDBOX_STATE_NEW_IN_A_LATER_KILND", false, boxFailed},
	} {
		if got := stateOfRecord(&record{State: c.state, Hibernated: c.hib}); got != c.want {
			t.Errorf("%s (hibernated %v): %v, want %v", c.state, c.hib, got, c.want)
		}
	}
}
