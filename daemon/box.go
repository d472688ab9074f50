package daemon

// This file is the box registry: the sandboxes the server knows, live or
// ended, by ID and by request ID, their records and their description.

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"os"
	"path/filepath"
	"sort"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// box is a sandbox the server knows, live or ended.
type box struct {
	id string
	mu sync.Mutex
	// rec is the record as the state folder has it (after persist).
	rec record
	// life is its state (boxstate.go): every operation asks its gate.
	life *boxLife
	// inst is its machine: set while it is running or paused (and while
	// an end closes it); nil while it starts, hibernates, is hibernated,
	// wakes or rolls back (the operation holds the machine), and once it
	// has ended.
	inst Instance
	// ctx ends when the sandbox does (or rolls back): its background
	// execs go with it. A rollback replaces it, under mu.
	ctx    context.Context
	cancel context.CancelFunc
	// ready is closed once the create that made it has finished.
	ready     chan struct{}
	createErr error
	// cgroupMax is the memory.max growCgroup last set on the cgroup at
	// path (a rollback's new machine has a cgroup of its own).
	cgroupMax struct {
		path  string
		bytes uint64
	}
	// lastActive and busy (calls in flight) drive the idle timeout.
	lastActive time.Time
	busy       int
	// streams are the calls of busy that follow the sandbox for as long
	// as it runs (background execs' streams, AttachExec, WatchDir): a
	// pause or hibernation does not wait for them (a hibernation ends
	// them; the processes run on in the guest).
	streams int
	// forwards are its ForwardPort calls in flight (MaxForwardsPerBox).
	forwards int
	timer    Timer
	execs    *execTable
	// secrets are the sandbox's secrets, in this process's memory only
	// (its VMM process keeps them too: see secrets.go); rec names them.
	secrets []secret
	// samples are its metrics (sandboxmetrics.go).
	samples sampleRing
}

func newBox(id string) *box {
	ctx, cancel := context.WithCancel(context.Background())
	return &box{id: id, life: newBoxLife(id, boxStarting), ctx: ctx, cancel: cancel, ready: make(chan struct{}), execs: newExecTable()}
}

// indexRequest remembers the request ID that made b.
func (s *Server) indexRequest(b *box) {
	r := &b.rec
	if r.RequestID == "" {
		return
	}
	if isForkKey(r.RequestKey) {
		f := s.forks[r.RequestID]
		if f == nil {
			f = &forkRequest{key: r.RequestKey, done: make(chan struct{})}
			close(f.done)
			s.forks[r.RequestID] = f
		}
		f.children = append(f.children, b.id)
		sort.Strings(f.children)
		return
	}
	s.requests[r.RequestID] = b
}

// pruneEnded forgets the oldest ended sandboxes beyond Config.KeepEnded.
func (s *Server) pruneEnded() {
	s.mu.Lock()
	defer s.mu.Unlock()
	type endedBox struct {
		b     *box
		ended int64
		req   string
		fork  bool // req is a fork's (s.forks), not a create's
	}
	var ended []endedBox
	for _, b := range s.boxes {
		b.mu.Lock()
		if b.life.get().ended() {
			ended = append(ended, endedBox{b, b.rec.EndedUnixMS, b.rec.RequestID, isForkKey(b.rec.RequestKey)})
		}
		b.mu.Unlock()
	}
	if len(ended) <= s.cfg.KeepEnded {
		return
	}
	sort.Slice(ended, func(i, j int) bool { return ended[i].ended < ended[j].ended })
	for _, x := range ended[:len(ended)-s.cfg.KeepEnded] {
		delete(s.boxes, x.b.id)
		if x.fork {
			s.forgetForkChildLocked(x.req, x.b.id)
		} else if s.requests[x.req] == x.b {
			delete(s.requests, x.req)
		}
		os.Remove(s.recordPath(x.b.id))
	}
}

func (s *Server) recordPath(id string) string {
	return filepath.Join(s.cfg.StateDir, sandboxesDir, id+".json")
}

