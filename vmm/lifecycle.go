package vmm

import (
	"context"
	"errors"
	"fmt"
	"sync"
)

// VMState is where a VM is in its life. A VM goes
//
//	created → running ⇄ paused ⇄ saving → …
//	                                    ↘ stopped (from any state)
//
// created: built by New or Restore, not started. running: Run started the
// vCPUs. paused: every vCPU is parked (Pause). saving: a state save, a
// Checkpoint or a Fork is in progress, vCPUs parked; it ends in paused, or
// in running when the operation paused the VM itself. stopped: the guest
// ended (power-off, panic, ..., Run's context) or Close was called; it is
// final.
type VMState int

// The states of a VM.
const (
	StateCreated VMState = iota
	StateRunning
	StatePaused
	StateSaving
	StateStopped
)

func (s VMState) String() string {
	switch s {
	case StateCreated:
		return "created"
	case StateRunning:
		return "running"
	case StatePaused:
		return "paused"
	case StateSaving:
		return "saving"
	case StateStopped:
		return "stopped"
	}
	return fmt.Sprintf("state(%d)", int(s))
}

// ErrState is what every *StateError is (errors.Is): a lifecycle
// operation was asked of a VM in a state that does not allow it.
var ErrState = errors.New("VM is in the wrong state")

// StateError says that Op could not run because the VM was in State when
// its turn came. errors.Is(err, ErrState) holds for it.
type StateError struct {
	Op    string // "run", "pause", "resume", "save state", "checkpoint", "fork"
	State VMState
}

func (e *StateError) Error() string {
	switch {
	case e.State == StateStopped:
		return e.Op + ": the VM has stopped"
	case e.Op == "run":
		return fmt.Sprintf("run: the VM already ran (it is %s)", e.State)
	case e.Op == "resume":
		return fmt.Sprintf("resume: the VM is not paused (it is %s)", e.State)
	case e.Op == "save state":
		return fmt.Sprintf("save state: the VM is not paused (it is %s; call Pause first)", e.State)
	case e.Op == "pause" && e.State == StatePaused:
		return "pause: the VM is already paused"
	}
	return fmt.Sprintf("%s: the VM is not running (it is %s)", e.Op, e.State)
}

// Is makes errors.Is(err, ErrState) hold.
func (e *StateError) Is(target error) bool { return target == ErrState }

// lifecycleHooks are the parts of the lifecycle that touch vCPUs; a VM
// gives its own (kick and park its vCPUs), the tests give fakes.
type lifecycleHooks struct {
	// park makes every vCPU park and returns once all are parked, or with
	// an error when ctx ends or the VM stops first. After an error unpark
	// is called.
	park func(ctx context.Context) error
	// unpark lets parked vCPUs (and anything a save paused) run again.
	unpark func()
	// halt stops the vCPUs for good, without waiting. Whatever stops the
	// VM calls ended before park can see the vCPUs stopping, so that a
	// park cut short by the stop finds the state stopped.
	halt func()
}

// lifecycle is a VM's state machine. One operation (Run's start, Pause,
// Resume, a save, a Checkpoint, a Fork, Close) runs at a time: each takes
// the turn, waiting for the one in progress (for as long as its context
// allows), then checks the state and fails with a *StateError when it does
// not allow the operation. The guest's ending (ended) needs no turn: it
// may come at any time, from a vCPU or Run, and makes the state stopped
// at once; the operation in progress sees it when it finishes.
type lifecycle struct {
	hooks lifecycleHooks
	turn  chan struct{} // holds a token while an operation runs

	mu      sync.Mutex
	state   VMState
	op      string // the operation holding the turn, for messages
	started bool   // Run's start succeeded
	closed  bool   // Close has released the VM
	// observe, when set (by tests), sees every change of state, under mu.
	observe func(from, to VMState)
}

func newLifecycle(h lifecycleHooks) *lifecycle {
	return &lifecycle{hooks: h, turn: make(chan struct{}, 1)}
}

// State returns the current state.
func (l *lifecycle) State() VMState {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.state
}

// set moves to state to; stopped is final.
func (l *lifecycle) set(to VMState) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.setLocked(to)
}

func (l *lifecycle) setLocked(to VMState) {
	if l.state == StateStopped || l.state == to {
		return
	}
	if l.observe != nil {
		l.observe(l.state, to)
	}
	l.state = to
}

// ended records that the VM stopped (the guest ended, Run's context ended,
// or Close stops it). It never waits.
func (l *lifecycle) ended() { l.set(StateStopped) }

// acquire takes the turn for op, waiting while ctx allows (nil: for as
// long as it takes).
func (l *lifecycle) acquire(ctx context.Context, op string) error {
	if ctx == nil {
		l.turn <- struct{}{}
	} else {
		select {
		case l.turn <- struct{}{}:
		default:
			l.mu.Lock()
			busy := l.op
			l.mu.Unlock()
			select {
			case l.turn <- struct{}{}:
			case <-ctx.Done():
				return fmt.Errorf("%s: waiting for the VM's %s to finish: %w", op, busy, context.Cause(ctx))
			}
		}
	}
	l.mu.Lock()
	l.op = op
	l.mu.Unlock()
	return nil
}

