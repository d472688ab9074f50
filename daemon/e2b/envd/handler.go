// Package envd serves E2B's in-sandbox API (envd) for Kiln sandboxes: the
// Connect RPC services process.Process and filesystem.Filesystem, /files
// and /health, translated onto kiln.v1 calls. No E2B code runs in the
// guest: Kiln's own agent does the work. The caller (package e2b) routes a
// request to a sandbox and checks its access token first.
//
// envd's processes outlive the calls that start them, so every process is
// a kiln.v1 background exec. The Handler holds each one's Exec stream (its
// stdin, signals and terminal size) in a per-sandbox process table and fans
// its output out to the Start call and to any Connect calls; a process it
// does not hold (started before a restart of kilnd, or before a hibernate)
// is found by its PID among ListExecs and followed with AttachExec.
// Polling watchers (CreateWatcher) are kiln.v1 WatchDir streams held in a
// per-sandbox table. Every table is bounded, and an entry goes when its
// stream ends (its process exits, its sandbox ends).
package envd

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/filesystem/filesystempbconnect"
	"github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/process/processpbconnect"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Version is the envd version Kiln reports to SDKs: the highest whose
// features it implements (the SDK gates features on it): octet-stream and
// gzip uploads (0.5.7), closeStdin (0.5.2), recursive watches (0.1.4).
// Watch include_entry (0.6.3) is served too, but file metadata (0.6.2) is
// not, so the version stays below it.
const Version = "0.5.7"

// Limits bound what one Handler holds for its sandboxes.
type Limits struct {
	// ProcessesPerSandbox bounds a sandbox's process table (running
	// processes the Handler holds a stream of).
	ProcessesPerSandbox int
	// SubscribersPerProcess bounds the Start and Connect calls that
	// follow one process.
	SubscribersPerProcess int
	// EventBuffer is how many output events wait for one slow
	// subscriber before the process's output waits for it.
	EventBuffer int
	// WatchersPerSandbox bounds a sandbox's polling watchers.
	WatchersPerSandbox int
	// WatcherEvents bounds the events a polling watcher keeps until they
	// are fetched; older ones are dropped beyond it.
	WatcherEvents int
	// WatcherIdle is how long a polling watcher lives without a
	// GetWatcherEvents call.
	WatcherIdle time.Duration
	// MaxUpload bounds one file uploaded to /files (after gzip
	// decompression).
	MaxUpload int64
}

// DefaultLimits are the limits New uses when none are given.
var DefaultLimits = Limits{
	ProcessesPerSandbox:   256,
	SubscribersPerProcess: 16,
	EventBuffer:           64,
	WatchersPerSandbox:    32,
	WatcherEvents:         1024,
	WatcherIdle:           10 * time.Minute,
	MaxUpload:             16 << 30,
}

// An Option configures a Handler.
type Option func(*Handler)

// WithLimits replaces DefaultLimits; zero fields keep their defaults.
func WithLimits(l Limits) Option {
	return func(h *Handler) {
		d := DefaultLimits
		if l.ProcessesPerSandbox > 0 {
			d.ProcessesPerSandbox = l.ProcessesPerSandbox
		}
		if l.SubscribersPerProcess > 0 {
			d.SubscribersPerProcess = l.SubscribersPerProcess
		}
		if l.EventBuffer > 0 {
			d.EventBuffer = l.EventBuffer
		}
		if l.WatchersPerSandbox > 0 {
			d.WatchersPerSandbox = l.WatchersPerSandbox
		}
		if l.WatcherEvents > 0 {
			d.WatcherEvents = l.WatcherEvents
		}
		if l.WatcherIdle > 0 {
			d.WatcherIdle = l.WatcherIdle
		}
		if l.MaxUpload > 0 {
			d.MaxUpload = l.MaxUpload
		}
		h.limits = d
	}
}

// maxRequest bounds one Connect request message (stdin chunks are the
// largest).
const maxRequest = 8 << 20

// Handler serves envd for every sandbox of one kilnd.
type Handler struct {
	kiln   kilnpb.KilnClient
	log    *slog.Logger
	limits Limits
	mux    *http.ServeMux

	// base is the context of the streams the Handler holds beyond a
	// call (processes, polling watchers); Close cancels it.
	base   context.Context
	cancel context.CancelFunc

	mu        sync.Mutex
	sandboxes map[string]*sandboxState
	homes     homeCache
}

// sandboxState is what the Handler holds for one sandbox.
type sandboxState struct {
	procs    map[uint32]*proc
	watchers map[string]*watcher
}

// New returns a Handler that reaches sandboxes through kiln.
func New(kiln kilnpb.KilnClient, log *slog.Logger, opts ...Option) *Handler {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	h := &Handler{kiln: kiln, log: log, limits: DefaultLimits, sandboxes: map[string]*sandboxState{}}
	for _, o := range opts {
		o(h)
	}
	h.base, h.cancel = context.WithCancel(context.Background())
	h.homes = homeCache{m: map[homeKey]string{}}
	go h.watchEvents()
	copts := []connect.HandlerOption{connect.WithReadMaxBytes(maxRequest)}
	h.mux = http.NewServeMux()
	h.mux.Handle(processpbconnect.NewProcessHandler(&processService{h}, copts...))
	h.mux.Handle(filesystempbconnect.NewFilesystemHandler(&filesystemService{h}, copts...))
	h.mux.HandleFunc("/files", h.serveFiles)
	h.mux.HandleFunc("/health", func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusNoContent)
	})
	h.mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		httpError(w, http.StatusNotFound, "envd has no "+r.URL.Path)
	})
	return h
}

