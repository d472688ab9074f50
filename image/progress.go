package image

import (
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/term"
)

// Progress reports the bytes of long transfers to a writer. On a terminal it
// keeps one line up to date (`pulling 0123456789ab 12.3/45.6 MiB 4.5 MiB/s
// ETA 7s`); otherwise it writes a plain line every Interval and one at the
// end of each blob. A nil *Progress reports nothing. It is safe for
// concurrent use; transfers are reported one at a time.
type Progress struct {
	w        io.Writer
	tty      bool
	Interval time.Duration // plain lines: at most one per Interval; 5s by default
	mu       sync.Mutex
}

// NewProgress reports to w; it draws an updating line when w is an *os.File
// on a terminal.
func NewProgress(w io.Writer) *Progress {
	p := &Progress{w: w, Interval: 5 * time.Second}
	if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
		p.tty = true
	}
	return p
}

// Printf writes one line of its own (ending any updating line first).
func (p *Progress) Printf(format string, args ...any) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	fmt.Fprintf(p.w, format+"\n", args...)
}

// transfer is one blob being copied.
type transfer struct {
	p          *Progress
	verb, what string
	total, n   int64
	start      time.Time
	last       time.Time
}

// start begins reporting a transfer of total bytes (<0: unknown).
func (p *Progress) start(verb, what string, total int64) *transfer {
	if p == nil {
		return nil
	}
	t := time.Now()
	return &transfer{p: p, verb: verb, what: what, total: total, start: t, last: t}
}

// reader counts what r reads into t.
func (t *transfer) reader(r io.Reader) io.Reader {
	if t == nil {
		return r
	}
	return &countReader{r: r, t: t}
}

type countReader struct {
	r io.Reader
	t *transfer
}

func (c *countReader) Read(b []byte) (int, error) {
	n, err := c.r.Read(b)
	c.t.add(int64(n))
	return n, err
}

func (t *transfer) add(n int64) {
	t.n += n
	now := time.Now()
	every := 100 * time.Millisecond
	if !t.p.tty {
		every = t.p.Interval
	}
	if now.Sub(t.last) < every {
		return
	}
	t.last = now
	t.p.mu.Lock()
	defer t.p.mu.Unlock()
	if t.p.tty {
		fmt.Fprintf(t.p.w, "\r\x1b[K%s", t.line(now))
	} else {
		fmt.Fprintln(t.p.w, t.line(now))
	}
}

// done ends the transfer with one last line.
func (t *transfer) done(err error) {
	if t == nil {
		return
	}
	t.p.mu.Lock()
	defer t.p.mu.Unlock()
	cr := ""
	if t.p.tty {
		cr = "\r\x1b[K"
	}
	el := time.Since(t.start)
	if err != nil {
		fmt.Fprintf(t.p.w, "%s%s %s failed after %s\n", cr, t.verb, t.what, mib(t.n))
		return
	}
	fmt.Fprintf(t.p.w, "%s%s %s %s in %s (%s/s)\n", cr, t.verb, t.what, mib(t.n), el.Round(time.Millisecond), mib(rate(t.n, el)))
}

// line is the state of the transfer: bytes, rate and ETA.
func (t *transfer) line(now time.Time) string {
	el := now.Sub(t.start)
	r := rate(t.n, el)
	if t.total < 0 {
		return fmt.Sprintf("%s %s %s %s/s", t.verb, t.what, mib(t.n), mib(r))
	}
	eta := "?"
	if r > 0 {
		eta = (time.Duration(float64(t.total-t.n)/float64(r)) * time.Second).Round(time.Second).String()
	}
	return fmt.Sprintf("%s %s %.1f/%s %s/s ETA %s", t.verb, t.what, float64(t.n)/(1<<20), mib(t.total), mib(r), eta)
}

func rate(n int64, el time.Duration) int64 {
	if el <= 0 {
		return 0
	}
	return int64(float64(n) / el.Seconds())
}

func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
