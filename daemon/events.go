package daemon

import (
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// eventBuffer is how many events a watcher may fall behind by before it
// is cut off (its stream ends with ResourceExhausted): a slow watcher
// never holds up the sandboxes.
const eventBuffer = 1024

// broker fans events out to the watchers.
type broker struct {
	mu   sync.Mutex
	subs map[*watcher]struct{}
}

type watcher struct {
	ch     chan *kilnpb.Event
	ids    map[string]bool // nil: all
	lagged chan struct{}   // closed when it fell behind
}

func newBroker() *broker { return &broker{subs: map[*watcher]struct{}{}} }

func (b *broker) subscribe(ids []string) *watcher {
	w := &watcher{ch: make(chan *kilnpb.Event, eventBuffer), lagged: make(chan struct{})}
	if len(ids) > 0 {
		w.ids = map[string]bool{}
		for _, id := range ids {
			w.ids[id] = true
		}
	}
	b.mu.Lock()
	b.subs[w] = struct{}{}
	b.mu.Unlock()
	return w
}

func (b *broker) unsubscribe(w *watcher) {
	b.mu.Lock()
	delete(b.subs, w)
	b.mu.Unlock()
}

func (b *broker) publish(ev *kilnpb.Event) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for w := range b.subs {
		if w.ids != nil && !w.ids[ev.SandboxId] {
			continue
		}
		select {
		case w.ch <- ev:
		default:
			delete(b.subs, w)
			close(w.lagged)
		}
	}
}

// WatchEvents streams every sandbox's state changes from now on. The
// response headers go out once the watcher is subscribed: a client that
// waits for them (the stream's Header) misses no later event.
func (s *Server) WatchEvents(req *kilnpb.WatchEventsRequest, stream kilnpb.Kiln_WatchEventsServer) error {
	for _, id := range req.GetSandboxIds() {
		if err := checkID("sandbox_ids", id); err != nil {
			return err
		}
	}
	w := s.events.subscribe(req.GetSandboxIds())
	defer s.events.unsubscribe(w)
	if err := stream.SendHeader(metadata.MD{}); err != nil {
		return err
	}
	for {
		select {
		case ev := <-w.ch:
			if err := stream.Send(ev); err != nil {
				return err
			}
		case <-w.lagged:
			return status.Errorf(codes.ResourceExhausted, "the watcher fell more than %d events behind; watch again and list the sandboxes to catch up", eventBuffer)
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-s.ctx.Done():
			return status.Error(codes.Unavailable, "kilnd is shutting down")
		}
	}
}
