package main

import (
	"bytes"
	"context"
	"flag"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/virtio"
)

// maxForks bounds kiln fork -n.
const maxForks = 1024

func cmdFork(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kiln fork", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kiln fork --from DIR -n N [flags] -- CMD [ARG...]")
		fs.PrintDefaults()
	}
	from := fs.String("from", "", "snapshot `DIR` to restore the clones from (kiln run --save)")
	n := fs.Int("n", 1, "number of clones")
	timeout := fs.Duration("timeout", 0, "kill CMD in a clone after this long (0: no limit)")
	bootTimeout := fs.Duration("boot-timeout", 5*time.Minute, "how long to wait for each clone's agent")
	timing := fs.Bool("time", false, "print restore and command times to stderr")
	debug := fs.Bool("debug", false, "log VMM events to stderr")
	hostname := fs.String("hostname", "kiln", "clone i is named `NAME`-i")
	vf := addVMMFlags(fs)
	netFlag := fs.String("net", "", "for a snapshot with a network card: clone i gets tap `PREFIX`i (created when missing; PREFIX[,netns=NAME]) and a MAC address of its own")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	argv := fs.Args()
	switch {
	case *from == "":
		fmt.Fprintln(stderr, "kiln fork: --from DIR is required")
		return exitUsage
	case *n < 1 || *n > maxForks:
		fmt.Fprintf(stderr, "kiln fork: -n %d: want 1 to %d\n", *n, maxForks)
		return exitUsage
	case len(argv) == 0:
		fmt.Fprintln(stderr, "kiln fork: no command given (kiln fork --from DIR -n N -- CMD [ARG...])")
		return exitUsage
	}
	pl, err := vf.placement(fs)
	if err != nil {
		fmt.Fprintf(stderr, "kiln fork: %v\n", err)
		return exitUsage
	}
	if err := sandbox.CheckHostname(*hostname + "-0"); err != nil {
		fmt.Fprintf(stderr, "kiln fork: --hostname: %v\n", err)
		return exitUsage
	}
	var nic func(i int) *virtio.NetSpec
	if *netFlag != "" {
		prefix, rest, _ := strings.Cut(*netFlag, ",")
		if rest != "" {
			rest = "," + rest
		}
		// The longest name checks them all.
		if _, err := parseNet(fmt.Sprintf("%s%d%s", prefix, *n-1, rest)); err != nil || strings.Contains(rest, "mac=") {
			fmt.Fprintf(stderr, "kiln fork: --net %q: want PREFIX[,netns=NAME], PREFIX short enough for %d clones' tap names\n", *netFlag, *n)
			return exitUsage
		}
		nic = func(i int) *virtio.NetSpec {
			cfg, _ := parseNet(fmt.Sprintf("%s%d%s", prefix, i, rest))
			return &cfg
		}
	}
	// One clear error for a snapshot that is not there (or not this
	// host's), not one per clone.
	key, err := snapshot.LoadKey(sandbox.SnapshotKeyFile())
	if err != nil {
		fmt.Fprintf(stderr, "kiln fork: %v\n", err)
		return exitRunFailed
	}
	if _, err := snapshot.Info(*from, snapshot.WithKey(key)); err != nil {
		fmt.Fprintf(stderr, "kiln fork: %v\n", err)
		return exitRunFailed
	}
	// The clones check and copy the snapshot's memory once, and share it.
	cache := snapshot.NewCache(1)
	defer cache.Close()
	log := newLogger(stderr, *debug)
	po, err := vf.processOptions(pl, log)
	if err != nil {
		fmt.Fprintf(stderr, "kiln fork: %v\n", err)
		return exitRunFailed
	}
	var outMu sync.Mutex // one line at a time on each stream
	type result struct {
		code     int
		err      error
		restored time.Duration
		ran      time.Duration
	}
	results := make([]result, *n)
	var wg sync.WaitGroup
	for i := range *n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			r := &results[i]
			start := time.Now()
			ro := sandbox.RestoreOptions{Logger: log, Timeout: *bootTimeout, Hostname: fmt.Sprintf("%s-%d", *hostname, i), Process: po,
				SnapshotKey: key, SnapshotCache: cache}
			if nic != nil {
				ro.Net = nic(i)
			}
			sb, err := sandbox.Restore(ctx, *from, ro)
			if err != nil {
				r.err = err
				return
			}
			defer sb.Close(context.Background())
			r.restored = time.Since(start)
			o := &prefixWriter{w: stdout, mu: &outMu, prefix: fmt.Sprintf("[%d] ", i)}
			e := &prefixWriter{w: stderr, mu: &outMu, prefix: fmt.Sprintf("[%d] ", i)}
			st, err := sb.Client().Exec(ctx, client.ExecOptions{Argv: argv, Timeout: *timeout, Stdout: o, Stderr: e})
			o.Flush()
			e.Flush()
			r.ran = time.Since(start) - r.restored
			if err != nil {
				r.err = err
				return
			}
			r.code = st.ShellCode()
		}()
	}
	wg.Wait()
	failed := 0
	for i, r := range results {
		switch {
		case r.err != nil:
			failed++
			fmt.Fprintf(stderr, "kiln fork: clone %d: %v\n", i, r.err)
		case r.code != 0:
			failed++
			fmt.Fprintf(stderr, "kiln fork: clone %d: exit code %d\n", i, r.code)
		}
		if *timing && r.err == nil {
			fmt.Fprintf(stderr, "kiln fork: clone %d: restored in %v, command ran %v\n", i, r.restored.Round(time.Millisecond), r.ran.Round(time.Millisecond))
		}
	}
	if failed > 0 {
		fmt.Fprintf(stderr, "kiln fork: %d of %d clones failed\n", failed, *n)
		return exitGuest
	}
	return exitOK
}