// Close lets go of every stream the Handler holds: the processes run on
// (they are background execs), polling watchers end.
func (h *Handler) Close() {
	h.cancel()
}

type sandboxKey struct{}

// Serve answers one envd request for sandbox id, which the caller has
// authorized.
func (h *Handler) Serve(w http.ResponseWriter, r *http.Request, id string) {
	if id == "" {
		httpError(w, http.StatusBadRequest, "no sandbox ID")
		return
	}
	h.mux.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), sandboxKey{}, id)))
}

// sandboxOf is the sandbox ID Serve put in ctx.
func sandboxOf(ctx context.Context) string {
	id, _ := ctx.Value(sandboxKey{}).(string)
	return id
}

// state returns id's state, made when missing. h.mu must be held.
func (h *Handler) stateLocked(id string) *sandboxState {
	s := h.sandboxes[id]
	if s == nil {
		s = &sandboxState{procs: map[uint32]*proc{}, watchers: map[string]*watcher{}}
		h.sandboxes[id] = s
	}
	return s
}

// tidyLocked drops id's state once it holds nothing. h.mu must be held.
func (h *Handler) tidyLocked(id string) {
	if s := h.sandboxes[id]; s != nil && len(s.procs) == 0 && len(s.watchers) == 0 {
		delete(h.sandboxes, id)
	}
}

// connectErr turns a kiln.v1 call's error into a Connect error of the
// same code (Connect's codes are gRPC's), naming what was asked.
func connectErr(what string, err error) error {
	if err == nil {
		return nil
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		return err
	}
	if errors.Is(err, context.Canceled) {
		return connect.NewError(connect.CodeCanceled, errors.New(what+": canceled"))
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return connect.NewError(connect.CodeDeadlineExceeded, errors.New(what+": deadline exceeded"))
	}
	st, ok := status.FromError(err)
	if !ok {
		return connect.NewError(connect.CodeInternal, errors.New(what+": "+err.Error()))
	}
	code := connect.CodeInternal
	if c := st.Code(); c != codes.OK && c <= codes.Unauthenticated {
		code = connect.Code(c)
	}
	return connect.NewError(code, errors.New(what+": "+st.Message()))
}

// codeOf is the gRPC code of a kiln.v1 call's error.
func codeOf(err error) codes.Code { return status.Code(err) }

func invalid(format string, args ...any) error {
	return connect.NewError(connect.CodeInvalidArgument, errorf(format, args...))
}

// timeoutHeader is a Connect call's deadline in milliseconds (the
// protocol's; connect-go has checked it: 1 to 10 digits). envd takes a
// Start's as the started process's lifetime: the SDKs' commands.run
// timeout (60 s unless given, background commands too; 0 sends none).
const timeoutHeader = "Connect-Timeout-Ms"

// processTimeoutMs is the lifetime in milliseconds a Start's header asks
// for its process, as envd reads it (a process that outlives it is
// killed); 0 when none.
func processTimeoutMs(hdr http.Header) (int64, error) {
	v := hdr.Get(timeoutHeader)
	if v == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s %q: want milliseconds", timeoutHeader, v)
	}
	return n, nil
}

// keepaliveHeader is how often (seconds) a client wants a keepalive
// event on a stream; it is held to 1..300, 50 when absent or unreadable.
const keepaliveHeader = "Keepalive-Ping-Interval"

func keepaliveInterval(hdr http.Header) time.Duration {
	n, err := strconv.Atoi(hdr.Get(keepaliveHeader))
	if err != nil || n <= 0 {
		return 50 * time.Second
	}
	return time.Duration(min(n, 300)) * time.Second
}

// watchEvents drops what the Handler holds for a sandbox once it ends
// (destroyed, failed, timed out): its processes' streams (their
// followers learn the sandbox is gone) and its watchers. It follows
// kilnd's events until Close, watching again after a broken stream.
func (h *Handler) watchEvents() {
	for h.base.Err() == nil {
		ev, err := h.kiln.WatchEvents(h.base, &kilnpb.WatchEventsRequest{})
		for err == nil {
			var e *kilnpb.Event
			if e, err = ev.Recv(); err != nil {
				break
			}
			switch e.GetKind() {
			case kilnpb.Event_KIND_EXITED, kilnpb.Event_KIND_FAILED, kilnpb.Event_KIND_TIMED_OUT, kilnpb.Event_KIND_STOPPED:
				h.dropSandbox(e.GetSandboxId(), fmt.Errorf("sandbox %s has ended", e.GetSandboxId()))
			}
		}
		if h.base.Err() == nil {
			h.log.Debug("watching kilnd's events again", "err", err)
			select {
			case <-h.base.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// dropSandbox lets go of everything held for sandbox id.
func (h *Handler) dropSandbox(id string, why error) {
	h.mu.Lock()
	st := h.sandboxes[id]
	delete(h.sandboxes, id)
	for k := range h.homes.m {
		if k.sandbox == id {
			delete(h.homes.m, k)
		}
	}
	h.mu.Unlock()
	if st == nil {
		return
	}
	for _, p := range st.procs {
		p.mu.Lock()
		p.gone = why
		p.mu.Unlock()
		p.cancel()
	}
	for _, w := range st.watchers {
		w.cancel()
	}
}
