package shim

import (
	"fmt"

	"github.com/containerd/containerd/errdefs"
)

// ctrState is where a container (a task) is in its life, as the shim
// keeps it: its VM's side of it. Its processes have states of their own
// (process.status: created, running, stopped). A container's state is
// kept by its ctrLife and changed only by the gate (ctrLife.begin and
// ctrLife.done) that every operation on it asks.
//
//	creating ──create──▶ ready ◀──pause/resume──▶ paused
//	    │                  │ ▲                      │ ▲
//	    │ (fails)          ▼ │ checkpoint           ▼ │ checkpoint
//	    │               checkpointing (back to where it began)
//	    ▼
//	deleted ◀──────────delete (from ready or paused)
type ctrState int

const (
	// ctrStay, in the transition table only: the state the operation
	// began in. No container is ever in it.
	ctrStay ctrState = iota - 1
	// creating: its Create is booting its VM (or joining the pod's),
	// without the service's lock; every other call is refused until the
	// Create returns. A container is born creating.
	ctrCreating
	// ready: its VM is up (for a pod's sandbox container, which has
	// none: it is held); its processes may start, run and end.
	ctrReady
	// paused: its VM's vCPUs are stopped.
	ctrPaused
	// checkpointing: a Checkpoint is saving its VM, without the
	// service's lock; it returns to the state it began in.
	ctrCheckpointing
	// deleted: Delete removed it (or its Create failed). Final.
	ctrDeleted
)

var ctrStateNames = [...]string{
	ctrCreating:      "being created",
	ctrReady:         "ready",
	ctrPaused:        "paused",
	ctrCheckpointing: "being checkpointed",
	ctrDeleted:       "deleted",
}

func (s ctrState) String() string {
	if s >= 0 && int(s) < len(ctrStateNames) {
		return ctrStateNames[s]
	}
	if s == ctrStay {
		return "(where it began)"
	}
	return fmt.Sprintf("ctrState(%d)", int(s))
}

// ctrOp is an operation on a container, as the gate knows it.
type ctrOp int

// The operations on a container. Those that move it pass begin and then
// done; the others (use, signal, join) only ask check.
const (
	noCtrOp      ctrOp = iota
	createOp           // its Create: boot or join the pod's VM (a container is born in it)
	pauseOp            // its VM paused (a no-op when it is paused)
	resumeOp           // its VM resumed (a no-op when it is ready)
	checkpointOp       // its VM saved as a checkpoint
	deleteOp           // the container removed, its VM stopped or left to the pod
	useOp              // any other call: state, start, exec, wait, pids, resize, stats, ...
	signalOp           // a signal to one of its running processes
	joinOp             // another container of the pod joining its VM
	numCtrOps
)

// ctrMove is an operation's row of the transition table.
type ctrMove struct {
	name string // what a refusal says cannot be done: "pause it"
	// from are the states the operation may begin in.
	from []ctrState
	// via is the state while it runs; ctrStay: it has none (it runs
	// under the service's lock, or only checks).
	via ctrState
	// ok and fail are where it ends when it succeeds or fails (ctrStay:
	// the state it began in).
	ok, fail ctrState
}

// ctrMoves is the transition table. No operation that moves a container
// begins while one with a state of its own (create, checkpoint) is in
// progress.
var ctrMoves = [numCtrOps]ctrMove{
	createOp:     {name: "create it", via: ctrCreating, ok: ctrReady, fail: ctrDeleted},
	pauseOp:      {name: "pause it", from: []ctrState{ctrReady, ctrPaused}, via: ctrStay, ok: ctrPaused, fail: ctrStay},
	resumeOp:     {name: "resume it", from: []ctrState{ctrReady, ctrPaused}, via: ctrStay, ok: ctrReady, fail: ctrStay},
	checkpointOp: {name: "checkpoint it", from: []ctrState{ctrReady, ctrPaused}, via: ctrCheckpointing, ok: ctrStay, fail: ctrStay},
	deleteOp:     {name: "delete it", from: []ctrState{ctrReady, ctrPaused}, via: ctrStay, ok: ctrDeleted, fail: ctrStay},
	useOp:        {name: "call it", from: []ctrState{ctrReady, ctrPaused, ctrCheckpointing}, via: ctrStay, ok: ctrStay, fail: ctrStay},
	signalOp:     {name: "signal its processes", from: []ctrState{ctrReady, ctrCheckpointing}, via: ctrStay, ok: ctrStay, fail: ctrStay},
	joinOp:       {name: "add a container to its VM", from: []ctrState{ctrCreating, ctrReady, ctrPaused}, via: ctrStay, ok: ctrStay, fail: ctrStay},
}

