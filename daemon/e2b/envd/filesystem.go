package envd

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"path"
	"strconv"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	filesystempb "github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/filesystem"
	"github.com/kilnvm/kiln/daemon/e2b/envd/envdpb/filesystem/filesystempbconnect"
	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// filesystemService is filesystem.Filesystem over kiln.v1 file calls.
type filesystemService struct{ h *Handler }

var _ filesystempbconnect.FilesystemHandler = (*filesystemService)(nil)

// entryInfo is a kiln.v1 FileInfo as envd's EntryInfo.
func entryInfo(fi *kilnpb.FileInfo) *filesystempb.EntryInfo {
	m := kilnpb.FileMode(fi.GetMode())
	e := &filesystempb.EntryInfo{
		Name: fi.GetName(), Type: filesystempb.FileType_FILE_TYPE_FILE, Path: fi.GetPath(), Size: fi.GetSize(),
		Mode: fi.GetMode() & 0o7777, Permissions: m.String(), Owner: fi.GetOwner(), Group: fi.GetGroup(),
		ModifiedTime: timestamppb.New(time.Unix(0, fi.GetMtimeUnixNanos())),
	}
	if e.Name == "" {
		e.Name = path.Base(e.Path)
	}
	if e.Owner == "" {
		e.Owner = strconv.FormatUint(uint64(fi.GetUid()), 10)
	}
	if e.Group == "" {
		e.Group = strconv.FormatUint(uint64(fi.GetGid()), 10)
	}
	switch {
	case m&fs.ModeDir != 0 || fi.GetIsDir():
		e.Type = filesystempb.FileType_FILE_TYPE_DIRECTORY
	case m&fs.ModeSymlink != 0:
		e.Type = filesystempb.FileType_FILE_TYPE_SYMLINK
		t := fi.GetSymlink()
		if t != "" && !path.IsAbs(t) {
			t = path.Join(path.Dir(fi.GetPath()), t)
		}
		e.SymlinkTarget = &t
	}
	return e
}

// userPath is a request's path made absolute against its user's home.
func (h *Handler) userPath(ctx context.Context, hdr http.Header, p string) (user, abs string, err error) {
	u, err := userFromAuth(hdr)
	if err != nil {
		return "", "", connect.NewError(connect.CodeUnauthenticated, err)
	}
	abs, err = resolvePath(p, h.home(ctx, sandboxOf(ctx), u))
	if err != nil {
		return "", "", invalid("%v", err)
	}
	return u, abs, nil
}

