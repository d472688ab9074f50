package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc"
)

// Holds are in-memory checkpoints of a running sandbox: its VM frozen at
// an instant (vmm.VM.Freeze), kept by ID as a frozen base in RAM, with no
// file written. A sandbox in a VMM process (ProcessOptions) has the
// process keep them, so they outlive the caller (a daemon restarted or
// killed finds them again through Attach and Held); an in-process
// sandbox keeps them itself, until Close.
//
// The cost: the first hold (or fork) of a sandbox whose RAM is a shared
// memfd (one booted by Start) costs no copy, since that memfd becomes the
// base and the guest goes on copy-on-write over it. Every later hold, and
// the first of a sandbox restored or forked (whose RAM is copy-on-write
// already), copies the guest's non-zero pages into a new memfd (RAM, not
// a file). A base stays in RAM while its hold, a Frozen or a sandbox
// restored over it lives; the guest's pages it wrote since are its own.
// The guest is not synced for a hold (its page cache is in the frozen
// RAM) and, as with Save, disks are not copied.

// ErrNotHeld is what errors.Is finds for a hold ID a sandbox does not
// hold (vmmproc.ErrNotHeld).
var ErrNotHeld = vmmproc.ErrNotHeld

// ErrHoldExists is what errors.Is finds for a hold ID a sandbox holds
// already (vmmproc.ErrHoldExists).
var ErrHoldExists = vmmproc.ErrHoldExists

// Frozen is an in-memory checkpoint handed out of the sandbox that holds
// it (Sandbox.Frozen): the frozen VM's state and a descriptor of its
// base. RestoreFrozen starts sandboxes over it, Adopt has another sandbox
// hold it. Close lets go of the descriptor (the hold it came from stays).
// It is safe for concurrent use, but Close must not race a RestoreFrozen
// or Adopt of it.
type Frozen struct {
	id       string
	state    *vmm.State
	base     *os.File
	labels   map[string]string
	hostname string

	closeOnce sync.Once
	closeErr  error
}

// newFrozen makes the Frozen of hold id from the hold's state, base and
// labels; it owns base from the call on.
func newFrozen(id string, st *vmm.State, base *os.File, labels map[string]string) (*Frozen, error) {
	hostname, ok := labels[LabelHostname]
	if !ok {
		base.Close()
		return nil, fmt.Errorf("sandbox: hold %q is not a sandbox's (no %s label)", id, LabelHostname)
	}
	if err := CheckHostname(hostname); err != nil {
		base.Close()
		return nil, fmt.Errorf("sandbox: hold %q: %w", id, err)
	}
	return &Frozen{id: id, state: st, base: base, labels: maps.Clone(labels), hostname: hostname}, nil
}

// ID returns the ID the checkpoint was held under.
func (f *Frozen) ID() string { return f.id }

// Hostname returns the guest's host name at the hold.
func (f *Frozen) Hostname() string { return f.hostname }

// Image returns the manifest digest of the frozen sandbox's image root, ""
// when its root is not an image.
func (f *Frozen) Image() string { return imageOf(f.state.Specs()) }

// Devices returns the specs of the frozen VM's devices, in order.
func (f *Frozen) Devices() []virtio.DeviceSpec { return f.state.Specs() }

// MemoryMiB returns the frozen VM's RAM, in MiB.
func (f *Frozen) MemoryMiB() int { return f.state.MemoryMiB }

// CPUs returns the frozen VM's vCPUs.
func (f *Frozen) CPUs() int { return f.state.CPUs }

// Close lets go of the checkpoint's descriptor; its base stays in RAM
// while a hold of it or a sandbox restored over it lives.
func (f *Frozen) Close() error {
	f.closeOnce.Do(func() {
		if err := f.base.Close(); err != nil {
			f.closeErr = fmt.Errorf("sandbox: close frozen %q: %w", f.id, err)
		}
	})
	return f.closeErr
}

// dupBase returns a duplicate of f's base descriptor, the caller's to
// close.
func (f *Frozen) dupBase() (*os.File, error) {
	if f == nil || f.base == nil {
		return nil, errors.New("sandbox: no frozen checkpoint")
	}
	fd, err := unix.FcntlInt(f.base.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("sandbox: frozen %q: duplicate its base (closed already?): %w", f.id, err)
	}
	return os.NewFile(uintptr(fd), "kiln-frozen-"+f.id), nil
}

// imageOf returns the image digest of the image root among specs, "" when
// there is none.
func imageOf(specs []virtio.DeviceSpec) string {
	for _, d := range specs {
		if d.Kind == virtio.KindFS && d.FS != nil {
			return d.FS.Image
		}
	}
	return ""
}

