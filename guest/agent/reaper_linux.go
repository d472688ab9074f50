package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// How long, and how many, statuses of unregistered children a Reaper in
// orphan mode keeps for a later Watch.
const (
	unclaimedTTL = 5 * time.Second
	maxUnclaimed = 1024
)

// ErrReaperStopped is the status error of children whose Reaper stopped
// before they exited.
var ErrReaperStopped = errors.New("agent: reaper stopped")

// A Reaper is the one place in the process that calls wait4. It reaps
// children when SIGCHLD arrives (and when a child is registered), never
// on a timer, so that an idle guest's agent does not wake, and delivers the status of each child it
// knows of (started with ForkExec or named with Watch) to that child's
// [Child].
//
// In orphan mode (for PID 1, or a child subreaper) it reaps every child with
// wait4(-1), orphans included; statuses of pids nobody registered are kept
// for a few seconds, keyed by pid, so that Watch called just after a child
// exited still gets its status. Otherwise it waits only for the pids it
// knows of, leaving other children of the process to whoever started them,
// which lets several Reapers share a process (as tests do).
//
// A Reaper reaps only while Run runs.
type Reaper struct {
	log         *slog.Logger
	reapOrphans bool

	// spawnMu orders forks against reap passes in orphan mode: ForkExec
	// holds it shared from fork to registration, a reap pass holds it
	// exclusively, so a child started by ForkExec is never reaped before it
	// is registered (and a stale status of an earlier process with the same
	// pid is never mistaken for it).
	spawnMu sync.RWMutex

	mu        sync.Mutex
	children  map[int]*Child
	unclaimed map[int]unclaimedStatus
	stopped   bool

	kick    chan struct{}
	running atomic.Bool
}

type unclaimedStatus struct {
	status syscall.WaitStatus
	at     time.Time
}

// NewReaper returns a Reaper; it reaps only once Run is called. With
// reapOrphans it reaps every child of the process (pass true when running
// as PID 1, os.Getpid() == 1). logger may be nil.
func NewReaper(logger *slog.Logger, reapOrphans bool) *Reaper {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return &Reaper{
		log:         logger,
		reapOrphans: reapOrphans,
		children:    make(map[int]*Child),
		unclaimed:   make(map[int]unclaimedStatus),
		kick:        make(chan struct{}, 1),
	}
}

// Run reaps children until ctx ends, then marks every child still waited for
// as failed with ErrReaperStopped and returns nil. It returns an error at
// once if the Reaper is already running.
func (r *Reaper) Run(ctx context.Context) error {
	if !r.running.CompareAndSwap(false, true) {
		return errors.New("agent: reaper already running")
	}
	defer r.running.Store(false)
	r.mu.Lock()
	r.stopped = false
	r.mu.Unlock()

	// SIGCHLD is enough: signals coalesce, but a pass reaps every child
	// that has exited (WNOHANG until none), and one pending signal or
	// kick makes another pass.
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGCHLD)
	defer signal.Stop(sigs)

	for {
		r.reap()
		select {
		case <-ctx.Done():
			r.stop()
			return nil
		case <-sigs:
		case <-r.kick:
		}
	}
}

// stop fails every registered child with ErrReaperStopped.
func (r *Reaper) stop() {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.stopped = true
	for pid, c := range r.children {
		delete(r.children, pid)
		c.finish(0, ErrReaperStopped)
	}
}

// ForkExec starts a process like syscall.ForkExec and registers it, so its
// exit is delivered to the returned Child. The Child also holds a pidfd
// (where the kernel has them) so that Signal never reaches a recycled pid.
func (r *Reaper) ForkExec(path string, argv []string, attr *syscall.ProcAttr) (*Child, error) {
	r.spawnMu.RLock()
	defer r.spawnMu.RUnlock()
	pid, err := syscall.ForkExec(path, argv, attr)
	if err != nil {
		return nil, err
	}
	c := newChild(pid)
	// The child cannot have been reaped yet (see spawnMu), so the pid is
	// still ours even if it already exited.
	if fd, err := unix.PidfdOpen(pid, unix.PIDFD_NONBLOCK); err == nil {
		unix.CloseOnExec(fd)
		c.pidfd = fd
	}
	r.register(c, true)
	return c, nil
}

// Watch returns a Child for a process started by other means (which must
// not wait for it itself). If the Reaper, in orphan mode, already reaped pid
// in the last few seconds, the Child is done at once.
func (r *Reaper) Watch(pid int) *Child {
	c := newChild(pid)
	r.register(c, false)
	return c
}

func (r *Reaper) register(c *Child, fresh bool) {
	r.mu.Lock()
	// Statuses expire here and in reap passes, not on a timer: one older
	// than unclaimedTTL is never handed to a later process of its pid.
	r.expireUnclaimedLocked(time.Now())
	if st, ok := r.unclaimed[c.pid]; ok {
		delete(r.unclaimed, c.pid)
		if !fresh {
			r.mu.Unlock()
			c.finish(st.status, nil)
			return
		}
		// A fresh child cannot have been reaped yet: st belonged to an
		// earlier process with the same pid.
	}
	if r.stopped {
		r.mu.Unlock()
		c.finish(0, ErrReaperStopped)
		return
	}
	if old := r.children[c.pid]; old != nil {
		// Only possible if a caller watched a pid that is not its child.
		old.finish(0, fmt.Errorf("agent: pid %d registered twice", c.pid))
	}
	r.children[c.pid] = c
	r.mu.Unlock()
	// The child may have exited before registration (its SIGCHLD then
	// found nothing to deliver to): make Run look again.
	select {
	case r.kick <- struct{}{}:
	default:
	}
}

