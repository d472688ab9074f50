package ratelog

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"
)

// clock is a settable clock for Options.Now.
type clock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *clock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *clock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// lines returns the text handler's output as lines.
func lines(b *bytes.Buffer) []string {
	s := strings.TrimSpace(b.String())
	if s == "" {
		return nil
	}
	return strings.Split(s, "\n")
}

func newTest(burst int, interval time.Duration) (*slog.Logger, *Handler, *clock, *bytes.Buffer) {
	var out bytes.Buffer
	c := &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	h := New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelDebug}), Options{Burst: burst, Interval: interval, Now: c.now})
	return slog.New(h), h, c, &out
}

func TestLimits(t *testing.T) {
	type step struct {
		msg     string // "" advances the clock by adv
		n       int
		adv     time.Duration
		flush   bool
		expire  bool
		wantOut int // lines written by this step
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"under the burst", []step{{msg: "a", n: 3, wantOut: 3}}},
		{"over the burst", []step{{msg: "a", n: 100, wantOut: 5}}},
		{"messages have budgets of their own", []step{{msg: "a", n: 9, wantOut: 5}, {msg: "b", n: 9, wantOut: 5}}},
		{"the next interval reports then passes", []step{
			{msg: "a", n: 20, wantOut: 5},
			{adv: time.Second},
			{msg: "a", n: 1, wantOut: 2}, // summary + the record
		}},
		{"within the interval nothing more", []step{
			{msg: "a", n: 20, wantOut: 5},
			{adv: 999 * time.Millisecond},
			{msg: "a", n: 20, wantOut: 0},
		}},
		{"flush reports once", []step{
			{msg: "a", n: 7, wantOut: 5},
			{flush: true, wantOut: 1},
			{flush: true, wantOut: 0},
			{adv: time.Second},
			{msg: "a", n: 1, wantOut: 1}, // nothing left to report
		}},
		{"expired windows report without a new record", []step{
			{msg: "a", n: 8, wantOut: 5},
			{expire: true, wantOut: 0}, // its interval is not over
			{adv: time.Second},
			{expire: true, wantOut: 1},
			{expire: true, wantOut: 0},
			{msg: "a", n: 6, wantOut: 5}, // a new interval: a fresh burst
			{flush: true, wantOut: 1},
		}},
		{"no summary without drops", []step{
			{msg: "a", n: 5, wantOut: 5},
			{adv: time.Hour},
			{msg: "a", n: 1, wantOut: 1},
			{flush: true, wantOut: 0},
		}},
		{"a clock that goes back starts a new interval", []step{
			{msg: "a", n: 6, wantOut: 5},
			{adv: -time.Hour},
			{msg: "a", n: 1, wantOut: 2},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			log, h, c, out := newTest(5, time.Second)
			for i, s := range tt.steps {
				before := len(lines(out))
				switch {
				case s.flush:
					h.Flush(context.Background())
				case s.expire:
					h.ReportExpired(context.Background())
				case s.msg == "" && s.adv != 0:
					c.advance(s.adv)
				default:
					for range s.n {
						log.Warn(s.msg, "k", 1)
					}
				}
				if got := len(lines(out)) - before; got != s.wantOut {
					t.Fatalf("step %d: %d lines, want %d:\n%s", i, got, s.wantOut, out)
				}
			}
		})
	}
}

// TestSummary checks the summary line: the level and attributes of the
// dropped records' handler, the message and the count.
func TestSummary(t *testing.T) {
	log, h, _, out := newTest(2, time.Minute)
	dev := log.With("device", "blk0")
	for range 12 {
		dev.Info("queue broken")
	}
	log.Warn("queue broken") // another level: a budget of its own
	h.Flush(context.Background())
	ls := lines(out)
	if len(ls) != 4 {
		t.Fatalf("%d lines, want 2 records, 1 of another level, 1 summary:\n%s", len(ls), out)
	}
	sum := ls[3]
	for _, want := range []string{"level=INFO", "msg=\"" + SummaryMessage + "\"", "device=blk0", "message=\"queue broken\"", "suppressed=10", "interval=1m0s"} {
		if !strings.Contains(sum, want) {
			t.Errorf("summary %q lacks %q", sum, want)
		}
	}
}

// TestDisabledLevels: records below the next handler's level are neither
// written nor counted.
func TestDisabledLevels(t *testing.T) {
	var out bytes.Buffer
	h := New(slog.NewTextHandler(&out, nil), Options{Burst: 1})
	log := slog.New(h)
	for range 100 {
		log.Debug("chatty")
	}
	h.Flush(context.Background())
	if out.Len() != 0 {
		t.Fatalf("wrote %q", out.String())
	}
}

// TestManyMessages: past MaxKeys messages, the rest share one budget; the
// limiter's map stays bounded.
func TestManyMessages(t *testing.T) {
	log, h, _, out := newTest(1, time.Minute)
	for i := range MaxKeys + 500 {
		log.Warn(fmt.Sprintf("message %d", i))
	}
	if n := len(h.lim.keys); n > MaxKeys {
		t.Fatalf("%d keys tracked, cap %d", n, MaxKeys)
	}
	// MaxKeys-1 messages of their own, then one for all the rest.
	if got := len(lines(out)); got != MaxKeys {
		t.Fatalf("%d lines, want %d", got, MaxKeys)
	}
	h.Flush(context.Background())
	if last := lines(out)[len(lines(out))-1]; !strings.Contains(last, "suppressed=500") || !strings.Contains(last, otherMessages) {
		t.Fatalf("summary %q", last)
	}
}

// TestRewrap: wrapping a limited logger again gives a budget of its own,
// not a limiter nested in the first.
func TestRewrap(t *testing.T) {
	log, _, c, out := newTest(1, time.Minute)
	child := Wrap(log.With("child", 1), Options{Burst: 3, Now: c.now})
	for range 10 {
		child.Warn("x")
	}
	if got := len(lines(out)); got != 3 {
		t.Fatalf("%d lines through the rewrapped logger, want its own burst of 3", got)
	}
	if _, ok := child.Handler().(*Handler).next.(*Handler); ok {
		t.Fatal("limiter nested in a limiter")
	}
}

func TestConcurrent(t *testing.T) {
	log, h, _, out := newTest(10, time.Minute)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := log.With("g", g)
			for range 1000 {
				l.Warn("reset")
			}
		}()
	}
	wg.Wait()
	h.Flush(context.Background())
	ls := lines(out)
	if len(ls) != 11 || !strings.Contains(ls[10], "suppressed=7990") {
		t.Fatalf("%d lines, last %q", len(ls), ls[len(ls)-1])
	}
}

func BenchmarkSuppressed(b *testing.B) {
	var out bytes.Buffer
	log := slog.New(New(slog.NewTextHandler(&out, nil), Options{}))
	for b.Loop() {
		log.Warn("virtio device needs reset", "err", "x")
	}
}
