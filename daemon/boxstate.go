package daemon

import (
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// boxState is where a sandbox (a box) is in its life; the package doc
// draws the whole lifecycle. A box's state is kept by its boxLife, and
// changed only by the gate (boxLife.begin and boxLife.done) that every
// operation asks.
type boxState int

// The states of a box. Those with "…ing" names are an operation in
// progress; the last four are final.
const (
	// boxStay, in the transition table only: the state the operation
	// began in. No box is ever in it.
	boxStay boxState = iota - 1
	// starting: its first machine is being made (a create, a fork's
	// child, a pool's sandbox handed out), or taken over after a kilnd
	// restart. A box is born starting.
	boxStarting
	boxRunning
	// pausing and resuming: its vCPUs are being paused or resumed. The
	// call holds the box's lock throughout, so no other call sees these.
	boxPausing
	boxPaused
	boxResuming
	// hibernating: its state is being saved to disk and its VMM process
	// stopped; hibernated: it is that snapshot, with no VMM process;
	// waking: it is being restored from it.
	boxHibernating
	boxHibernated
	boxWaking
	// rollingBack: its machine is being replaced by one restored from a
	// checkpoint.
	boxRollingBack
	// ending: a destroy, timeout, stop or failure is closing its machine.
	boxEnding
	boxDestroyed
	boxFailed
	boxTimedOut
	boxStopped
)

var boxStateNames = [...]string{
	boxStarting:    "starting",
	boxRunning:     "running",
	boxPausing:     "pausing",
	boxPaused:      "paused",
	boxResuming:    "resuming",
	boxHibernating: "hibernating",
	boxHibernated:  "hibernated",
	boxWaking:      "waking",
	boxRollingBack: "rolling back",
	boxEnding:      "ending",
	boxDestroyed:   "destroyed",
	boxFailed:      "failed",
	boxTimedOut:    "timed out",
	boxStopped:     "stopped",
}

func (s boxState) String() string {
	if s >= 0 && int(s) < len(boxStateNames) {
		return boxStateNames[s]
	}
	if s == boxStay {
		return "(where it began)"
	}
	return fmt.Sprintf("boxState(%d)", int(s))
}

// ended says s is final: the sandbox has ended and nothing of it is left
// on the host.
func (s boxState) ended() bool {
	switch s {
	case boxDestroyed, boxFailed, boxTimedOut, boxStopped:
		return true
	}
	return false
}

// live says the sandbox has not ended (one ending has not, yet).
func (s boxState) live() bool { return !s.ended() }

// transient says an operation is in progress in s.
func (s boxState) transient() bool {
	switch s {
	case boxStarting, boxPausing, boxResuming, boxHibernating, boxWaking, boxRollingBack, boxEnding:
		return true
	}
	return false
}

// public is the state the API shows for s, and whether it shows the
// sandbox hibernated; keep says s has none of its own: the API goes on
// showing the state before it (a sandbox being paused shows running, one
// ending shows what it was until it has ended).
func (s boxState) public() (st kilnpb.SandboxState, hibernated, keep bool) {
	switch s {
	case boxStarting, boxRollingBack:
		return kilnpb.SandboxState_SANDBOX_STATE_STARTING, false, false
	case boxRunning:
		return kilnpb.SandboxState_SANDBOX_STATE_RUNNING, false, false
	case boxPaused:
		return kilnpb.SandboxState_SANDBOX_STATE_PAUSED, false, false
	case boxHibernated, boxWaking:
		return kilnpb.SandboxState_SANDBOX_STATE_PAUSED, true, false
	case boxDestroyed:
		return kilnpb.SandboxState_SANDBOX_STATE_DESTROYED, false, false
	case boxFailed:
		return kilnpb.SandboxState_SANDBOX_STATE_FAILED, false, false
	case boxTimedOut:
		return kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT, false, false
	case boxStopped:
		return kilnpb.SandboxState_SANDBOX_STATE_STOPPED, false, false
	}
	return 0, false, true // pausing, resuming, hibernating, ending
}

// boxOp is an operation on a box, as the gate knows it.
type boxOp int

// The operations on a box. Those with an in-progress state (boxMove.via)
// move the box; the others (use, lend, update, metrics) only ask whether
// the state allows them.
const (
	noOp        boxOp = iota
	startOp           // its first machine made: create, fork, pool (a box is born in it)
	attachOp          // its VMM process taken over after a kilnd restart
	pauseOp           // its vCPUs paused
	resumeOp          // its vCPUs resumed
	hibernateOp       // saved to disk, its VMM process stopped
	wakeOp            // restored from its hibernation
	rollbackOp        // its machine replaced by a checkpoint's
	destroyOp         // ended on request
	timeoutOp         // ended by its lifetime or idle timeout
	stopOp            // ended by its guest's poweroff
	failOp            // ended by a failure (its VMM process died, a rollback failed)
	useOp             // a call into its machine: exec, files, checkpoint, fork, sample
	lendOp            // an in-memory checkpoint it holds handed out (a restore or fork from it)
	forkSavedOp       // its hibernation's saved state forked (linked for the children)
	updateOp          // its lifetime, timeout action, labels or egress policy changed
	metricsOp         // its metrics read
	numBoxOps
)

// boxMove is an operation's row of the transition table.
type boxMove struct {
	name string // for messages: "pause"
	it   string // what a refusal says cannot be done: "pause it"
	// from are the states the operation may begin in.
	from []boxState
	// via is the state while it runs; boxStay: it has none (it changes
	// no state: begin only checks, done does nothing).
	via boxState
	// ok and fail are where it ends when it succeeds or fails (boxStay:
	// the state it began in).
	ok, fail boxState
}

// endable are the states an end (destroy, stop, fail) may begin in:
// every live one but starting (a create's end waits for it: box.ready)
// and ending.
var (
	endable           = []boxState{boxRunning, boxPausing, boxPaused, boxResuming, boxHibernating, boxHibernated, boxWaking, boxRollingBack}
	endableOrStarting = append([]boxState{boxStarting}, endable...)
)

// boxMoves is the transition table. An end (destroy, timeout, stop,
// fail) may begin while another operation is in progress: it takes the
// box over, and that operation's done then changes nothing (it learns
// that the box ended under it and lets go of what it holds). No other
// operation begins while one is in progress.
var boxMoves = [numBoxOps]boxMove{
	startOp:     {name: "start", it: "start it", via: boxStarting, ok: boxRunning, fail: boxFailed},
	attachOp:    {name: "take over", it: "take it over", from: []boxState{boxRunning, boxPaused}, via: boxStarting, ok: boxStay, fail: boxFailed},
	pauseOp:     {name: "pause", it: "pause it", from: []boxState{boxRunning}, via: boxPausing, ok: boxPaused, fail: boxRunning},
	resumeOp:    {name: "resume", it: "resume it", from: []boxState{boxPaused}, via: boxResuming, ok: boxRunning, fail: boxPaused},
	hibernateOp: {name: "hibernate", it: "hibernate it", from: []boxState{boxRunning, boxPaused}, via: boxHibernating, ok: boxHibernated, fail: boxStay},
	wakeOp:      {name: "resume", it: "resume it from its hibernation", from: []boxState{boxHibernated}, via: boxWaking, ok: boxRunning, fail: boxHibernated},
	rollbackOp:  {name: "rollback", it: "roll it back", from: []boxState{boxRunning}, via: boxRollingBack, ok: boxRunning, fail: boxRunning},
	destroyOp:   {name: "destroy", it: "destroy it", from: endable, via: boxEnding, ok: boxDestroyed, fail: boxDestroyed},
	timeoutOp:   {name: "time out", it: "time it out", from: []boxState{boxRunning, boxPaused}, via: boxEnding, ok: boxTimedOut, fail: boxTimedOut},
	stopOp:      {name: "stop", it: "stop it", from: endable, via: boxEnding, ok: boxStopped, fail: boxStopped},
	failOp:      {name: "fail", it: "end it as failed", from: endable, via: boxEnding, ok: boxFailed, fail: boxFailed},
	useOp:       {name: "call", it: "call into it", from: []boxState{boxRunning}, via: boxStay},
	lendOp:      {name: "hand out a checkpoint", it: "hand out its in-memory checkpoint", from: []boxState{boxRunning, boxPaused}, via: boxStay},
	forkSavedOp: {name: "fork its saved state", it: "fork it from its saved state", from: []boxState{boxHibernated}, via: boxStay},
	updateOp:    {name: "update", it: "update it", from: endableOrStarting, via: boxStay},
	metricsOp:   {name: "read metrics", it: "read its metrics", from: endableOrStarting, via: boxStay},
}

func (op boxOp) String() string {
	if op > noOp && op < numBoxOps {
		return boxMoves[op].name
	}
	return fmt.Sprintf("boxOp(%d)", int(op))
}

// allows says op may begin in s.
func (op boxOp) allows(s boxState) bool {
	if op <= noOp || op >= numBoxOps {
		return false
	}
	for _, f := range boxMoves[op].from {
		if f == s {
			return true
		}
	}
	return false
}

// errBoxState is what every *boxStateError is (errors.Is).
var errBoxState = errors.New("the sandbox is in the wrong state for this")

// boxStateError says that Op was refused: sandbox ID was in State. The
// API answers it as FailedPrecondition (GRPCStatus), which the E2B API
// answers as 409 Conflict.
type boxStateError struct {
	ID    string
	Op    boxOp
	State boxState
}

func (e *boxStateError) Error() string {
	s := e.State
	switch {
	case s.ended():
		return fmt.Sprintf("sandbox %s has ended (%s)", e.ID, s)
	case e.Op == useOp && (s == boxPaused || s == boxHibernated):
		return fmt.Sprintf("sandbox %s is %s: resume it first", e.ID, s)
	case s == boxEnding:
		return fmt.Sprintf("sandbox %s is ending: cannot %s", e.ID, boxMoves[e.Op].it)
	case s.transient():
		return fmt.Sprintf("sandbox %s is %s: cannot %s now; try again once that is done", e.ID, s, boxMoves[e.Op].it)
	}
	return fmt.Sprintf("sandbox %s is %s: cannot %s", e.ID, s, boxMoves[e.Op].it)
}

// Is makes errors.Is(err, errBoxState) hold.
func (e *boxStateError) Is(target error) bool { return target == errBoxState }

// GRPCStatus makes the error a FailedPrecondition for the API.
func (e *boxStateError) GRPCStatus() *status.Status {
	return status.New(codes.FailedPrecondition, e.Error())
}

// boxLife is a box's state machine: its state, the operation in
// progress, and the one gate that changes them. It has a lock of its own
// (a leaf: it calls nothing), so that it holds on its own; the server
// calls it with the box's lock held too, so that what the box's other
// fields say agrees with its state.
type boxLife struct {
	id string // the sandbox's, for messages

	mu    sync.Mutex
	state boxState
	op    boxOp    // the operation in progress (noOp: none)
	from  boxState // the state op began in
	// pub and hib are what the API shows (boxState.public): a state's
	// own, or kept from the state before one that has none.
	pub kilnpb.SandboxState
	hib bool
}

// newBoxLife makes the life of a box that is in s; a box born starting
// has its start in progress.
func newBoxLife(id string, s boxState) *boxLife {
	l := &boxLife{id: id, state: s}
	if s == boxStarting {
		l.op, l.from = startOp, boxStarting
	}
	l.pub, l.hib, _ = s.public()
	return l
}

// stateOfRecord is the state a box read from its record (at a kilnd
// start) is in: a live one running, paused or hibernated as recorded (one
// recorded starting was being made or rolled back when kilnd stopped: it
// is taken over as running), an ended one as it ended.
func stateOfRecord(r *record) boxState {
	switch r.state() {
	case kilnpb.SandboxState_SANDBOX_STATE_STARTING, kilnpb.SandboxState_SANDBOX_STATE_RUNNING:
		if r.Hibernated {
			return boxHibernated
		}
		return boxRunning
	case kilnpb.SandboxState_SANDBOX_STATE_PAUSED:
		if r.Hibernated {
			return boxHibernated
		}
		return boxPaused
	case kilnpb.SandboxState_SANDBOX_STATE_DESTROYED:
		return boxDestroyed
	case kilnpb.SandboxState_SANDBOX_STATE_TIMED_OUT:
		return boxTimedOut
	case kilnpb.SandboxState_SANDBOX_STATE_STOPPED:
		return boxStopped
	}
	return boxFailed // FAILED, or a state this kilnd does not know
}

// get returns the box's state.
func (l *boxLife) get() boxState {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state
}

// public returns what the API shows of the box's state.
func (l *boxLife) public() (kilnpb.SandboxState, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pub, l.hib
}

// counts says the box counts against the host's limits: it has a VMM
// process, or is about to have one, or its end has not closed it yet. A
// hibernated box does not, nor one ending from hibernated; one waking
// does (wake begins once admitted).
func (l *boxLife) counts() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	switch {
	case l.state.ended(), l.state == boxHibernated:
		return false
	case l.state == boxEnding:
		return l.from != boxHibernated
	}
	return true
}