// reap runs one reap pass.
func (r *Reaper) reap() {
	if r.reapOrphans {
		r.reapAll()
	} else {
		r.reapKnown()
	}
}

func (r *Reaper) reapAll() {
	r.spawnMu.Lock()
	defer r.spawnMu.Unlock()
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if err == syscall.EINTR {
			continue
		}
		if err != nil || pid <= 0 { // ECHILD: no children; 0: none exited
			break
		}
		r.deliver(pid, ws)
	}
	r.mu.Lock()
	r.expireUnclaimedLocked(time.Now())
	r.mu.Unlock()
}

func (r *Reaper) reapKnown() {
	r.mu.Lock()
	pids := make([]int, 0, len(r.children))
	for pid := range r.children {
		pids = append(pids, pid)
	}
	r.mu.Unlock()
	for _, pid := range pids {
		var ws syscall.WaitStatus
		got, err := syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		for err == syscall.EINTR {
			got, err = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		}
		switch {
		case err != nil:
			// ECHILD: someone else reaped it; its status is lost.
			r.fail(pid, fmt.Errorf("agent: waiting for pid %d: %w", pid, err))
		case got == pid:
			r.deliver(pid, ws)
		}
	}
}

func (r *Reaper) deliver(pid int, ws syscall.WaitStatus) {
	r.mu.Lock()
	c := r.children[pid]
	if c != nil {
		delete(r.children, pid)
		r.mu.Unlock()
		c.finish(ws, nil)
		return
	}
	if len(r.unclaimed) >= maxUnclaimed {
		r.expireUnclaimedLocked(time.Now().Add(unclaimedTTL)) // drop them all
	}
	r.unclaimed[pid] = unclaimedStatus{status: ws, at: time.Now()}
	r.mu.Unlock()
	r.log.Debug("reaped orphan", "pid", pid, "status", describeWaitStatus(ws))
}

func (r *Reaper) fail(pid int, err error) {
	r.mu.Lock()
	c := r.children[pid]
	delete(r.children, pid)
	r.mu.Unlock()
	if c != nil {
		r.log.Warn("lost child", "pid", pid, "err", err)
		c.finish(0, err)
	}
}

// expireUnclaimedLocked drops unclaimed statuses older than unclaimedTTL at
// now. r.mu must be held.
func (r *Reaper) expireUnclaimedLocked(now time.Time) {
	for pid, st := range r.unclaimed {
		if now.Sub(st.at) >= unclaimedTTL {
			delete(r.unclaimed, pid)
		}
	}
}

// A Child is a process whose exit a Reaper delivers.
type Child struct {
	pid  int
	done chan struct{}

	mu     sync.Mutex
	pidfd  int // -1 if none
	exited bool
	status syscall.WaitStatus
	err    error
}

func newChild(pid int) *Child {
	return &Child{pid: pid, pidfd: -1, done: make(chan struct{})}
}

// Pid returns the child's pid.
func (c *Child) Pid() int { return c.pid }

// Done is closed once the child was reaped (or its Reaper stopped).
func (c *Child) Done() <-chan struct{} { return c.done }

// Status returns the child's wait status once Done is closed; err is set if
// the status could not be had (ErrReaperStopped).
func (c *Child) Status() (syscall.WaitStatus, error) {
	<-c.done
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.status, c.err
}

// Wait waits for the child's status or for ctx to end.
func (c *Child) Wait(ctx context.Context) (syscall.WaitStatus, error) {
	select {
	case <-c.done:
		return c.Status()
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// Signal sends sig to the child; os.ErrProcessDone once it was reaped.
func (c *Child) Signal(sig syscall.Signal) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.exited {
		return os.ErrProcessDone
	}
	if c.pidfd >= 0 {
		return unix.PidfdSendSignal(c.pidfd, sig, nil, 0)
	}
	return syscall.Kill(c.pid, sig)
}

// SignalGroup sends sig to the process group the child leads (it must have
// been started with Setpgid). Members of the group may outlive the child,
// so this still works after the child exited, as long as any of them runs.
func (c *Child) SignalGroup(sig syscall.Signal) error {
	return syscall.Kill(-c.pid, sig)
}

func (c *Child) finish(ws syscall.WaitStatus, err error) {
	c.mu.Lock()
	if c.exited {
		c.mu.Unlock()
		return
	}
	c.exited = true
	c.status, c.err = ws, err
	if c.pidfd >= 0 {
		syscall.Close(c.pidfd)
		c.pidfd = -1
	}
	c.mu.Unlock()
	close(c.done)
}

// describeWaitStatus renders ws for logs.
func describeWaitStatus(ws syscall.WaitStatus) string {
	switch {
	case ws.Exited():
		return fmt.Sprintf("exit %d", ws.ExitStatus())
	case ws.Signaled():
		return fmt.Sprintf("signal %d (%v)", int(ws.Signal()), ws.Signal())
	default:
		return fmt.Sprintf("status %#x", uint32(ws))
	}
}
