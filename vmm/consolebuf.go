package vmm

import (
	"io"
	"sync"
	"sync/atomic"
	"time"
)

const (
	// consoleBufferMax bounds the console output waiting for a slow
	// Config.Console; past it, output is dropped (and counted).
	consoleBufferMax = 256 << 10
	// consoleFlushTimeout bounds how long Close waits for the console
	// writer to take what is still buffered.
	consoleFlushTimeout = time.Second
	// consolePauseFlush bounds how long Pause waits for the console
	// writer to take what the guest wrote before it was paused.
	consolePauseFlush = 100 * time.Millisecond
)

// consoleBuffer sits between the UART and Config.Console: the UART's
// Write (on a vCPU thread, inside its exit handler) only appends to a
// bounded buffer, and a goroutine of its own writes it out. A console
// writer that is slow or blocks forever (a stalled stream, a full pipe)
// so costs the guest its output past consoleBufferMax, never a vCPU: a
// vCPU blocked in a write could not be stopped, and Close would wait for
// it for ever.
type consoleBuffer struct {
	out    io.Writer
	max    int
	onDrop func(n int) // called, unlocked, after a Write dropped n bytes

	mu       sync.Mutex
	pending  []byte
	spare    []byte
	stopping bool
	writing  bool // run is in a write to out

	dropped atomic.Uint64
	wake    chan struct{} // one token: pending has bytes or stopping
	done    chan struct{} // closed when the writer goroutine ends
}

// newConsoleBuffer starts the goroutine that writes to out.
func newConsoleBuffer(out io.Writer, max int, onDrop func(n int)) *consoleBuffer {
	b := &consoleBuffer{out: out, max: max, onDrop: onDrop,
		wake: make(chan struct{}, 1), done: make(chan struct{})}
	go b.run()
	return b
}

// Write takes what fits in the buffer and drops the rest; it never
// blocks on the console writer and never fails.
func (b *consoleBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	n := 0
	if !b.stopping {
		n = min(len(p), b.max-len(b.pending))
		b.pending = append(b.pending, p[:n]...)
	}
	b.mu.Unlock()
	if n > 0 {
		select {
		case b.wake <- struct{}{}:
		default:
		}
	}
	if d := len(p) - n; d > 0 {
		b.dropped.Add(uint64(d))
		if b.onDrop != nil {
			b.onDrop(d)
		}
	}
	return len(p), nil
}

// run writes the buffer out until close, then what is left.
func (b *consoleBuffer) run() {
	defer close(b.done)
	for range b.wake {
		for {
			b.mu.Lock()
			chunk, stopping := b.pending, b.stopping
			b.pending, b.spare = b.spare[:0], nil
			b.writing = len(chunk) > 0
			b.mu.Unlock()
			if len(chunk) == 0 {
				if stopping {
					return
				}
				break
			}
			// A failing writer (a closed pipe) loses the output, as a
			// UART with no cable would; the guest runs on.
			b.out.Write(chunk)
			b.mu.Lock()
			b.spare = chunk[:0]
			b.writing = false
			b.mu.Unlock()
		}
	}
}

// flush waits, at most timeout, until the writer has taken everything
// buffered so far and returned from its write. It reports whether it did.
func (b *consoleBuffer) flush(timeout time.Duration) bool {
	deadline := time.Now().Add(timeout)
	for {
		b.mu.Lock()
		idle := len(b.pending) == 0 && !b.writing
		b.mu.Unlock()
		if idle {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// close stops taking output and waits, at most timeout, for the writer
// to take what is buffered. A writer still blocked then is left to
// return on its own; nothing more is written after it does.
func (b *consoleBuffer) close(timeout time.Duration) {
	b.mu.Lock()
	b.stopping = true
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default:
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-b.done:
	case <-t.C:
		// Drop what the writer will never take; run returns after the
		// write it is blocked in.
		b.mu.Lock()
		if d := len(b.pending); d > 0 {
			b.dropped.Add(uint64(d))
			b.pending = b.pending[:0]
		}
		b.mu.Unlock()
	}
}

// droppedBytes is how many bytes of output were dropped: the buffer was
// full, or the writer still held it up at close.
func (b *consoleBuffer) droppedBytes() uint64 { return b.dropped.Load() }