// check returns the box's state, and a *boxStateError unless op may
// begin in it.
func (l *boxLife) check(op boxOp) (boxState, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.checkLocked(op)
}

func (l *boxLife) checkLocked(op boxOp) (boxState, error) {
	if !op.allows(l.state) {
		return l.state, &boxStateError{ID: l.id, Op: op, State: l.state}
	}
	return l.state, nil
}

// begin is the gate every operation passes: it refuses op with a
// *boxStateError unless the state allows it, and otherwise moves the box
// to op's in-progress state (an op without one only checks). It returns
// the state op began in. Every op begun with a state of its own ends
// with done.
func (l *boxLife) begin(op boxOp) (boxState, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	from, err := l.checkLocked(op)
	if err != nil {
		return from, err
	}
	m := boxMoves[op]
	if m.via == boxStay {
		return from, nil
	}
	l.op, l.from = op, from
	l.setLocked(m.via)
	return from, nil
}

// done ends op, begun with begin: the box moves to op's outcome for err
// (nil: success) and done returns it with true. When an end took the box
// over meanwhile (or op was not in progress), done changes nothing and
// returns the state with false: the end stands, and the caller lets go
// of what op held (a machine it made or took out of the box).
func (l *boxLife) done(op boxOp, err error) (boxState, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := boxMoves[op]
	if m.via == boxStay {
		return l.state, true
	}
	if l.op != op {
		return l.state, false
	}
	to := m.ok
	if err != nil {
		to = m.fail
	}
	if to == boxStay {
		to = l.from
	}
	l.op = noOp
	l.setLocked(to)
	return to, true
}

func (l *boxLife) setLocked(to boxState) {
	l.state = to
	if pub, hib, keep := to.public(); !keep {
		l.pub, l.hib = pub, hib
	}
}

// beginLocked passes op through b's gate (boxLife.begin) and makes b's
// record say the new state; b.mu is held.
func (b *box) beginLocked(op boxOp) (boxState, error) {
	from, err := b.life.begin(op)
	if err == nil {
		b.syncStateLocked()
	}
	return from, err
}

// doneLocked ends op through b's gate (boxLife.done) and makes b's record
// say the new state; b.mu is held.
func (b *box) doneLocked(op boxOp, err error) (boxState, bool) {
	to, ok := b.life.done(op, err)
	if ok {
		b.syncStateLocked()
	}
	return to, ok
}

// syncStateLocked writes the state the API shows into b's record, which
// nothing but the gate's callers above writes; b.mu is held.
func (b *box) syncStateLocked() {
	pub, _ := b.life.public()
	b.rec.setState(pub)
}