// maxPrefixedLine bounds the line a prefixWriter holds: a longer one goes
// out in pieces of this many bytes, each a line of its own.
const maxPrefixedLine = 64 << 10

// prefixWriter writes whole lines to w, each with prefix, under mu; a
// partial last line waits for its end or Flush. A line longer than max
// (maxPrefixedLine when 0) is cut: each max bytes go out as a line, so a
// guest that never writes a newline is held to max bytes here. Each byte
// is looked at once: the cost is linear in what is written.
type prefixWriter struct {
	w      io.Writer
	mu     *sync.Mutex
	prefix string
	max    int
	buf    []byte // the partial line, shorter than max
	out    []byte // scratch for one prefixed line
}

func (p *prefixWriter) Write(b []byte) (int, error) {
	n := len(b)
	max := p.max
	if max <= 0 {
		max = maxPrefixedLine
	}
	for len(b) > 0 {
		seg, content := b, len(b) // up to and with the next newline
		if i := bytes.IndexByte(b, '\n'); i >= 0 {
			seg, content = b[:i+1], i
		}
		room := max - len(p.buf)
		if content > room || content == room && len(seg) == content {
			// The line reached the cap: out with it, cut.
			p.emit(p.buf, b[:room], true)
			p.buf = p.buf[:0]
			b = b[room:]
			continue
		}
		if len(seg) > content {
			p.emit(p.buf, seg, false)
			p.buf = p.buf[:0]
		} else {
			p.buf = append(p.buf, seg...)
		}
		b = b[len(seg):]
	}
	return n, nil
}

// Flush writes a partial last line, ended with a newline.
func (p *prefixWriter) Flush() {
	if len(p.buf) > 0 {
		p.emit(p.buf, nil, true)
		p.buf = p.buf[:0]
	}
}

// emit writes prefix, held, more and (when nl) a newline to w in one
// write, under mu.
func (p *prefixWriter) emit(held, more []byte, nl bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.out = append(append(append(p.out[:0], p.prefix...), held...), more...)
	if nl {
		p.out = append(p.out, '\n')
	}
	p.w.Write(p.out)
}
