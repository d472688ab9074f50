package vmm

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// fakeMachine stands in for a VM's vCPUs behind a lifecycle's hooks, and
// checks what the lifecycle promises: the hooks and the operations' work
// never overlap, a save runs only with the vCPUs parked, and nothing
// unparks them in the middle of a save.
type fakeMachine struct {
	t    *testing.T
	l    *lifecycle
	rand func(n int) int // [0, n), safe for many goroutines

	mu       sync.Mutex
	parked   bool
	stopped  bool
	busy     atomic.Int32 // hooks and operation bodies at work: at most 1
	saving   atomic.Int32 // save bodies at work
	released atomic.Int32 // Close's release calls
	unparks  atomic.Int32
}

func newFakeMachine(t *testing.T, seed uint64) *fakeMachine {
	m := &fakeMachine{t: t}
	var rmu sync.Mutex
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	m.rand = func(n int) int {
		rmu.Lock()
		defer rmu.Unlock()
		return r.IntN(n)
	}
	m.l = newLifecycle(lifecycleHooks{park: m.park, unpark: m.unpark, halt: m.halt})
	m.l.observe = m.observe
	return m
}

// enter and leave bracket work that must have the turn.
func (m *fakeMachine) enter(what string) {
	if n := m.busy.Add(1); n != 1 {
		m.t.Errorf("%s while %d other lifecycle operations were at work", what, n-1)
	}
}

func (m *fakeMachine) leave() { m.busy.Add(-1) }

// nap sleeps a few microseconds, or returns at once, so that goroutines
// interleave.
func (m *fakeMachine) nap() {
	if d := m.rand(4); d > 0 {
		time.Sleep(time.Duration(m.rand(50*d)) * time.Microsecond)
	} else {
		runtime.Gosched()
	}
}

func (m *fakeMachine) park(ctx context.Context) error {
	m.enter("park")
	defer m.leave()
	m.nap()
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("0 of 1 vCPUs parked: %w", err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.stopped {
		return errors.New("the VM stopped")
	}
	m.parked = true
	return nil
}

func (m *fakeMachine) unpark() {
	m.enter("unpark")
	defer m.leave()
	if m.saving.Load() != 0 {
		m.t.Error("vCPUs unparked in the middle of a save")
	}
	m.unparks.Add(1)
	m.mu.Lock()
	m.parked = false
	m.mu.Unlock()
}

// halt is the VM's stop: no turn, no waiting, and the state stopped
// before park can see it.
func (m *fakeMachine) halt() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.l.ended()
	m.stopped = true
}

// saveBody is the work of a save, a checkpoint or a fork.
func (m *fakeMachine) saveBody(op string) func() error {
	return func() error {
		m.enter(op)
		defer m.leave()
		m.saving.Add(1)
		defer m.saving.Add(-1)
		m.mu.Lock()
		parked, stopped := m.parked, m.stopped
		m.mu.Unlock()
		if !parked && !stopped {
			m.t.Errorf("%s with the vCPUs running", op)
		}
		if s := m.l.State(); s != StateSaving && s != StateStopped {
			m.t.Errorf("%s in state %v", op, s)
		}
		m.nap()
		if m.rand(20) == 0 {
			return errors.New("the save's own failure")
		}
		return nil
	}
}

var legalTransitions = map[[2]VMState]bool{
	{StateCreated, StateRunning}: true,
	{StateCreated, StateStopped}: true,
	{StateRunning, StatePaused}:  true,
	{StateRunning, StateStopped}: true,
	{StatePaused, StateRunning}:  true,
	{StatePaused, StateSaving}:   true,
	{StatePaused, StateStopped}:  true,
	{StateSaving, StatePaused}:   true,
	{StateSaving, StateStopped}:  true,
}

// observe runs under the lifecycle's mutex at every change of state.
func (m *fakeMachine) observe(from, to VMState) {
	if !legalTransitions[[2]VMState{from, to}] {
		m.t.Errorf("illegal transition %v → %v", from, to)
	}
	if from == StateSaving && to != StatePaused && to != StateStopped {
		m.t.Errorf("left saving for %v", to)
	}
}

func (m *fakeMachine) release() error {
	m.enter("release")
	defer m.leave()
	if n := m.released.Add(1); n != 1 {
		m.t.Errorf("release called %d times", n)
	}
	if m.saving.Load() != 0 {
		m.t.Error("released in the middle of a save")
	}
	return nil
}

