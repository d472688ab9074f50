// Package fetch reads byte ranges of registry blobs over HTTP: one
// single-range GET ("bytes=a-b", the only form some registries, ggcr's
// among them, understand) per call, under a deadline, retried a couple of
// times on transient failures, and counted.
//
// The client is the caller's: for a registry it is an http.Client around
// go-containerregistry's transport.NewWithContext, so auth tokens are
// fetched and registry→CDN redirects are followed.
package fetch

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Stats counts what a Counter saw: range requests sent (retries included)
// and body bytes received.
type Stats struct {
	Requests int64
	Bytes    int64
}

// Counter accumulates Stats; the zero value is ready. Safe for concurrent
// use.
type Counter struct {
	requests, bytes atomic.Int64
}

// Stats returns the totals so far.
func (c *Counter) Stats() Stats {
	if c == nil {
		return Stats{}
	}
	return Stats{Requests: c.requests.Load(), Bytes: c.bytes.Load()}
}

func (c *Counter) add(req, n int64) {
	if c != nil {
		c.requests.Add(req)
		c.bytes.Add(n)
	}
}

// Defaults.
const (
	DefaultTimeout = 30 * time.Second
	DefaultRetries = 2
	// MaxRange bounds one request: Range reads the body into memory.
	MaxRange = 64 << 20
)

// Blob is one blob at a URL.
type Blob struct {
	Client *http.Client
	URL    string // https://registry/v2/<repo>/blobs/<digest>
	Size   int64  // the blob's size, from its descriptor
	// Timeout bounds each Range call, retries included; DefaultTimeout if
	// zero.
	Timeout time.Duration
	// Retries is how many times a transient failure (a connection error,
	// a 5xx, a 429, a short body) is retried; DefaultRetries if zero,
	// none if negative.
	Retries int
	Counter *Counter // may be nil
}

// StatusError is a registry's answer that is not the range asked for.
type StatusError struct {
	URL    string
	Status int
	Body   string // the start of the body, for the message
}

func (e *StatusError) Error() string {
	msg := fmt.Sprintf("fetch: GET %s: HTTP %d", e.URL, e.Status)
	if e.Body != "" {
		msg += ": " + e.Body
	}
	return msg
}

func (e *StatusError) transient() bool {
	return e.Status >= 500 || e.Status == http.StatusTooManyRequests
}

// Range returns the n bytes of the blob at off. A registry that stalls
// past the deadline gives an error wrapping context.DeadlineExceeded;
// one that answers with another status than 206 (or 200 for the whole
// blob) gives a *StatusError.
func (b *Blob) Range(ctx context.Context, off, n int64) ([]byte, error) {
	if off < 0 || n <= 0 || off+n > b.Size || off+n < off {
		return nil, fmt.Errorf("fetch: range [%d, +%d) is outside the blob's %d bytes", off, n, b.Size)
	}
	if n > MaxRange {
		return nil, fmt.Errorf("fetch: range of %d bytes (at most %d)", n, MaxRange)
	}
	timeout := b.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	retries := b.Retries
	if retries == 0 {
		retries = DefaultRetries
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var last error
	for attempt := 0; ; attempt++ {
		data, err := b.get(ctx, off, n)
		if err == nil {
			return data, nil
		}
		if cerr := ctx.Err(); cerr != nil {
			if errors.Is(cerr, context.DeadlineExceeded) {
				return nil, fmt.Errorf("fetch: %s bytes %d-%d: no answer within %s: %w", b.URL, off, off+n-1, timeout, cerr)
			}
			return nil, fmt.Errorf("fetch: %s: %w", b.URL, cerr)
		}
		last = err
		if attempt >= retries || !transient(err) {
			return nil, last
		}
		select {
		case <-time.After(time.Duration(attempt+1) * 100 * time.Millisecond):
		case <-ctx.Done():
			return nil, fmt.Errorf("fetch: %s: %w (after %v)", b.URL, ctx.Err(), last)
		}
	}
}

// errShort: the body ended before the range did.
var errShort = errors.New("short body")

// permanent is an answer that asking again will not change.
type permanent struct{ error }

func (p permanent) Unwrap() error { return p.error }

func transient(err error) bool {
	if errors.As(err, new(permanent)) {
		return false
	}
	var se *StatusError
	if errors.As(err, &se) {
		return se.transient()
	}
	return true // connection errors, short bodies
}

func (b *Blob) get(ctx context.Context, off, n int64) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, b.URL, nil)
	if err != nil {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	req.Header.Set("Range", "bytes="+strconv.FormatInt(off, 10)+"-"+strconv.FormatInt(off+n-1, 10))
	b.Counter.add(1, 0)
	resp, err := b.Client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	defer resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusPartialContent:
		if cr := resp.Header.Get("Content-Range"); cr != "" && !strings.HasPrefix(cr, "bytes "+strconv.FormatInt(off, 10)+"-") {
			return nil, permanent{fmt.Errorf("fetch: GET %s: asked for bytes %d-%d, got %q", b.URL, off, off+n-1, cr)}
		}
	case resp.StatusCode == http.StatusOK && off == 0 && n == b.Size:
		// The whole blob, as asked.
	default:
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 256))
		return nil, &StatusError{URL: b.URL, Status: resp.StatusCode, Body: strings.TrimSpace(string(msg))}
	}
	buf := make([]byte, n)
	k, err := io.ReadFull(resp.Body, buf)
	b.Counter.add(0, int64(k))
	if err != nil {
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
			return nil, fmt.Errorf("fetch: GET %s: %w: %d of %d bytes", b.URL, errShort, k, n)
		}
		return nil, fmt.Errorf("fetch: GET %s: %w", b.URL, err)
	}
	return buf, nil
}