// Stat describes a path (a symlink itself, not its target).
func (s *filesystemService) Stat(ctx context.Context, req *connect.Request[filesystempb.StatRequest]) (*connect.Response[filesystempb.StatResponse], error) {
	_, p, err := s.h.userPath(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	fi, err := s.h.kiln.Stat(ctx, &kilnpb.StatRequest{SandboxId: sandboxOf(ctx), Path: p, NoFollow: true})
	if err != nil {
		return nil, connectErr("stat "+p, err)
	}
	return connect.NewResponse(&filesystempb.StatResponse{Entry: entryInfo(fi)}), nil
}

// maxDepth bounds a ListDir's depth.
const maxDepth = 64

// ListDir lists a directory to a depth (0 and 1: its own entries).
func (s *filesystemService) ListDir(ctx context.Context, req *connect.Request[filesystempb.ListDirRequest]) (*connect.Response[filesystempb.ListDirResponse], error) {
	_, p, err := s.h.userPath(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	depth := req.Msg.GetDepth()
	if depth > maxDepth {
		return nil, invalid("list %s: depth %d: at most %d", p, depth, maxDepth)
	}
	if depth == 0 {
		depth = 1
	}
	resp, err := s.h.kiln.ListDir(ctx, &kilnpb.ListDirRequest{SandboxId: sandboxOf(ctx), Path: p, Depth: depth})
	if err != nil {
		return nil, connectErr("list "+p, err)
	}
	out := &filesystempb.ListDirResponse{Entries: make([]*filesystempb.EntryInfo, 0, len(resp.GetEntries()))}
	for _, e := range resp.GetEntries() {
		out.Entries = append(out.Entries, entryInfo(e))
	}
	return connect.NewResponse(out), nil
}

// MakeDir makes a directory and its parents, owned by the user;
// AlreadyExists when the path exists.
func (s *filesystemService) MakeDir(ctx context.Context, req *connect.Request[filesystempb.MakeDirRequest]) (*connect.Response[filesystempb.MakeDirResponse], error) {
	user, p, err := s.h.userPath(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	id := sandboxOf(ctx)
	_, err = s.h.kiln.Stat(ctx, &kilnpb.StatRequest{SandboxId: id, Path: p, NoFollow: true})
	switch codeOf(err) {
	case codes.OK:
		return nil, connect.NewError(connect.CodeAlreadyExists, fmt.Errorf("make directory %s: it exists", p))
	case codes.NotFound:
	default:
		return nil, connectErr("make directory "+p, err)
	}
	fi, err := s.h.kiln.MakeDir(ctx, &kilnpb.MakeDirRequest{SandboxId: id, Path: p, Parents: true, User: user})
	if err != nil {
		return nil, connectErr("make directory "+p, err)
	}
	return connect.NewResponse(&filesystempb.MakeDirResponse{Entry: entryInfo(fi)}), nil
}

// Move renames a file or directory.
func (s *filesystemService) Move(ctx context.Context, req *connect.Request[filesystempb.MoveRequest]) (*connect.Response[filesystempb.MoveResponse], error) {
	_, src, err := s.h.userPath(ctx, req.Header(), req.Msg.GetSource())
	if err != nil {
		return nil, err
	}
	_, dst, err := s.h.userPath(ctx, req.Header(), req.Msg.GetDestination())
	if err != nil {
		return nil, err
	}
	fi, err := s.h.kiln.Move(ctx, &kilnpb.MoveRequest{SandboxId: sandboxOf(ctx), Source: src, Destination: dst})
	if err != nil {
		return nil, connectErr("move "+src+" to "+dst, err)
	}
	return connect.NewResponse(&filesystempb.MoveResponse{Entry: entryInfo(fi)}), nil
}

// Remove removes a file or a whole tree.
func (s *filesystemService) Remove(ctx context.Context, req *connect.Request[filesystempb.RemoveRequest]) (*connect.Response[filesystempb.RemoveResponse], error) {
	_, p, err := s.h.userPath(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	if _, err := s.h.kiln.Remove(ctx, &kilnpb.RemoveRequest{SandboxId: sandboxOf(ctx), Path: p, Recursive: true}); err != nil {
		return nil, connectErr("remove "+p, err)
	}
	return connect.NewResponse(&filesystempb.RemoveResponse{}), nil
}

// fsEvent is a kiln.v1 watch event as envd's; nil for the started one.
func fsEvent(ev *kilnpb.WatchEvent, withEntry bool) *filesystempb.FilesystemEvent {
	if ev.GetStarted() {
		return nil
	}
	out := &filesystempb.FilesystemEvent{Name: ev.GetName(), Type: filesystempb.EventType(ev.GetOp())}
	if withEntry && ev.GetEntry() != nil {
		out.Entry = entryInfo(ev.GetEntry())
	}
	return out
}

// openWatch starts a kiln.v1 watch and waits for it to be in place.
func (h *Handler) openWatch(ctx context.Context, id, p string, recursive bool) (kilnpb.Kiln_WatchDirClient, error) {
	w, err := h.kiln.WatchDir(ctx, &kilnpb.WatchDirRequest{SandboxId: id, Path: p, Recursive: recursive})
	if err != nil {
		return nil, connectErr("watch "+p, err)
	}
	first, err := w.Recv()
	if err == io.EOF {
		err = errors.New("the watch ended before it started")
	}
	if err != nil {
		return nil, connectErr("watch "+p, err)
	}
	if !first.GetStarted() {
		return nil, connect.NewError(connect.CodeInternal, fmt.Errorf("watch %s: kilnd sent an event before the started one", p))
	}
	return w, nil
}

// WatchDir streams the changes below a directory, with keepalives.
func (s *filesystemService) WatchDir(ctx context.Context, req *connect.Request[filesystempb.WatchDirRequest], stream *connect.ServerStream[filesystempb.WatchDirResponse]) error {
	h, id := s.h, sandboxOf(ctx)
	_, p, err := h.userPath(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return err
	}
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	w, err := h.openWatch(wctx, id, p, req.Msg.GetRecursive())
	if err != nil {
		return err
	}
	var mu sync.Mutex // the keepalives' goroutine and this one send
	send := func(r *filesystempb.WatchDirResponse) error {
		mu.Lock()
		defer mu.Unlock()
		return stream.Send(r)
	}
	if err := send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Start{Start: &filesystempb.WatchDirResponse_StartEvent{}}}); err != nil {
		return err
	}
	go func() {
		t := time.NewTicker(keepaliveInterval(req.Header()))
		defer t.Stop()
		for {
			select {
			case <-wctx.Done():
				return
			case <-t.C:
				if send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Keepalive{Keepalive: &filesystempb.WatchDirResponse_KeepAlive{}}}) != nil {
					cancel()
					return
				}
			}
		}
	}()
	for {
		ev, err := w.Recv()
		if err == io.EOF {
			return nil // the directory went
		}
		if err != nil {
			if ctx.Err() != nil {
				return connectErr("watch "+p, ctx.Err())
			}
			return connectErr("watch "+p, err)
		}
		fe := fsEvent(ev, req.Msg.GetIncludeEntry())
		if fe == nil {
			continue
		}
		if err := send(&filesystempb.WatchDirResponse{Event: &filesystempb.WatchDirResponse_Filesystem{Filesystem: fe}}); err != nil {
			return err
		}
	}
}

// watcher is a polling watcher: a kiln.v1 watch whose events wait for
// GetWatcherEvents.
type watcher struct {
	id     string
	cancel context.CancelFunc

	mu      sync.Mutex
	events  []*filesystempb.FilesystemEvent
	dropped int
	err     error // the watch ended
	polled  time.Time
}