// TestLifecycleHammer runs Run's start, Pause, Resume, SaveState,
// Checkpoint, Fork, Close and the guest's own end on one lifecycle from 16
// goroutines in random order, round after round, and checks that every
// operation succeeded or failed as it may (a *StateError, or its
// context's end), that transitions are legal, that nothing unparks the
// vCPUs during a save, and that nothing deadlocks.
func TestLifecycleHammer(t *testing.T) {
	const (
		rounds     = 40
		goroutines = 16
		opsEach    = 60
	)
	ops := []string{"run", "pause", "pause", "pause", "resume", "resume", "resume", "save state", "checkpoint", "fork", "state", "close", "guest ends"}
	var succeeded, refused, timedOut sync.Map // op → *atomic.Int64
	count := func(m *sync.Map, op string) {
		c, _ := m.LoadOrStore(op, new(atomic.Int64))
		c.(*atomic.Int64).Add(1)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for round := range rounds {
			m := newFakeMachine(t, uint64(round)+1)
			l := m.l
			var wg sync.WaitGroup
			for g := range goroutines {
				wg.Add(1)
				go func() {
					defer wg.Done()
					r := rand.New(rand.NewPCG(uint64(round), uint64(g)))
					for range opsEach {
						op := ops[r.IntN(len(ops))]
						if (op == "close" || op == "guest ends") && r.IntN(40) != 0 {
							op = "state" // rare, so that most of a round runs
						}
						ctx, cancel := context.Background(), context.CancelFunc(func() {})
						deadline := r.IntN(3) == 0
						if deadline {
							ctx, cancel = context.WithTimeout(ctx, time.Duration(r.IntN(200))*time.Microsecond)
						}
						before := l.State()
						var err error
						switch op {
						case "run":
							err = l.start(ctx)
						case "pause":
							err = l.pause(ctx)
						case "resume":
							err = l.resume()
						case "save state":
							err = l.save(ctx, op, false, m.saveBody(op))
						case "checkpoint", "fork":
							err = l.save(ctx, op, true, m.saveBody(op))
						case "state":
							_ = l.State().String()
						case "close":
							err = l.close(m.release)
						case "guest ends":
							m.halt()
						}
						cancel()
						var se *StateError
						switch {
						case err == nil:
							count(&succeeded, op)
							if before == StateStopped && op != "close" && op != "state" && op != "guest ends" {
								t.Errorf("%s succeeded on a stopped VM", op)
							}
						case errors.As(err, &se):
							count(&refused, op)
							if !errors.Is(err, ErrState) {
								t.Errorf("%s: a *StateError that is not ErrState: %v", op, err)
							}
							if se.Op != op {
								t.Errorf("%s refused as %q: %v", op, se.Op, err)
							}
							if before == StateStopped && se.State != StateStopped {
								t.Errorf("%s on a stopped VM refused for being %v", op, se.State)
							}
							if !strings.HasPrefix(err.Error(), op+": ") {
								t.Errorf("%s: error %q does not name it", op, err)
							}
						case deadline && errors.Is(err, context.DeadlineExceeded):
							count(&timedOut, op)
						case op == "save state" || op == "checkpoint" || op == "fork":
							if err.Error() != "the save's own failure" {
								t.Errorf("%s: %v", op, err)
							}
						default:
							t.Errorf("%s: unexpected error %v", op, err)
						}
					}
				}()
			}
			wg.Wait()
			// Whatever the round left, Close ends it, twice over.
			if err := l.close(m.release); err != nil {
				t.Errorf("close: %v", err)
			}
			if err := l.close(m.release); err != nil {
				t.Errorf("second close: %v", err)
			}
			if s := l.State(); s != StateStopped {
				t.Errorf("state %v after Close", s)
			}
			if n := m.released.Load(); n != 1 {
				t.Errorf("released %d times", n)
			}
			for _, f := range []func() error{
				func() error { return l.pause(context.Background()) },
				l.resume,
				func() error { return l.save(context.Background(), "fork", true, m.saveBody("fork")) },
				func() error { return l.start(context.Background()) },
			} {
				var se *StateError
				if err := f(); !errors.As(err, &se) || se.State != StateStopped {
					t.Errorf("after Close: %v, want a *StateError of a stopped VM", err)
				}
			}
		}
	}()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		buf := make([]byte, 1<<20)
		t.Fatalf("the hammer deadlocked:\n%s", buf[:runtime.Stack(buf, true)])
	}
	report := func(m *sync.Map) string {
		var b strings.Builder
		for _, op := range []string{"run", "pause", "resume", "save state", "checkpoint", "fork", "close"} {
			if c, ok := m.Load(op); ok {
				fmt.Fprintf(&b, " %s=%d", op, c.(*atomic.Int64).Load())
			}
		}
		return b.String()
	}
	t.Logf("succeeded:%s", report(&succeeded))
	t.Logf("refused:%s", report(&refused))
	t.Logf("timed out waiting:%s", report(&timedOut))
	for _, op := range []string{"run", "pause", "resume", "save state", "checkpoint", "fork"} {
		if c, ok := succeeded.Load(op); !ok || c.(*atomic.Int64).Load() == 0 {
			t.Errorf("no %s ever succeeded: the hammer tested little", op)
		}
	}
}