// persistLocked writes b's record; b.mu is held. A failure is logged: the
// sandbox runs on, and the next change writes the record again.
func (s *Server) persistLocked(b *box) {
	if err := writeJSON(s.recordPath(b.id), &b.rec); err != nil {
		s.log.Error("sandbox record not written", "sandbox", b.id, "err", err)
	}
}

func (s *Server) publish(kind kilnpb.Event_Kind, sb *kilnpb.Sandbox, reason string) {
	s.events.publish(&kilnpb.Event{Kind: kind, SandboxId: sb.Id, Reason: reason, UnixMs: s.clock.Now().UnixMilli(), Sandbox: sb})
}

// protoLocked describes b; b.mu is held.
func (s *Server) protoLocked(b *box) *kilnpb.Sandbox {
	r := &b.rec
	st, hib := b.life.public()
	pb := &kilnpb.Sandbox{
		Id: r.ID, State: st, Reason: r.Reason, Image: r.Image, Checkpoint: r.Checkpoint,
		Template: r.Template, FromPool: r.FromPool,
		Resources:     &kilnpb.Resources{Cpus: r.CPUs, MemoryMib: r.MemoryMiB, DiskMib: r.DiskMiB},
		Labels:        r.Labels,
		CreatedUnixMs: r.CreatedUnixMS, ExpiresUnixMs: r.ExpiresUnixMS, IdleTimeoutMs: r.IdleTimeoutMS,
		LastActiveUnixMs: b.lastActive.UnixMilli(), Pid: int32(r.PID), ReadyMs: r.ReadyMS,
		SecretNames: r.SecretNames,
		Network:     netProto(r.Net),
		Cgroup:      r.Cgroup,
		Hibernated:  hib, TimeoutAction: r.TimeoutAction,
		Init: initName(r.Init), FilesOnly: hib && r.FilesOnly,
		Volumes: volumesProto(r.Volumes),
	}
	if !isLive(st) {
		pb.Pid, pb.Cgroup = 0, ""
	}
	return proto.Clone(pb).(*kilnpb.Sandbox)
}

// newID returns a new random ID with prefix.
func newID(prefix string) string {
	b := make([]byte, 8)
	rand.Read(b) // never fails (crypto/rand)
	return prefix + hex.EncodeToString(b)
}

// requestKey is the digest of req's fields but its request ID: a retry
// must have the same.
func requestKey(kind string, req proto.Message) string {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
	if err != nil {
		return kind + ":unencodable"
	}
	h := sha256.Sum256(b)
	return kind + ":" + hex.EncodeToString(h[:])
}

// lookup returns the sandbox id names.
func (s *Server) lookup(id string) (*box, error) {
	if err := checkID("sandbox ID", id); err != nil {
		return nil, err
	}
	s.mu.Lock()
	b := s.boxes[id]
	s.mu.Unlock()
	if b == nil {
		return nil, status.Errorf(codes.NotFound, "no sandbox %q", id)
	}
	return b, nil
}

// following marks a call of b that use let in as one of its streams (see
// box.streams) until the returned func is called.
func (b *box) following() func() {
	b.mu.Lock()
	b.streams++
	b.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			b.mu.Lock()
			b.streams--
			b.mu.Unlock()
		})
	}
}

// use returns the running instance of sandbox id for a call, marking the
// sandbox busy (the idle timer waits) until done is called.
func (s *Server) use(id string) (_ *box, _ Instance, done func(), _ error) {
	b, err := s.lookup(id)
	if err != nil {
		return nil, nil, nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if _, err := b.life.check(useOp); err != nil {
		return nil, nil, nil, err // not running
	}
	b.busy++
	b.lastActive = s.clock.Now()
	var once sync.Once
	return b, b.inst, func() {
		once.Do(func() {
			b.mu.Lock()
			b.busy--
			b.lastActive = s.clock.Now()
			b.mu.Unlock()
		})
	}, nil
}
