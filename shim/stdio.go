package shim

import (
	"context"
	"fmt"
	"io"
	"net/url"
	"path/filepath"
	"sync"
	"syscall"

	"github.com/containerd/fifo"
)

// check refuses stdio that is not a FIFO path (containerd's binary:// and
// file:// loggers are not supported yet).
func (s stdio) check() error {
	for _, p := range []string{s.stdin, s.stdout, s.stderr} {
		if p == "" {
			continue
		}
		if u, err := url.Parse(p); err == nil && u.Scheme != "" && u.Scheme != "fifo" {
			return fmt.Errorf("stdio %q: only FIFO paths are supported, not %s:// loggers", p, u.Scheme)
		}
		if !filepath.IsAbs(trimFifo(p)) {
			return fmt.Errorf("stdio %q: not an absolute path", p)
		}
	}
	return nil
}

func trimFifo(p string) string {
	if u, err := url.Parse(p); err == nil && u.Scheme == "fifo" {
		return u.Path
	}
	return p
}

// streams are a process's open FIFOs.
type streams struct {
	stdin io.ReadCloser
	// stdinHold is the shim's own writer on the stdin FIFO (as runc's
	// shim holds one): the reader sees EOF only once it is closed too
	// (CloseIO) and every byte written before has been read. Closing the
	// reader's side at CloseIO instead would drop what the client wrote
	// just before it (ctr writes, then calls CloseIO at once).
	stdinHold      io.Closer
	stdout, stderr io.Writer
	closers        []io.Closer
	once           sync.Once
}

// Close closes every FIFO (the readers then see EOF).
func (s *streams) Close() {
	s.once.Do(func() {
		for _, c := range s.closers {
			c.Close()
		}
	})
}

// openStdio opens p's FIFOs: containerd holds the other ends.
func openStdio(ctx context.Context, p stdio) (_ *streams, err error) {
	s := &streams{stdout: io.Discard, stderr: io.Discard}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()
	if p.stdin != "" {
		// Opened in the background (O_NONBLOCK): containerd's client
		// may connect later. Not under ctx, which bounds only the
		// start: the fifo package closes a FIFO whose context ends
		// before it opened, and the process's stdin would be cut. The
		// process's exit closes it (streams.Close), which also ends a
		// wait for a writer that never came.
		f, err := fifo.OpenFifo(context.WithoutCancel(ctx), trimFifo(p.stdin), syscall.O_RDONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("opening stdin %s: %w", p.stdin, err)
		}
		s.stdin = f
		s.closers = append(s.closers, f)
		w, err := fifo.OpenFifo(context.WithoutCancel(ctx), trimFifo(p.stdin), syscall.O_WRONLY|syscall.O_NONBLOCK, 0)
		if err != nil {
			return nil, fmt.Errorf("opening stdin %s for writing: %w", p.stdin, err)
		}
		s.stdinHold = w
		s.closers = append(s.closers, w)
	}
	open := func(path string) (io.Writer, error) {
		f, err := fifo.OpenFifo(ctx, trimFifo(path), syscall.O_WRONLY, 0)
		if err != nil {
			return nil, fmt.Errorf("opening %s: %w", path, err)
		}
		s.closers = append(s.closers, f)
		return &lossyWriter{w: f}, nil
	}
	if p.stdout != "" {
		if s.stdout, err = open(p.stdout); err != nil {
			return nil, err
		}
	}
	if p.stderr != "" && !p.terminal {
		if p.stderr == p.stdout {
			s.stderr = s.stdout
		} else if s.stderr, err = open(p.stderr); err != nil {
			return nil, err
		}
	}
	return s, nil
}

// lossyWriter drops output once its reader has gone (containerd's client
// exited): a guest process must not fail for want of a reader.
type lossyWriter struct {
	mu     sync.Mutex
	w      io.Writer
	broken bool
}

func (l *lossyWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.broken {
		return len(p), nil
	}
	if _, err := l.w.Write(p); err != nil {
		l.broken = true // EPIPE, mostly: nobody reads any more
	}
	return len(p), nil
}