func (l *lifecycle) release() {
	l.mu.Lock()
	l.op = ""
	l.mu.Unlock()
	<-l.turn
}

// check returns a *StateError for op unless the state is one of ok.
func (l *lifecycle) check(op string, ok ...VMState) (VMState, error) {
	s := l.State()
	for _, o := range ok {
		if s == o {
			return s, nil
		}
	}
	return s, &StateError{Op: op, State: s}
}

// start moves a created VM to running, for Run, which then starts the
// vCPUs.
func (l *lifecycle) start(ctx context.Context) error {
	if err := l.acquire(ctx, "run"); err != nil {
		return err
	}
	defer l.release()
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.state != StateCreated {
		return &StateError{Op: "run", State: l.state}
	}
	l.setLocked(StateRunning)
	l.started = true
	return nil
}

// hasStarted reports whether Run's start succeeded: Run's goroutines are
// then there, or on their way.
func (l *lifecycle) hasStarted() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.started
}

// pause parks a running VM's vCPUs.
func (l *lifecycle) pause(ctx context.Context) error {
	if err := l.acquire(ctx, "pause"); err != nil {
		return err
	}
	defer l.release()
	if _, err := l.check("pause", StateRunning); err != nil {
		return err
	}
	return l.parkLocked(ctx, "pause")
}

// parkLocked parks the vCPUs of a running VM; the caller holds the turn.
// On failure the vCPUs run on (or the VM has stopped).
func (l *lifecycle) parkLocked(ctx context.Context, op string) error {
	if err := l.hooks.park(ctx); err != nil {
		l.hooks.unpark()
		if l.State() == StateStopped {
			return &StateError{Op: op, State: StateStopped}
		}
		return fmt.Errorf("%s: %w", op, err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.state == StateStopped {
		return &StateError{Op: op, State: StateStopped}
	}
	l.setLocked(StatePaused)
	return nil
}

// resume lets a paused VM run again. It waits for a save in progress: a
// VM is never resumed in the middle of one.
func (l *lifecycle) resume() error {
	l.acquire(nil, "resume")
	defer l.release()
	if _, err := l.check("resume", StatePaused); err != nil {
		return err
	}
	l.unparkLocked()
	return nil
}

// unparkLocked resumes a paused VM; the caller holds the turn.
func (l *lifecycle) unparkLocked() {
	l.hooks.unpark()
	l.set(StateRunning)
}

// save runs fn with the VM in the saving state, its vCPUs parked, holding
// the turn throughout: nothing resumes the VM or starts another save
// meanwhile. A paused VM stays paused. A running one is refused, unless
// pauseRunning: then save pauses it first and resumes it after fn, also
// when fn fails.
func (l *lifecycle) save(ctx context.Context, op string, pauseRunning bool, fn func() error) error {
	if err := l.acquire(ctx, op); err != nil {
		return err
	}
	defer l.release()
	ok := []VMState{StatePaused}
	if pauseRunning {
		ok = append(ok, StateRunning)
	}
	s, err := l.check(op, ok...)
	if err != nil {
		return err
	}
	if s == StateRunning {
		if err := l.parkLocked(ctx, op); err != nil {
			return err
		}
	}
	l.mu.Lock()
	if l.state == StateStopped {
		l.mu.Unlock()
		return &StateError{Op: op, State: StateStopped}
	}
	l.setLocked(StateSaving)
	l.mu.Unlock()
	defer func() {
		l.mu.Lock()
		l.setLocked(StatePaused) // nothing if it stopped meanwhile
		resume := s == StateRunning && l.state == StatePaused
		l.mu.Unlock()
		if resume {
			l.unparkLocked()
		}
	}()
	return fn()
}

// close stops the VM (its vCPUs first, so that an operation waiting for
// them ends), waits for the operation in progress, and calls release once:
// a second close waits for the first and returns nil.
func (l *lifecycle) close(release func() error) error {
	l.hooks.halt()
	l.acquire(nil, "close")
	defer l.release()
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return nil
	}
	l.closed = true
	l.setLocked(StateStopped)
	l.mu.Unlock()
	return release()
}

// Checkpoint pauses a running VM (a paused one stays as it is), saves its
// state (SaveState) and calls fn with it while the VM stays paused, in the
// saving state: nothing resumes the VM, or saves or forks it, until fn has
// returned, so fn can copy guest memory (Memory) that agrees with the
// state. Then Checkpoint resumes the VM if it paused it, also when fn
// fails, and returns fn's error. fn must not call the VM's lifecycle
// methods (Pause, Resume, SaveState, Checkpoint, Fork, Close): they would
// wait for Checkpoint. A VM neither running nor paused is refused with a
// *StateError (ErrState).
func (v *VM) Checkpoint(ctx context.Context, fn func(*State) error) error {
	return v.lc.save(ctx, "checkpoint", true, func() error {
		st, err := v.saveState(ctx)
		if err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
		return fn(st)
	})
}