// Hold freezes the running sandbox (or the paused one: it stays paused)
// and keeps the checkpoint under id: in its VMM process when it has one,
// where the checkpoint outlives this process, else in the sandbox until
// Close. The sandbox runs on. id is 1 to 128 bytes of letters, digits,
// '.', '_' and '-'; an id held already is ErrHoldExists; a VMM process
// holds at most vmmproc.MaxHolds. See above for what a hold costs.
func (s *Sandbox) Hold(ctx context.Context, id string) error {
	s.life.Lock()
	defer s.life.Unlock()
	labels := map[string]string{LabelHostname: s.hostname}
	switch m := s.m.(type) {
	case *processVM:
		if err := m.p.Hold(ctx, id, labels); err != nil {
			return fmt.Errorf("sandbox: %w", err)
		}
		return nil
	case *localVM:
		return m.holds.hold(ctx, m.vm, id, labels)
	}
	return errors.New("sandbox: hold: no VM")
}

// Release drops the hold id: its base goes once no Frozen of it and no
// sandbox restored over it is left. Releasing an id that is not held is
// no error.
func (s *Sandbox) Release(ctx context.Context, id string) error {
	var err error
	switch m := s.m.(type) {
	case *processVM:
		err = m.p.Release(ctx, id)
	case *localVM:
		err = m.holds.release(id)
	default:
		return errors.New("sandbox: release: no VM")
	}
	if err != nil && !errors.Is(err, ErrNotHeld) {
		return fmt.Errorf("sandbox: %w", err)
	}
	return nil
}

// Held returns the IDs of the sandbox's holds, sorted.
func (s *Sandbox) Held(ctx context.Context) ([]string, error) {
	switch m := s.m.(type) {
	case *processVM:
		ids, err := m.p.Held(ctx)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		return ids, nil
	case *localVM:
		return m.holds.ids(), nil
	}
	return nil, errors.New("sandbox: held: no VM")
}

// Frozen hands out the hold id (the hold stays): what RestoreFrozen
// starts sandboxes from and Adopt gives another sandbox. The caller
// closes it. An unknown id is ErrNotHeld.
func (s *Sandbox) Frozen(ctx context.Context, id string) (*Frozen, error) {
	switch m := s.m.(type) {
	case *processVM:
		st, base, labels, err := m.p.TakeHeld(ctx, id)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		return newFrozen(id, st, base, labels)
	case *localVM:
		return m.holds.frozen(id)
	}
	return nil, errors.New("sandbox: frozen: no VM")
}

// Adopt has the sandbox hold f under f.ID() (in its VMM process when it
// has one), as if Hold had made it: so that a checkpoint of another
// sandbox (one about to close, say, as at a rollback) lives on with this
// one. No memory is copied. f stays the caller's to close. An id held
// already is ErrHoldExists.
func (s *Sandbox) Adopt(ctx context.Context, f *Frozen) error {
	if f == nil || f.base == nil {
		return errors.New("sandbox: adopt: no frozen checkpoint")
	}
	switch m := s.m.(type) {
	case *processVM:
		if err := m.p.GiveHeld(ctx, f.id, f.state, f.base, f.labels); err != nil {
			return fmt.Errorf("sandbox: adopt: %w", err)
		}
		return nil
	case *localVM:
		return m.holds.adopt(f)
	}
	return errors.New("sandbox: adopt: no VM")
}

// RestoreFrozen starts a sandbox from f, as Restore does from a snapshot:
// its own VMM process when opts.Process is set (else in this process),
// its memory f's base mapped copy-on-write (no copy: every sandbox
// restored from f shares the pages none of them wrote), its devices f's
// with a vsock socket of its own, opts.Net and opts.Disks. It waits until
// the agent answers, then gives the guest fresh entropy, the host's time
// and opts.Hostname (f's host name when empty). f may be closed once it
// returns.
func RestoreFrozen(ctx context.Context, f *Frozen, opts RestoreOptions) (*Sandbox, error) {
	start := time.Now()
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	if f == nil || f.base == nil {
		return nil, errors.New("sandbox: restore: no frozen checkpoint")
	}
	if opts.Hostname != "" {
		if err := CheckHostname(opts.Hostname); err != nil {
			return nil, err
		}
	}
	return restore(ctx, restoreSource{
		what: fmt.Sprintf("hold %q", f.id), hostname: f.hostname, devices: f.state.Specs(),
		machine: func(s *Sandbox, cfg vmm.RestoreConfig) (machine, error) {
			return s.frozenMachine(ctx, f, cfg, opts.Process)
		},
	}, opts, log, start)
}

// frozenMachine builds the machine of a sandbox restored over f's base.
func (s *Sandbox) frozenMachine(ctx context.Context, f *Frozen, cfg vmm.RestoreConfig, proc *ProcessOptions) (machine, error) {
	if proc != nil {
		return s.processMachine(ctx, *proc, cfg.Console, cfg.Devices, func(p *vmmproc.Process) error {
			return p.RestoreFork(ctx, f.state, f.base, cfg.Devices)
		})
	}
	// The mapping owns the descriptor it is given: a duplicate of f's,
	// outside any File (whose finalizer would close it).
	fd, err := unix.FcntlInt(f.base.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("sandbox: restore hold %q: duplicate its base (closed already?): %w", f.id, err)
	}
	mem, err := memory.MapFile(fd, f.state.Layout(), true)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("sandbox: restore hold %q: %w", f.id, err)
	}
	vm, err := vmm.Restore(cfg, f.state, mem)
	if err != nil {
		return nil, fmt.Errorf("sandbox: restore hold %q: %w", f.id, err)
	}
	return newLocalVM(vm), nil
}