func newWatcherID() string {
	var b [12]byte
	rand.Read(b[:])
	return "w-" + hex.EncodeToString(b[:])
}

// CreateWatcher starts a polling watcher.
func (s *filesystemService) CreateWatcher(ctx context.Context, req *connect.Request[filesystempb.CreateWatcherRequest]) (*connect.Response[filesystempb.CreateWatcherResponse], error) {
	h, id := s.h, sandboxOf(ctx)
	_, p, err := h.userPath(ctx, req.Header(), req.Msg.GetPath())
	if err != nil {
		return nil, err
	}
	h.expireWatchers(id)
	h.mu.Lock()
	n := len(h.stateLocked(id).watchers)
	h.tidyLocked(id)
	h.mu.Unlock()
	if n >= h.limits.WatchersPerSandbox {
		return nil, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("sandbox %s already has %d watchers: remove some", id, n))
	}
	wctx, cancel := context.WithCancel(h.base)
	// The watch outlives this call; ctx's deadline bounds its start.
	stop := context.AfterFunc(ctx, cancel)
	w, err := h.openWatch(wctx, id, p, req.Msg.GetRecursive())
	stop()
	if err != nil {
		cancel()
		return nil, err
	}
	wt := &watcher{id: newWatcherID(), cancel: cancel, polled: time.Now()}
	h.mu.Lock()
	h.stateLocked(id).watchers[wt.id] = wt
	h.mu.Unlock()
	go func() {
		defer cancel()
		for {
			ev, err := w.Recv()
			if err != nil {
				if err == io.EOF {
					err = errors.New("the watched directory went")
				}
				wt.mu.Lock()
				wt.err = err
				wt.mu.Unlock()
				return
			}
			fe := fsEvent(ev, req.Msg.GetIncludeEntry())
			if fe == nil {
				continue
			}
			wt.mu.Lock()
			if len(wt.events) >= h.limits.WatcherEvents {
				wt.events = wt.events[1:]
				wt.dropped++
			}
			wt.events = append(wt.events, fe)
			wt.mu.Unlock()
		}
	}()
	return connect.NewResponse(&filesystempb.CreateWatcherResponse{WatcherId: wt.id}), nil
}

// expireWatchers removes id's watchers not polled for Limits.WatcherIdle.
func (h *Handler) expireWatchers(id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.sandboxes[id]
	if st == nil {
		return
	}
	for k, w := range st.watchers {
		w.mu.Lock()
		idle := time.Since(w.polled) > h.limits.WatcherIdle
		w.mu.Unlock()
		if idle {
			w.cancel()
			delete(st.watchers, k)
		}
	}
	h.tidyLocked(id)
}

func (h *Handler) watcher(id, wid string) *watcher {
	h.mu.Lock()
	defer h.mu.Unlock()
	if st := h.sandboxes[id]; st != nil {
		return st.watchers[wid]
	}
	return nil
}

// GetWatcherEvents hands out the events a watcher kept; once its watch
// has ended and nothing is left, the watcher goes with the watch's error.
func (s *filesystemService) GetWatcherEvents(ctx context.Context, req *connect.Request[filesystempb.GetWatcherEventsRequest]) (*connect.Response[filesystempb.GetWatcherEventsResponse], error) {
	id, wid := sandboxOf(ctx), req.Msg.GetWatcherId()
	w := s.h.watcher(id, wid)
	if w == nil {
		return nil, notFound("watcher " + strconv.Quote(wid))
	}
	w.mu.Lock()
	evs, dropped, werr := w.events, w.dropped, w.err
	w.events, w.dropped, w.polled = nil, 0, time.Now()
	w.mu.Unlock()
	if dropped > 0 {
		s.h.log.Debug("a polling watcher dropped events it was not asked for in time", "sandbox", id, "watcher", wid, "dropped", dropped)
	}
	if len(evs) == 0 && werr != nil {
		s.h.removeWatcher(id, wid)
		return nil, connectErr("watcher "+wid, werr)
	}
	return connect.NewResponse(&filesystempb.GetWatcherEventsResponse{Events: evs}), nil
}

func (h *Handler) removeWatcher(id, wid string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	st := h.sandboxes[id]
	if st == nil || st.watchers[wid] == nil {
		return false
	}
	st.watchers[wid].cancel()
	delete(st.watchers, wid)
	h.tidyLocked(id)
	return true
}

// RemoveWatcher stops a polling watcher.
func (s *filesystemService) RemoveWatcher(ctx context.Context, req *connect.Request[filesystempb.RemoveWatcherRequest]) (*connect.Response[filesystempb.RemoveWatcherResponse], error) {
	if !s.h.removeWatcher(sandboxOf(ctx), req.Msg.GetWatcherId()) {
		return nil, notFound("watcher " + strconv.Quote(req.Msg.GetWatcherId()))
	}
	return connect.NewResponse(&filesystempb.RemoveWatcherResponse{}), nil
}
