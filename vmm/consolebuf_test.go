package vmm

import (
	"bytes"
	"io"
	"log/slog"
	"sync"
	"testing"
	"time"
)

// stuckWriter is a console writer that takes its first write and blocks
// in the next until released: a stalled stream, a full pipe.
type stuckWriter struct {
	mu      sync.Mutex
	got     bytes.Buffer
	calls   int
	wrote   chan struct{} // closed when the first write has returned
	blocked chan struct{} // closed when a write blocks
	once    sync.Once
	release chan struct{}
}

func newStuckWriter() *stuckWriter {
	return &stuckWriter{wrote: make(chan struct{}), blocked: make(chan struct{}), release: make(chan struct{})}
}

func (w *stuckWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	w.calls++
	first := w.calls == 1
	if first {
		w.got.Write(p)
	}
	w.mu.Unlock()
	if first {
		close(w.wrote)
		return len(p), nil
	}
	w.once.Do(func() { close(w.blocked) })
	<-w.release
	return len(p), nil
}

// TestConsoleStuckWriter: a guest writing its console through COM1 (as a
// vCPU's exit handler does, through the port bus) to a Config.Console
// that blocks for ever is never held up: its writes return, the bytes
// past the buffer are dropped and counted, and Close returns although
// the writer is still blocked. Before the buffer, the vCPU blocked in
// the writer and Close waited for it for ever.
func TestConsoleStuckWriter(t *testing.T) {
	const fail = 5 * time.Second // a failure deadline, not a benchmark
	w := newStuckWriter()
	defer close(w.release)
	v := newVM(Config{Console: w, Logger: discardLogger()})
	v.consoleMax = 4 << 10 // a guest's byte-at-a-time writes are slow under -race
	if err := v.setupDevices(); err != nil {
		t.Fatal(err)
	}
	// One byte first, and wait until the writer has taken it: the next
	// write is the one that blocks. (Writing everything at once, a
	// writer goroutine scheduled late on a busy machine took the whole
	// buffer in its first write, and was never called again.)
	v.pio.Write(com1Port, []byte{'>'})
	select {
	case <-w.wrote:
	case <-time.After(fail):
		t.Fatal("the console writer was never called")
	}
	total := 4 * v.consoleMax
	vcpu := make(chan struct{})
	go func() {
		defer close(vcpu)
		for i := range total {
			v.pio.Write(com1Port, []byte{'a' + byte(i%26)})
		}
	}()
	select {
	case <-vcpu:
	case <-time.After(fail):
		t.Fatalf("a vCPU writing %d bytes to COM1 is still blocked after %v (the console writer blocks)", total, fail)
	}
	select {
	case <-w.blocked:
	case <-time.After(fail):
		t.Fatal("the console writer was never called a second time")
	}
	dropped := v.ConsoleDropped()
	if dropped == 0 || dropped >= uint64(total) {
		t.Errorf("dropped %d of %d bytes, want some but not all", dropped, total)
	}
	closed := make(chan error, 1)
	go func() { closed <- v.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(fail):
		t.Fatalf("Close has not returned after %v with the console writer blocked", fail)
	}
	w.mu.Lock()
	got := w.got.Len()
	w.mu.Unlock()
	// The first write went out, the second is stuck with its bytes, the
	// rest (if the stuck write did not take all that was buffered) Close
	// dropped: every byte is written, in flight or counted, and the count
	// never goes down.
	if d := v.ConsoleDropped(); d < dropped || uint64(got)+d > uint64(total)+1 {
		t.Errorf("after Close: %d dropped (%d before), %d written of %d", d, dropped, got, total+1)
	}
}

// TestConsoleBufferPassesOutput: a writer that keeps up gets every byte,
// in order, nothing dropped, and Close flushes what is buffered.
func TestConsoleBufferPassesOutput(t *testing.T) {
	for _, tt := range []struct {
		name   string
		writes []string
	}{
		{"nothing", nil},
		{"bytes", []string{"h", "e", "l", "l", "o", "\n"}},
		{"lines", []string{"Linux version 6.1\n", "console [ttyS0] enabled\n", "kiln agent ready\n"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			var mu sync.Mutex
			var got bytes.Buffer
			b := newConsoleBuffer(writerFunc(func(p []byte) (int, error) {
				mu.Lock()
				defer mu.Unlock()
				return got.Write(p)
			}), 64, nil)
			var want string
			for _, s := range tt.writes {
				b.Write([]byte(s))
				want += s
			}
			b.close(5 * time.Second)
			mu.Lock()
			defer mu.Unlock()
			if got.String() != want || b.droppedBytes() != 0 {
				t.Errorf("wrote %q (dropped %d), want %q", got.String(), b.droppedBytes(), want)
			}
			if n, err := b.Write([]byte("late")); n != 4 || err != nil || b.droppedBytes() != 4 {
				t.Errorf("Write after close = %d, %v, dropped %d", n, err, b.droppedBytes())
			}
		})
	}
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }

var _ io.Writer = writerFunc(nil)

func discardLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// slowWriter takes every write, each after a delay.
type slowWriter struct {
	mu  sync.Mutex
	got bytes.Buffer
}

func (w *slowWriter) Write(p []byte) (int, error) {
	time.Sleep(20 * time.Millisecond)
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.got.Write(p)
}

func (w *slowWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.got.String()
}

// TestConsoleBufferFlush: flush returns once a slow writer has everything
// written before it (what Pause relies on: a paused guest's console does
// not grow after Pause returns), and gives up on a writer that blocks.
func TestConsoleBufferFlush(t *testing.T) {
	w := &slowWriter{}
	b := newConsoleBuffer(w, 1<<10, nil)
	b.Write([]byte("first "))
	b.Write([]byte("second"))
	if !b.flush(5 * time.Second) {
		t.Fatal("flush gave up on a writer that takes everything")
	}
	if got := w.String(); got != "first second" {
		t.Errorf("after flush the writer has %q, want everything written before it", got)
	}
	if !b.flush(time.Millisecond) {
		t.Error("flush of an idle buffer failed")
	}
	b.close(time.Second)

	s := newStuckWriter()
	b = newConsoleBuffer(s, 1<<10, nil)
	b.Write([]byte("taken"))
	if !b.flush(5 * time.Second) {
		t.Fatal("flush gave up before the first write, which the writer takes")
	}
	b.Write([]byte("stuck"))
	<-s.blocked
	start := time.Now()
	if b.flush(30 * time.Millisecond) {
		t.Error("flush reported a blocked writer done")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("flush took %v, past its timeout", d)
	}
	close(s.release)
	b.close(time.Second)
}
