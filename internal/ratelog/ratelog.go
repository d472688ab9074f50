// Package ratelog bounds the log lines a guest can cause: a slog.Handler
// that passes at most Burst records of one message (and level) per
// Interval, counts the rest, and says how many it dropped in one
// "suppressed" line when the message is next logged after its interval, or
// at Flush. The VMM logs through one per VM, so a guest that resets a
// device 10,000 times a second writes a few lines, not 10,000.
package ratelog

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Defaults for Options' zero fields.
const (
	DefaultBurst    = 10
	DefaultInterval = time.Minute
	// MaxKeys bounds the messages a limiter tracks; records of messages
	// beyond it share one budget. Messages are the code's constant
	// strings, so it is only reached by a caller that builds messages
	// from data.
	MaxKeys = 1024
)

// SummaryMessage is the message of the line that reports suppressed
// records; its attributes are "message" (the suppressed one), "suppressed"
// (how many) and "interval".
const SummaryMessage = "log lines suppressed"

// otherMessages is the key of the records past MaxKeys messages.
const otherMessages = "(other messages)"

// Options shape a limiter.
type Options struct {
	Burst    int              // records of one message per interval; DefaultBurst when 0
	Interval time.Duration    // DefaultInterval when 0
	Now      func() time.Time // the clock; time.Now when nil
}

// Handler is the rate-limiting slog.Handler. Handlers made from one with
// WithAttrs and WithGroup share its budget.
type Handler struct {
	next slog.Handler
	lim  *limiter
}

type key struct {
	level slog.Level
	msg   string
}

// window counts one message's records in its current interval.
type window struct {
	start      time.Time
	passed     int
	suppressed int
	via        slog.Handler // where the summary goes: the last dropped record's handler
}

type limiter struct {
	burst    int
	interval time.Duration
	now      func() time.Time

	mu   sync.Mutex
	keys map[key]*window
}

// New returns a Handler that passes to next what the limits allow. A next
// that is itself a *Handler is unwrapped: the new Handler has a budget of
// its own, not nested in the other's.
func New(next slog.Handler, o Options) *Handler {
	if h, ok := next.(*Handler); ok {
		next = h.next
	}
	if o.Burst <= 0 {
		o.Burst = DefaultBurst
	}
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Handler{next: next, lim: &limiter{burst: o.Burst, interval: o.Interval, now: o.Now, keys: map[key]*window{}}}
}

// Wrap returns a logger like l whose records go through a new Handler.
// A nil l is slog.Default().
func Wrap(l *slog.Logger, o Options) *slog.Logger {
	if l == nil {
		l = slog.Default()
	}
	return slog.New(New(l.Handler(), o))
}

// Enabled reports whether next handles records at level.
func (h *Handler) Enabled(ctx context.Context, level slog.Level) bool {
	return h.next.Enabled(ctx, level)
}

// Handle passes r to next unless its message has had its Burst in this
// interval; it first reports what the message's last interval dropped.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	pass, report := h.lim.admit(key{r.Level, r.Message}, h.next)
	if report != nil {
		report.emit(ctx, h.lim.interval)
	}
	if !pass {
		return nil
	}
	return h.next.Handle(ctx, r)
}

// WithAttrs returns a Handler whose records carry attrs, sharing h's budget.
func (h *Handler) WithAttrs(attrs []slog.Attr) slog.Handler {
	return &Handler{next: h.next.WithAttrs(attrs), lim: h.lim}
}

// WithGroup returns a Handler whose attributes go in group name, sharing
// h's budget.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{next: h.next.WithGroup(name), lim: h.lim}
}

// Flush reports, now, every message that has dropped records since its
// last report, and forgets the counts. Call it when what logs through h
// ends (a VM's Close).
func (h *Handler) Flush(ctx context.Context) { h.report(ctx, false) }

// ReportExpired reports the messages whose interval is over with records
// dropped, and starts their next interval: a message that is not logged
// again still gets its summary. Call it every Interval or so.
func (h *Handler) ReportExpired(ctx context.Context) { h.report(ctx, true) }

// Interval is the limiter's interval.
func (h *Handler) Interval() time.Duration { return h.lim.interval }

func (h *Handler) report(ctx context.Context, expiredOnly bool) {
	now := h.lim.now()
	h.lim.mu.Lock()
	var reports []summary
	for k, w := range h.lim.keys {
		if w.suppressed == 0 {
			continue
		}
		expired := now.Sub(w.start) >= h.lim.interval || now.Before(w.start)
		if expiredOnly && !expired {
			continue
		}
		reports = append(reports, summary{k: k, n: w.suppressed, via: w.via, at: now})
		if expired {
			*w = window{start: now}
		} else {
			w.suppressed = 0
		}
	}
	h.lim.mu.Unlock()
	for _, s := range reports {
		s.emit(ctx, h.lim.interval)
	}
}

// summary is one "suppressed" line to write.
type summary struct {
	k   key
	n   int
	via slog.Handler
	at  time.Time
}

func (s *summary) emit(ctx context.Context, interval time.Duration) {
	r := slog.NewRecord(s.at, s.k.level, SummaryMessage, 0)
	r.AddAttrs(slog.String("message", s.k.msg), slog.Int("suppressed", s.n), slog.Duration("interval", interval))
	// A summary that fails to write has nowhere else to go.
	_ = s.via.Handle(ctx, r)
}

// admit counts one record of k, logged through via: whether it passes,
// and the summary of k's previous interval when that one ended with
// records dropped.
func (l *limiter) admit(k key, via slog.Handler) (bool, *summary) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	w := l.keys[k]
	if w == nil {
		// MaxKeys-1 messages of their own and one shared key.
		if len(l.keys) >= MaxKeys-1 {
			l.prune(now)
		}
		if len(l.keys) >= MaxKeys-1 {
			k.msg = otherMessages // the shared budget of what does not fit
			w = l.keys[k]
		}
		if w == nil {
			w = &window{start: now}
			l.keys[k] = w
		}
	}
	var report *summary
	if now.Sub(w.start) >= l.interval || now.Before(w.start) {
		if w.suppressed > 0 {
			report = &summary{k: k, n: w.suppressed, via: w.via, at: now}
		}
		*w = window{start: now}
	}
	if w.passed < l.burst {
		w.passed++
		return true, report
	}
	w.suppressed++
	w.via = via
	return false, report
}

// prune forgets the windows whose interval is over and that have nothing
// to report.
func (l *limiter) prune(now time.Time) {
	for k, w := range l.keys {
		if w.suppressed == 0 && now.Sub(w.start) >= l.interval {
			delete(l.keys, k)
		}
	}
}
