package vmmproc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/vmmproc/vmmpb"
)

// Keeps are small values a VMM process keeps in its memory by key for its
// parent: what the parent must find again after its own restart but may
// not write anywhere, such as a daemon's sandbox secrets. They are never
// written to a file or a log, and they are gone with the process. Keeps
// are bounded: MaxKeepValue bytes a value, MaxKept bytes in all.

// Limits on keeps.
const (
	// MaxKeepKey is the longest key, in bytes.
	MaxKeepKey = 128
	// MaxKeepValue is the largest value, in bytes.
	MaxKeepValue = 2 << 20
	// MaxKept is the most bytes of values one process keeps.
	MaxKept = 4 << 20
)

// ErrNotKept says that a VMM process keeps nothing under a key.
var ErrNotKept = errors.New("nothing kept under that key")

// CheckKeepKey returns an error naming what is wrong with a keep's key:
// it must be 1 to MaxKeepKey bytes of letters, digits, '.', '_' and '-'.
func CheckKeepKey(key string) error {
	if key == "" {
		return errors.New("keep key is empty")
	}
	if len(key) > MaxKeepKey {
		return fmt.Errorf("keep key is %d bytes: at most %d", len(key), MaxKeepKey)
	}
	for i := 0; i < len(key); i++ {
		c := key[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("keep key %.140q: byte %d is %q; want only letters, digits, '.', '_' and '-'", key, i, c)
		}
	}
	return nil
}

// keepTable is a VMM process's keeps.
type keepTable struct {
	mu    sync.Mutex
	vals  map[string][]byte
	total int
}

func newKeepTable() *keepTable { return &keepTable{vals: map[string][]byte{}} }

// set keeps a copy of value under key (drops key when value is empty).
func (t *keepTable) set(key string, value []byte) error {
	if err := CheckKeepKey(key); err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	if len(value) > MaxKeepValue {
		return status.Errorf(codes.ResourceExhausted, "keep %q: a value of %d bytes: at most %d", key, len(value), MaxKeepValue)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	old := t.vals[key]
	if t.total-len(old)+len(value) > MaxKept {
		return status.Errorf(codes.ResourceExhausted, "keep %q: %d bytes kept already, %d more would pass the limit of %d", key, t.total-len(old), len(value), MaxKept)
	}
	clear(old) // what the process no longer keeps does not linger in it
	t.total -= len(old)
	if len(value) == 0 {
		delete(t.vals, key)
		return nil
	}
	t.vals[key] = bytes.Clone(value)
	t.total += len(value)
	return nil
}

// get returns a copy of key's value.
func (t *keepTable) get(key string) ([]byte, error) {
	if err := CheckKeepKey(key); err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	v, ok := t.vals[key]
	if !ok {
		return nil, status.Errorf(codes.NotFound, "nothing kept under %q", key)
	}
	return bytes.Clone(v), nil
}

func (s *server) Keep(_ context.Context, req *vmmpb.KeepRequest) (*vmmpb.KeepResponse, error) {
	if err := s.keeps.set(req.GetKey(), req.GetValue()); err != nil {
		return nil, err
	}
	return &vmmpb.KeepResponse{}, nil
}

func (s *server) Kept(_ context.Context, req *vmmpb.KeptRequest) (*vmmpb.KeptResponse, error) {
	v, err := s.keeps.get(req.GetKey())
	if err != nil {
		return nil, err
	}
	return &vmmpb.KeptResponse{Value: v}, nil
}

// Keep has the process keep value under key in its memory, until it is
// set again or the process exits (an empty value drops the key). key
// must pass CheckKeepKey; value is at most MaxKeepValue bytes, and the
// process keeps at most MaxKept in all.
func (p *Process) Keep(ctx context.Context, key string, value []byte) error {
	if err := CheckKeepKey(key); err != nil {
		return fmt.Errorf("vmmproc: keep: %w", err)
	}
	if len(value) > MaxKeepValue {
		return fmt.Errorf("vmmproc: keep %q: a value of %d bytes: at most %d", key, len(value), MaxKeepValue)
	}
	if _, err := p.api.Keep(ctx, &vmmpb.KeepRequest{Key: key, Value: value}); err != nil {
		// Never the value: the error names the key only.
		return p.rpcErr(fmt.Sprintf("keep %q", key), err)
	}
	return nil
}

// Kept returns what the process keeps under key; ErrNotKept when nothing.
func (p *Process) Kept(ctx context.Context, key string) ([]byte, error) {
	if err := CheckKeepKey(key); err != nil {
		return nil, fmt.Errorf("vmmproc: kept: %w", err)
	}
	resp, err := p.api.Kept(ctx, &vmmpb.KeptRequest{Key: key})
	if status.Code(err) == codes.NotFound {
		return nil, fmt.Errorf("vmmproc: kept %q: %w", key, ErrNotKept)
	}
	if err != nil {
		return nil, p.rpcErr(fmt.Sprintf("kept %q", key), err)
	}
	return resp.GetValue(), nil
}
