package vmmproc

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/vmm"
	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// Holds are frozen bases (in-memory checkpoints) a VMM process keeps by ID
// for its parent: a parent that restarts, or is killed, finds them again
// in the process (ListHeld, TakeHeld) and restores children over them
// (RestoreFork), since nothing of them lies in the parent or in a file.
// They last until Release or the process's exit.
//
// The first hold (or freeze) of a VM whose RAM is a shared memfd (a VM
// booted in the process) costs no copy: that memfd becomes the base and
// the VM goes on copy-on-write over it. Every later one copies the guest's
// non-zero pages into a new memfd: RAM, not a file. A base stays in RAM
// until its last holder (this process, a child mapping it) lets go.

// Limits on holds.
const (
	// MaxHolds is how many holds one VMM process keeps at most.
	MaxHolds = 256
	// MaxHoldID is the longest hold ID, in bytes.
	MaxHoldID = 128

	maxHoldLabels     = 16
	maxHoldLabelKey   = 128
	maxHoldLabelValue = 1024
)

// ErrNotHeld says that a VMM process holds nothing under an ID.
var ErrNotHeld = errors.New("no hold under that ID")

// ErrHoldExists says that a VMM process holds something under an ID
// already.
var ErrHoldExists = errors.New("a hold under that ID exists already")

// CheckHoldID returns an error naming what is wrong with a hold ID: it
// must be 1 to MaxHoldID bytes of letters, digits, '.', '_' and '-'.
func CheckHoldID(id string) error {
	if id == "" {
		return errors.New("hold ID is empty")
	}
	if len(id) > MaxHoldID {
		return fmt.Errorf("hold ID is %d bytes: at most %d", len(id), MaxHoldID)
	}
	for i := 0; i < len(id); i++ {
		c := id[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("hold ID %.140q: byte %d is %q; want only letters, digits, '.', '_' and '-'", id, i, c)
		}
	}
	return nil
}

// checkHoldLabels returns an error naming what is wrong with a hold's
// labels.
func checkHoldLabels(labels map[string]string) error {
	if len(labels) > maxHoldLabels {
		return fmt.Errorf("%d labels: at most %d", len(labels), maxHoldLabels)
	}
	for k, v := range labels {
		if k == "" || len(k) > maxHoldLabelKey {
			return fmt.Errorf("label key %.140q: want 1 to %d bytes", k, maxHoldLabelKey)
		}
		if len(v) > maxHoldLabelValue {
			return fmt.Errorf("label %q: value of %d bytes: at most %d", k, len(v), maxHoldLabelValue)
		}
	}
	return nil
}

// held is one hold: a frozen VM's state (JSON, checked) and its base.
type held struct {
	state  []byte
	base   *os.File
	labels map[string]string
}

// holdTable is a VMM process's holds. An ID is reserved (nil) while its
// hold is being made, so that two Holds of one ID do not both freeze.
type holdTable struct {
	mu    sync.Mutex
	holds map[string]*held
}

func newHoldTable() *holdTable { return &holdTable{holds: map[string]*held{}} }

// reserve claims id for a hold about to be made; finish or cancel ends
// the reservation.
func (t *holdTable) reserve(id string) error {
	if err := CheckHoldID(id); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if _, ok := t.holds[id]; ok {
		return status.Errorf(codes.AlreadyExists, "hold %q exists already", id)
	}
	if len(t.holds) >= MaxHolds {
		return status.Errorf(codes.ResourceExhausted, "%d holds already: at most %d (release some)", len(t.holds), MaxHolds)
	}
	t.holds[id] = nil
	return nil
}

// finish fills id's reservation with h.
func (t *holdTable) finish(id string, h *held) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.holds[id] = h
}

// cancel drops id's reservation.
func (t *holdTable) cancel(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.holds[id] == nil {
		delete(t.holds, id)
	}
}

