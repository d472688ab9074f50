package daemon

// This file is the server: its construction, its start slots and Close.

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sync"

	"google.golang.org/grpc"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Server implements kilnpb.KilnServer.
type Server struct {
	kilnpb.UnimplementedKilnServer

	cfg     Config
	log     *slog.Logger
	starts  chan struct{} // a slot per sandbox starting (Config.MaxStarting)
	clock   Clock
	backend Backend
	events  *broker
	metrics *metrics

	// ctx ends with Close: watchers and event streams stop.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// mu guards the maps; a box's own mutex is taken after it, never
	// before.
	mu          sync.Mutex
	boxes       map[string]*box
	requests    map[string]*box         // create request ID → sandbox
	forks       map[string]*forkRequest // fork request ID → children
	checkpoints map[string]*checkpointRecord
	// Templates: ready ones by ID, and every one (building too) by the
	// request ID that made it.
	templates    map[string]*template
	templateReqs map[string]*template
	// volumes by ID (volumes.go).
	volumes map[string]*vol
	// What template builders and pools hold of the host, beyond the
	// boxes: sandboxes and their memory.
	building, pooled       int
	buildingMiB, pooledMiB uint64
	closed                 bool
}

// The folders under StateDir.
const (
	sandboxesDir   = "sandboxes"
	checkpointsDir = "checkpoints"
	templatesDir   = "templates"
	hibernatedDir  = "hibernated" // ID/ per hibernated sandbox: its snapshot
	volumesDir     = "volumes"    // ID.ext4 and ID.json per volume
)

// New makes a server over cfg.StateDir, taking over every sandbox its
// records list as live: one whose VMM process still runs is listed again
// with its ID and state; one whose process is gone becomes failed, with
// the reason.
func New(cfg Config) (*Server, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	for _, d := range []string{sandboxesDir, checkpointsDir, templatesDir, hibernatedDir, volumesDir} {
		if err := os.MkdirAll(filepath.Join(cfg.StateDir, d), 0o700); err != nil {
			return nil, fmt.Errorf("daemon: state folder: %w", err)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{
		cfg: cfg, log: cfg.Logger, clock: cfg.Clock, backend: cfg.Backend, events: newBroker(),
		starts: make(chan struct{}, cfg.MaxStarting),
		ctx:    ctx, cancel: cancel,
		boxes: map[string]*box{}, requests: map[string]*box{}, forks: map[string]*forkRequest{},
		checkpoints: map[string]*checkpointRecord{},
		templates:   map[string]*template{}, templateReqs: map[string]*template{}, volumes: map[string]*vol{},
	}
	s.metrics = newMetrics(s)
	s.chargeRuntime()
	s.loadTemplates()
	s.loadVolumes()
	if err := s.load(); err != nil {
		cancel()
		return nil, err
	}
	s.cleanLeftovers()
	s.pruneNets()
	s.pruneCgroups()
	s.pruneHibernated()
	s.startPools()
	return s, nil
}

// create starts a sandbox through the backend. Its caller holds a start
// slot (bootCtx, takeStartSlot); a ctx that ended while it waited for one
// says why (its cause).
func (s *Server) create(ctx context.Context, spec CreateSpec) (Instance, error) {
	if ctx.Err() != nil {
		return nil, context.Cause(ctx)
	}
	return s.createInCgroup(ctx, spec)
}

// takeStartSlot waits under ctx for one of the Config.MaxStarting start
// slots and returns the func that frees it (once, however often called).
func (s *Server) takeStartSlot(ctx context.Context) (release func(), err error) {
	select {
	case s.starts <- struct{}{}:
	case <-ctx.Done():
		return nil, fmt.Errorf("waiting for a start slot (%d sandboxes are starting): %w", s.cfg.MaxStarting, ctx.Err())
	}
	var once sync.Once
	return func() { once.Do(func() { <-s.starts }) }, nil
}

// bootCtx waits under parent for a start slot, then returns a context
// bounded by Config.BootTimeout from that moment, so that a sandbox queued
// behind a burst of others does not spend its boot's time in the queue
// (100 creates at once on a slow host timed out waiting, before), and a
// cancel that ends it and frees the slot. When parent ends before a slot
// is free, the context is done already, its cause saying so (create
// returns it).
func (s *Server) bootCtx(parent context.Context) (context.Context, context.CancelFunc) {
	release, err := s.takeStartSlot(parent)
	if err != nil {
		ctx, cancel := context.WithCancelCause(parent)
		cancel(err)
		return ctx, func() {}
	}
	ctx, cancel := context.WithTimeout(parent, s.cfg.BootTimeout)
	return ctx, func() { cancel(); release() }
}

// Register registers the Kiln service on r.
func (s *Server) Register(r grpc.ServiceRegistrar) { kilnpb.RegisterKilnServer(r, s) }

// Close stops the server's timers, watchers and event streams, and the
// templates' pools (their sandboxes are closed: a later server refills
// them). The sandboxes run on: a server made later over the same state
// folder takes them over.
func (s *Server) Close(ctx context.Context) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	boxes := make([]*box, 0, len(s.boxes))
	for _, b := range s.boxes {
		boxes = append(boxes, b)
	}
	s.mu.Unlock()
	s.cancel()
	for _, b := range boxes {
		b.mu.Lock()
		if b.timer != nil {
			b.timer.Stop()
		}
		inst := b.inst
		b.mu.Unlock()
		if inst != nil {
			inst.Detach()
		}
	}
	done := make(chan struct{})
	go func() { s.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("daemon: close: %w", ctx.Err())
	}
}