func (op ctrOp) String() string {
	if op > noCtrOp && op < numCtrOps {
		return ctrMoves[op].name
	}
	return fmt.Sprintf("ctrOp(%d)", int(op))
}

// allows says op may begin in s.
func (op ctrOp) allows(s ctrState) bool {
	if op <= noCtrOp || op >= numCtrOps {
		return false
	}
	for _, f := range ctrMoves[op].from {
		if f == s {
			return true
		}
	}
	return false
}

// ctrStateError says that Op was refused: container ID was in State. It
// is a FailedPrecondition for containerd (errdefs).
type ctrStateError struct {
	ID    string
	Op    ctrOp
	State ctrState
}

func (e *ctrStateError) Error() string {
	if e.State == ctrCreating || e.State == ctrCheckpointing {
		return fmt.Sprintf("container %s is %s: cannot %s until that is done", e.ID, e.State, e.Op)
	}
	return fmt.Sprintf("container %s is %s: cannot %s", e.ID, e.State, e.Op)
}

// Unwrap makes errdefs.IsFailedPrecondition (and errdefs.ToGRPC) hold.
func (e *ctrStateError) Unwrap() error { return errdefs.ErrFailedPrecondition }

// ctrLife is a container's state machine: its state, the operation in
// progress, and the one gate that changes them. The service's lock
// guards it, as it does the container's other fields.
type ctrLife struct {
	id    string // the container's, for messages
	state ctrState
	op    ctrOp    // the operation begun and not done (noCtrOp: none)
	from  ctrState // the state op began in
}

// newCtrLife is the life of a container born creating, its create in
// progress.
func newCtrLife(id string) ctrLife {
	return ctrLife{id: id, state: ctrCreating, op: createOp, from: ctrCreating}
}

// check returns a *ctrStateError unless op may begin now; it changes
// nothing.
func (l *ctrLife) check(op ctrOp) error {
	if !op.allows(l.state) {
		return &ctrStateError{ID: l.id, Op: op, State: l.state}
	}
	return nil
}

// begin is the gate of an operation that moves the container: it refuses
// op with a *ctrStateError unless the state allows it, and otherwise
// moves the container to op's in-progress state (if it has one). It
// returns the state op began in. Every op begun ends with done.
func (l *ctrLife) begin(op ctrOp) (ctrState, error) {
	from := l.state
	if err := l.check(op); err != nil {
		return from, err
	}
	l.op, l.from = op, from
	if via := ctrMoves[op].via; via != ctrStay {
		l.state = via
	}
	return from, nil
}

// done ends op, begun with begin: the container moves to op's outcome
// for err (nil: success), which done returns. An op not in progress
// changes nothing.
func (l *ctrLife) done(op ctrOp, err error) ctrState {
	if l.op != op || op == noCtrOp {
		return l.state
	}
	m := ctrMoves[op]
	to := m.ok
	if err != nil {
		to = m.fail
	}
	if to == ctrStay {
		to = l.from
	}
	l.op, l.state = noCtrOp, to
	return to
}

// paused says its VM's vCPUs are stopped as containerd sees it: it is
// paused, or it is being checkpointed from paused (the save runs it
// briefly, and pauses it again).
func (l *ctrLife) paused() bool {
	return l.state == ctrPaused || l.state == ctrCheckpointing && l.from == ctrPaused
}