// TestLifecycleResumeWaitsForSave holds a save open and checks that Resume
// waits for it, that a Pause whose context ends meanwhile says what it
// waited for, and that a save that paused the VM itself resumes it.
func TestLifecycleResumeWaitsForSave(t *testing.T) {
	m := newFakeMachine(t, 1)
	l := m.l
	ctx := context.Background()
	if err := l.start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := l.pause(ctx); err != nil {
		t.Fatal(err)
	}
	inSave, finish := make(chan struct{}), make(chan struct{})
	saved := make(chan error, 1)
	go func() {
		saved <- l.save(ctx, "checkpoint", true, func() error {
			close(inSave)
			<-finish
			return nil
		})
	}()
	<-inSave
	if s := l.State(); s != StateSaving {
		t.Fatalf("state %v during a save", s)
	}
	resumed := make(chan error, 1)
	go func() { resumed <- l.resume() }()
	select {
	case err := <-resumed:
		t.Fatalf("Resume returned %v in the middle of a save", err)
	case <-time.After(50 * time.Millisecond):
	}
	short, cancel := context.WithTimeout(ctx, 10*time.Millisecond)
	defer cancel()
	err := l.pause(short)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "pause: waiting for the VM's checkpoint to finish") {
		t.Errorf("Pause during a save: %v", err)
	}
	close(finish)
	if err := <-saved; err != nil {
		t.Fatal(err)
	}
	if err := <-resumed; err != nil {
		t.Fatalf("Resume after the save: %v", err)
	}
	if s := l.State(); s != StateRunning {
		t.Fatalf("state %v after the resume", s)
	}

	// A checkpoint of a running VM pauses it and resumes it.
	before := m.unparks.Load()
	var during VMState
	if err := l.save(ctx, "checkpoint", true, func() error { during = l.State(); return nil }); err != nil {
		t.Fatal(err)
	}
	if during != StateSaving || l.State() != StateRunning || m.unparks.Load() != before+1 {
		t.Errorf("checkpoint of a running VM: %v during, %v after, %d unparks", during, l.State(), m.unparks.Load()-before)
	}
	// SaveState of a running VM is refused.
	var se *StateError
	err = l.save(ctx, "save state", false, func() error { return nil })
	if !errors.As(err, &se) || se.State != StateRunning || !strings.Contains(err.Error(), "call Pause first") {
		t.Errorf("save state of a running VM: %v", err)
	}
}

// TestLifecycleCloseStopsFirst checks that Close stops a VM whose Pause
// waits for vCPUs that do not park, and that the Pause then says the VM
// stopped.
func TestLifecycleCloseStopsFirst(t *testing.T) {
	stopped := make(chan struct{})
	var l *lifecycle
	l = newLifecycle(lifecycleHooks{
		park: func(ctx context.Context) error {
			<-stopped // the vCPUs park only when they stop
			return errors.New("the VM stopped")
		},
		unpark: func() {},
		halt:   func() { l.ended(); close(stopped) },
	})
	ctx := context.Background()
	if err := l.start(ctx); err != nil {
		t.Fatal(err)
	}
	paused := make(chan error, 1)
	go func() { paused <- l.pause(ctx) }()
	for {
		l.mu.Lock()
		op := l.op
		l.mu.Unlock()
		if op == "pause" {
			break
		}
		time.Sleep(time.Millisecond)
	}
	released := false
	if err := l.close(func() error { released = true; return nil }); err != nil || !released {
		t.Fatalf("Close: %v (released %t)", err, released)
	}
	var se *StateError
	if err := <-paused; !errors.As(err, &se) || se.State != StateStopped || err.Error() != "pause: the VM has stopped" {
		t.Errorf("Pause cut short by Close: %v", err)
	}
}

// TestVMLifecycleWithoutKVM drives a VM that never touched KVM through
// the operations it refuses, and Close twice.
func TestVMLifecycleWithoutKVM(t *testing.T) {
	v := newVM(Config{})
	ctx := context.Background()
	if s := v.State(); s != StateCreated {
		t.Fatalf("a new VM is %v", s)
	}
	_, saveErr := v.SaveState(ctx)
	_, forkErr := v.Fork(ctx, 1, ForkConfig{})
	for _, tt := range []struct {
		err  error
		want string
	}{
		{v.Pause(ctx), "pause: the VM is not running (it is created)"},
		{v.Resume(), "resume: the VM is not paused (it is created)"},
		{saveErr, "save state: the VM is not paused (it is created; call Pause first)"},
		{v.Checkpoint(ctx, func(*State) error { return nil }), "checkpoint: the VM is not running (it is created)"},
		{forkErr, "fork: the VM is not running (it is created)"},
	} {
		var se *StateError
		if !errors.As(tt.err, &se) || se.State != StateCreated || !errors.Is(tt.err, ErrState) || tt.err.Error() != tt.want {
			t.Errorf("got %v, want %q", tt.err, tt.want)
		}
	}
	if err := v.Close(); err != nil {
		t.Fatal(err)
	}
	if err := v.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if s := v.State(); s != StateStopped {
		t.Fatalf("a closed VM is %v", s)
	}
	if _, err := v.Run(ctx); !errors.Is(err, ErrState) || err.Error() != "run: the VM has stopped" {
		t.Errorf("Run after Close: %v", err)
	}
}

func TestVMStateString(t *testing.T) {
	for s, want := range map[VMState]string{
		StateCreated: "created", StateRunning: "running", StatePaused: "paused",
		StateSaving: "saving", StateStopped: "stopped", VMState(9): "state(9)",
	} {
		if got := s.String(); got != want {
			t.Errorf("%d: %q, want %q", int(s), got, want)
		}
	}
}
