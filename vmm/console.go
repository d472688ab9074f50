package vmm

import (
	"bytes"
	"io"
	"sync"
	"time"
)

// panicWatcher passes console output through and watches it for the kernel's
// panic message, so that a panic ends the VM with its reason even when the
// kernel would otherwise hang or reboot.
type panicWatcher struct {
	mu      sync.Mutex
	out     io.Writer
	line    []byte
	message string               // the "Kernel panic - not syncing: ..." line
	onPanic func(message string) // called once, when the panic report ends
	done    bool
}

const (
	panicPrefix = "Kernel panic - not syncing: "
	panicEnd    = "---[ end Kernel panic"
	maxLine     = 4096
)

func (w *panicWatcher) Write(b []byte) (int, error) {
	w.mu.Lock()
	var fire string
	for _, c := range b {
		if c != '\n' {
			if len(w.line) < maxLine {
				w.line = append(w.line, c)
			}
			continue
		}
		line := string(bytes.TrimRight(w.line, "\r"))
		w.line = w.line[:0]
		if i := bytes.Index([]byte(line), []byte(panicPrefix)); i >= 0 && w.message == "" {
			w.message = line[i:]
		}
		if bytes.Contains([]byte(line), []byte(panicEnd)) && !w.done {
			w.done = true
			fire = w.message
			if fire == "" {
				fire = "Kernel panic"
			}
		}
	}
	out := w.out
	w.mu.Unlock()
	if fire != "" && w.onPanic != nil {
		w.onPanic(fire)
	}
	if out == nil {
		return len(b), nil
	}
	return out.Write(b)
}

// panicMessage returns the panic line seen so far, if any.
func (w *panicWatcher) panicMessage() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.message
}

// startConsoleInput feeds cfg.ConsoleInput to the UART until the reader
// ends or the VM is closed (stopConsoleInput).
func (v *VM) startConsoleInput() {
	in := v.cfg.ConsoleInput
	if in == nil || v.inputStop != nil {
		return
	}
	v.inputStop, v.inputDone = make(chan struct{}), make(chan struct{})
	stop, done := v.inputStop, v.inputDone
	go func() {
		defer close(done)
		buf := make([]byte, 256)
		for {
			n, err := in.Read(buf)
			select {
			case <-stop:
				return // what a closed VM's reader returned is not for it
			default:
			}
			if n > 0 {
				v.uart.Input(buf[:n])
			}
			if err != nil {
				return
			}
		}
	}()
}

// deadliner is a reader whose blocked Read a deadline interrupts (a
// socket, an os.Pipe end, a net.Pipe).
type deadliner interface {
	SetReadDeadline(t time.Time) error
}

// stopConsoleInput ends the console-input goroutine: a reader with a read
// deadline is woken at once and the goroutine waited for; any other ends
// it when its pending Read returns, feeding nothing more.
func (v *VM) stopConsoleInput() {
	if v.inputStop == nil {
		return
	}
	select {
	case <-v.inputStop:
		return // stopped already
	default:
	}
	close(v.inputStop)
	if d, ok := v.cfg.ConsoleInput.(deadliner); ok && d.SetReadDeadline(time.Now()) == nil {
		<-v.inputDone
	}
}