// Refresh makes the running guest unique as a restore does: fresh entropy
// for its RNG, the host's time and, when hostname is not empty, that host
// name. It is for a sandbox handed out under a new identity (one of a
// warm pool's, say) that was not restored for it.
func (s *Sandbox) Refresh(ctx context.Context, hostname string) error {
	if hostname != "" {
		if err := CheckHostname(hostname); err != nil {
			return err
		}
	}
	s.life.Lock()
	defer s.life.Unlock()
	if s.client == nil {
		return errors.New("sandbox: refresh: no agent")
	}
	return s.freshen(ctx, hostname, "")
}

// localHolds are the holds of a sandbox in this process. The zero value
// holds nothing.
type localHolds struct {
	mu     sync.Mutex
	holds  map[string]*Frozen
	closed bool
}

// reserve claims id for a hold about to be made (a nil entry).
func (h *localHolds) reserve(id string) error {
	if err := vmmproc.CheckHoldID(id); err != nil {
		return fmt.Errorf("sandbox: hold: %w", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	switch {
	case h.closed:
		return errors.New("sandbox: hold: the sandbox is closed")
	case h.holds == nil:
		h.holds = map[string]*Frozen{}
	}
	if _, ok := h.holds[id]; ok {
		return fmt.Errorf("sandbox: hold %q: %w", id, ErrHoldExists)
	}
	if len(h.holds) >= vmmproc.MaxHolds {
		return fmt.Errorf("sandbox: hold %q: %d holds already: at most %d (release some)", id, len(h.holds), vmmproc.MaxHolds)
	}
	h.holds[id] = nil
	return nil
}

// settle fills id's reservation with f, or drops it when f is nil.
func (h *localHolds) settle(id string, f *Frozen) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if f != nil && !h.closed {
		h.holds[id] = f
		return
	}
	delete(h.holds, id)
	if f != nil {
		f.Close()
	}
}

// hold freezes vm and keeps the checkpoint under id.
func (h *localHolds) hold(ctx context.Context, vm *vmm.VM, id string, labels map[string]string) error {
	if err := h.reserve(id); err != nil {
		return err
	}
	st, base, err := vm.Freeze(ctx)
	if err != nil {
		h.settle(id, nil)
		return fmt.Errorf("sandbox: hold %q: %w", id, err)
	}
	f, err := newFrozen(id, st, base, labels)
	if err != nil {
		h.settle(id, nil)
		return err
	}
	h.settle(id, f)
	return nil
}

// adopt keeps a duplicate of f under f's ID.
func (h *localHolds) adopt(f *Frozen) error {
	if err := h.reserve(f.id); err != nil {
		return fmt.Errorf("sandbox: adopt: %w", err)
	}
	base, err := f.dupBase()
	if err != nil {
		h.settle(f.id, nil)
		return err
	}
	h.settle(f.id, &Frozen{id: f.id, state: f.state, base: base, labels: f.labels, hostname: f.hostname})
	return nil
}

// frozen returns a Frozen of hold id with a descriptor of its own.
func (h *localHolds) frozen(id string) (*Frozen, error) {
	if err := vmmproc.CheckHoldID(id); err != nil {
		return nil, fmt.Errorf("sandbox: frozen: %w", err)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	f := h.holds[id]
	if f == nil {
		return nil, fmt.Errorf("sandbox: frozen %q: %w", id, ErrNotHeld)
	}
	base, err := f.dupBase()
	if err != nil {
		return nil, err
	}
	return &Frozen{id: id, state: f.state, base: base, labels: f.labels, hostname: f.hostname}, nil
}

// release drops hold id.
func (h *localHolds) release(id string) error {
	if err := vmmproc.CheckHoldID(id); err != nil {
		return fmt.Errorf("release: %w", err)
	}
	h.mu.Lock()
	f := h.holds[id]
	if f != nil {
		delete(h.holds, id)
	}
	h.mu.Unlock()
	if f == nil {
		return fmt.Errorf("release %q: %w", id, ErrNotHeld)
	}
	return f.Close()
}

// ids returns the IDs held, sorted.
func (h *localHolds) ids() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for id, f := range h.holds {
		if f != nil {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

// closeAll drops every hold; later holds are refused.
func (h *localHolds) closeAll() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.closed = true
	for id, f := range h.holds {
		if f != nil {
			f.Close()
		}
		delete(h.holds, id)
	}
}
