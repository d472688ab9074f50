package kvmtest

import (
	"bytes"
	"sync"
)

// Console is a guest console sink a test can read while the guest writes.
type Console struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (c *Console) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.b.Write(p)
}

// String returns everything written so far.
func (c *Console) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.b.String()
}
