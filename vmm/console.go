package vmm

import (
	"bytes"
	"io"
	"sync"
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