// get returns the hold under id and a duplicate of its base, which the
// caller closes.
func (t *holdTable) get(id string) (*held, *os.File, error) {
	if err := CheckHoldID(id); err != nil {
		return nil, nil, status.Error(codes.InvalidArgument, err.Error())
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	h := t.holds[id]
	if h == nil {
		return nil, nil, status.Errorf(codes.NotFound, "no hold %q", id)
	}
	fd, err := unix.FcntlInt(h.base.Fd(), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, nil, status.Errorf(codes.ResourceExhausted, "duplicate hold %q's base: %v", id, err)
	}
	return h, os.NewFile(uintptr(fd), "kiln-held-"+id), nil
}

// release drops the hold under id and closes its base.
func (t *holdTable) release(id string) error {
	if err := CheckHoldID(id); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	t.mu.Lock()
	h := t.holds[id]
	if h != nil {
		delete(t.holds, id)
	}
	t.mu.Unlock()
	if h == nil {
		return status.Errorf(codes.NotFound, "no hold %q", id)
	}
	return h.base.Close()
}

// ids returns the IDs of the holds made, sorted.
func (t *holdTable) ids() []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []string
	for id, h := range t.holds {
		if h != nil {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

// closeAll drops every hold.
func (t *holdTable) closeAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	for id, h := range t.holds {
		if h != nil {
			h.base.Close()
		}
		delete(t.holds, id)
	}
}

func (s *server) Hold(ctx context.Context, req *vmmpb.HoldRequest) (*vmmpb.HoldResponse, error) {
	if err := checkHoldLabels(req.Labels); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "hold %q: %v", req.Id, err)
	}
	vm, err := s.current()
	if err != nil {
		return nil, err
	}
	if err := s.holds.reserve(req.Id); err != nil {
		return nil, err
	}
	done := false
	defer func() {
		if !done {
			s.holds.cancel(req.Id)
		}
	}()
	st, base, err := vm.Freeze(ctx)
	if err != nil {
		return nil, statusFor(err)
	}
	b, err := json.Marshal(st)
	if err != nil {
		base.Close()
		return nil, status.Errorf(codes.Internal, "encode state: %v", err)
	}
	s.holds.finish(req.Id, &held{state: b, base: base, labels: maps.Clone(req.Labels)})
	done = true
	s.log.Info("holding a frozen base", "id", req.Id)
	return &vmmpb.HoldResponse{}, nil
}

func (s *server) TakeHeld(_ context.Context, req *vmmpb.TakeHeldRequest) (*vmmpb.TakeHeldResponse, error) {
	h, f, err := s.holds.get(req.Id)
	if err != nil {
		return nil, err
	}
	token, err := newToken()
	if err == nil {
		err = s.fds.put(token, f)
	}
	if err != nil {
		f.Close()
		return nil, status.Errorf(codes.ResourceExhausted, "hand out hold %q's base: %v", req.Id, err)
	}
	return &vmmpb.TakeHeldResponse{StateJson: h.state, MemoryToken: token, Labels: h.labels}, nil
}

func (s *server) GiveHeld(_ context.Context, req *vmmpb.GiveHeldRequest) (*vmmpb.GiveHeldResponse, error) {
	// The descriptor is the caller's to hand over whatever else is wrong:
	// take it first, so that a refusal does not leave it in the store.
	var base *os.File
	if validToken(req.MemoryToken) {
		base, _ = s.fds.take(req.MemoryToken)
	}
	keep := false
	defer func() {
		if base != nil && !keep {
			base.Close()
		}
	}()
	if err := checkHoldLabels(req.Labels); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "hold %q: %v", req.Id, err)
	}
	var st vmm.State
	if err := decodeStrict(req.StateJson, &st); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "hold %q: state: %v", req.Id, err)
	}
	if err := st.Validate(); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "hold %q: state: %v", req.Id, err)
	}
	if base == nil {
		return nil, status.Errorf(codes.FailedPrecondition, "hold %q: no base under memory token %.40q on the descriptor socket (PUT it first)", req.Id, req.MemoryToken)
	}
	if err := checkBase(base, &st); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "hold %q: %v", req.Id, err)
	}
	if err := s.holds.reserve(req.Id); err != nil {
		return nil, err
	}
	s.holds.finish(req.Id, &held{state: req.StateJson, base: base, labels: maps.Clone(req.Labels)})
	keep = true
	s.log.Info("adopted a frozen base", "id", req.Id)
	return &vmmpb.GiveHeldResponse{}, nil
}

