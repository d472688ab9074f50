package daemon_test

import (
	"sync"
	"time"

	"github.com/kilnvm/kiln/daemon"
)

// fakeClock is a daemon.Clock that moves only when Advance moves it, so
// that lifecycle tests run in milliseconds.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Time
	timers map[*fakeTimer]struct{}
}

var _ daemon.Clock = (*fakeClock)(nil)

// newFakeClock returns a clock at t.
func newFakeClock(t time.Time) *fakeClock {
	return &fakeClock{now: t, timers: map[*fakeTimer]struct{}{}}
}

type fakeTimer struct {
	c    *fakeClock
	when time.Time
	f    func()
}

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	_, ok := t.c.timers[t]
	delete(t.c.timers, t)
	return ok
}

// Now returns the clock's time.
func (c *fakeClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// AfterFunc calls f in a goroutine of its own once Advance has moved the
// clock d on.
func (c *fakeClock) AfterFunc(d time.Duration, f func()) daemon.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{c: c, when: c.now.Add(d), f: f}
	c.timers[t] = struct{}{}
	return t
}

// Advance moves the clock d on and starts the calls now due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	var due []*fakeTimer
	for t := range c.timers {
		if !t.when.After(c.now) {
			due = append(due, t)
			delete(c.timers, t)
		}
	}
	c.mu.Unlock()
	for _, t := range due {
		go t.f()
	}
}

// Pending returns how many calls wait.
func (c *fakeClock) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}
