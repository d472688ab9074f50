package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/kilnvm/kiln/vmmproc"
)

// ErrNotKept says that a sandbox keeps nothing under a key
// (vmmproc.ErrNotKept).
var ErrNotKept = vmmproc.ErrNotKept

// Keep has the sandbox keep value under key, in memory only: in its VMM
// process when it has one (where the value outlives this process, for a
// later Attach to read back with Kept), else in the sandbox until Close.
// An empty value drops key. Keys and sizes are bounded as vmmproc.Keep's.
// The value is never written to a file or a log.
func (s *Sandbox) Keep(ctx context.Context, key string, value []byte) error {
	switch m := s.m.(type) {
	case *processVM:
		if err := m.p.Keep(ctx, key, value); err != nil {
			return fmt.Errorf("sandbox: %w", err)
		}
		return nil
	case *localVM:
		return m.kept.set(key, value)
	}
	return errors.New("sandbox: keep: no VM")
}

// Kept returns what the sandbox keeps under key (Keep); ErrNotKept when
// nothing.
func (s *Sandbox) Kept(ctx context.Context, key string) ([]byte, error) {
	switch m := s.m.(type) {
	case *processVM:
		v, err := m.p.Kept(ctx, key)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		return v, nil
	case *localVM:
		return m.kept.get(key)
	}
	return nil, errors.New("sandbox: kept: no VM")
}

// localKeeps are the keeps of a sandbox in this process.
type localKeeps struct {
	mu    sync.Mutex
	vals  map[string][]byte
	total int
}

func (k *localKeeps) set(key string, value []byte) error {
	if err := vmmproc.CheckKeepKey(key); err != nil {
		return fmt.Errorf("sandbox: keep: %w", err)
	}
	if len(value) > vmmproc.MaxKeepValue {
		return fmt.Errorf("sandbox: keep %q: a value of %d bytes: at most %d", key, len(value), vmmproc.MaxKeepValue)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	old := k.vals[key]
	if k.total-len(old)+len(value) > vmmproc.MaxKept {
		return fmt.Errorf("sandbox: keep %q: at most %d bytes kept in all", key, vmmproc.MaxKept)
	}
	clear(old)
	k.total -= len(old)
	delete(k.vals, key)
	if len(value) == 0 {
		return nil
	}
	if k.vals == nil {
		k.vals = map[string][]byte{}
	}
	k.vals[key] = bytes.Clone(value)
	k.total += len(value)
	return nil
}

func (k *localKeeps) get(key string) ([]byte, error) {
	if err := vmmproc.CheckKeepKey(key); err != nil {
		return nil, fmt.Errorf("sandbox: kept: %w", err)
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	v, ok := k.vals[key]
	if !ok {
		return nil, fmt.Errorf("sandbox: kept %q: %w", key, ErrNotKept)
	}
	return bytes.Clone(v), nil
}

// clearAll forgets every value, zeroing it first.
func (k *localKeeps) clearAll() {
	k.mu.Lock()
	defer k.mu.Unlock()
	for key, v := range k.vals {
		clear(v)
		delete(k.vals, key)
	}
	k.total = 0
}
