package ninep

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// logLimiter lets through at most burst records at once and rate records a
// second after that, so that a guest sending bad messages in a loop cannot
// flood the host's logs. What it holds back is counted and reported with
// the next record it lets through.
type logLimiter struct {
	log   *slog.Logger
	rate  float64 // records a second
	burst float64

	mu         sync.Mutex
	tokens     float64
	last       time.Time
	suppressed int
}

func newLogLimiter(log *slog.Logger, rate, burst float64) *logLimiter {
	return &logLimiter{log: log, rate: rate, burst: burst, tokens: burst}
}

// logf logs msg at level with attrs unless the limit is reached.
func (l *logLimiter) logf(level slog.Level, msg string, args ...any) {
	if !l.log.Enabled(context.Background(), level) {
		return
	}
	now := time.Now()
	l.mu.Lock()
	if !l.last.IsZero() {
		l.tokens = min(l.burst, l.tokens+now.Sub(l.last).Seconds()*l.rate)
	}
	l.last = now
	if l.tokens < 1 {
		l.suppressed++
		l.mu.Unlock()
		return
	}
	l.tokens--
	suppressed := l.suppressed
	l.suppressed = 0
	l.mu.Unlock()
	if suppressed > 0 {
		args = append(args, "suppressed", suppressed)
	}
	l.log.Log(context.Background(), level, msg, args...)
}