// checkBase refuses a base that cannot be st's memory: not a regular
// file, or smaller than st's RAM.
func checkBase(base *os.File, st *vmm.State) error {
	fi, err := base.Stat()
	if err != nil {
		return fmt.Errorf("base: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("base is a %v, not a memory file", fi.Mode().Type())
	}
	var need uint64
	for _, r := range st.Memory {
		need = max(need, r.Offset+r.Size)
	}
	if uint64(fi.Size()) < need {
		return fmt.Errorf("base is %d bytes; the state's memory needs %d", fi.Size(), need)
	}
	return nil
}

func (s *server) Release(_ context.Context, req *vmmpb.ReleaseRequest) (*vmmpb.ReleaseResponse, error) {
	if err := s.holds.release(req.Id); err != nil {
		if status.Code(err) != codes.Unknown {
			return nil, err
		}
		return nil, status.Errorf(codes.Internal, "release hold %q: %v", req.Id, err)
	}
	s.log.Info("released a frozen base", "id", req.Id)
	return &vmmpb.ReleaseResponse{}, nil
}

func (s *server) ListHeld(context.Context, *vmmpb.ListHeldRequest) (*vmmpb.ListHeldResponse, error) {
	return &vmmpb.ListHeldResponse{Ids: s.holds.ids()}, nil
}

// holdErr is rpcErr for the hold calls: NotFound and AlreadyExists become
// ErrNotHeld and ErrHoldExists, which callers tell apart.
func (p *Process) holdErr(op, id string, err error) error {
	switch status.Code(err) {
	case codes.NotFound:
		return fmt.Errorf("vmmproc: %s %q: %w", op, id, ErrNotHeld)
	case codes.AlreadyExists:
		return fmt.Errorf("vmmproc: %s %q: %w", op, id, ErrHoldExists)
	}
	return p.rpcErr(op+" "+fmt.Sprintf("%q", id), err)
}

// Hold freezes the process's VM (as Freeze) and has the process keep the
// state and the base under id, with labels, until Release or its exit.
// The VM goes on running (or stays paused). id must pass CheckHoldID; an
// id held already is ErrHoldExists. See the cost of a hold above
// MaxHolds.
func (p *Process) Hold(ctx context.Context, id string, labels map[string]string) error {
	if err := CheckHoldID(id); err != nil {
		return fmt.Errorf("vmmproc: hold: %w", err)
	}
	_, err := p.api.Hold(ctx, &vmmpb.HoldRequest{Id: id, Labels: labels})
	if err != nil {
		return p.holdErr("hold", id, err)
	}
	return nil
}

// TakeHeld returns the hold under id: the frozen VM's state, a descriptor
// of its base (the caller's to close) and its labels. The hold stays in
// the process. An unknown id is ErrNotHeld.
func (p *Process) TakeHeld(ctx context.Context, id string) (*vmm.State, *os.File, map[string]string, error) {
	if err := CheckHoldID(id); err != nil {
		return nil, nil, nil, fmt.Errorf("vmmproc: take held: %w", err)
	}
	resp, err := p.api.TakeHeld(ctx, &vmmpb.TakeHeldRequest{Id: id})
	if err != nil {
		return nil, nil, nil, p.holdErr("take held", id, err)
	}
	var st vmm.State
	if err := decodeStrict(resp.StateJson, &st); err != nil {
		return nil, nil, nil, fmt.Errorf("vmmproc: take held %q: state: %w", id, err)
	}
	f, err := getFD(ctx, FDSocket(p.sock), resp.MemoryToken)
	if err != nil {
		return nil, nil, nil, fmt.Errorf("vmmproc: take held %q: %w", id, err)
	}
	return &st, f, resp.Labels, nil
}

// GiveHeld has the process hold st and its base (made by another VMM
// process: TakeHeld of it) under id, with labels. The caller keeps its
// own descriptor of base. An id held already is ErrHoldExists.
func (p *Process) GiveHeld(ctx context.Context, id string, st *vmm.State, base *os.File, labels map[string]string) error {
	if err := CheckHoldID(id); err != nil {
		return fmt.Errorf("vmmproc: give held: %w", err)
	}
	if st == nil || base == nil {
		return fmt.Errorf("vmmproc: give held %q: no state or no base", id)
	}
	sb, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("vmmproc: give held %q: %w", id, err)
	}
	token, err := newToken()
	if err != nil {
		return fmt.Errorf("vmmproc: give held %q: %w", id, err)
	}
	if err := putFD(ctx, FDSocket(p.sock), token, base); err != nil {
		return fmt.Errorf("vmmproc: give held %q: %w", id, err)
	}
	_, err = p.api.GiveHeld(ctx, &vmmpb.GiveHeldRequest{Id: id, StateJson: sb, MemoryToken: token, Labels: labels})
	if err != nil {
		return p.holdErr("give held", id, err)
	}
	return nil
}

// Release drops the hold under id and closes the process's descriptor of
// its base (children restored over it keep theirs). An unknown id is
// ErrNotHeld.
func (p *Process) Release(ctx context.Context, id string) error {
	if err := CheckHoldID(id); err != nil {
		return fmt.Errorf("vmmproc: release: %w", err)
	}
	_, err := p.api.Release(ctx, &vmmpb.ReleaseRequest{Id: id})
	if err != nil {
		return p.holdErr("release", id, err)
	}
	return nil
}

// Held returns the IDs of the process's holds, sorted.
func (p *Process) Held(ctx context.Context) ([]string, error) {
	resp, err := p.api.ListHeld(ctx, &vmmpb.ListHeldRequest{})
	if err != nil {
		return nil, p.rpcErr("list held", err)
	}
	return resp.Ids, nil
}
