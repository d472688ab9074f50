package sandbox

import "sync"

// tail keeps the last max bytes written to it (the guest's console, for
// error messages) in a ring: a write costs O(len(p)) whatever the tail
// holds, since the guest's UART writes one byte at a time.
type tail struct {
	mu   sync.Mutex
	buf  []byte // len max once full
	max  int
	next int // where the next byte goes once buf is full
}

func newTail(max int) *tail { return &tail{max: max} }

func (t *tail) Write(p []byte) (int, error) {
	n := len(p)
	if t.max <= 0 {
		return n, nil
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(p) >= t.max {
		// Only the last max bytes stay.
		t.buf = append(t.buf[:0], p[len(p)-t.max:]...)
		t.next = 0
		return n, nil
	}
	if room := t.max - len(t.buf); room > 0 {
		k := min(room, len(p))
		t.buf = append(t.buf, p[:k]...)
		p = p[k:]
	}
	for len(p) > 0 {
		k := copy(t.buf[t.next:], p)
		p = p[k:]
		t.next = (t.next + k) % t.max
	}
	return n, nil
}

// String returns what the tail holds, oldest byte first.
func (t *tail) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.buf) < t.max {
		return string(t.buf)
	}
	return string(t.buf[t.next:]) + string(t.buf[:t.next])
}
