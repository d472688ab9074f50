package sandbox

import (
	"context"
	"errors"
	"testing"
)

func TestLocalKeeps(t *testing.T) {
	var k localKeeps
	if _, err := k.get("secrets"); !errors.Is(err, ErrNotKept) {
		t.Fatalf("get before set: %v", err)
	}
	if err := k.set("secrets", []byte("v1")); err != nil {
		t.Fatal(err)
	}
	if err := k.set("bad key", []byte("v")); err == nil {
		t.Fatal("set of a bad key succeeded")
	}
	if v, err := k.get("secrets"); err != nil || string(v) != "v1" {
		t.Fatalf("get = %q, %v", v, err)
	}
	if err := k.set("secrets", nil); err != nil {
		t.Fatal(err)
	}
	if _, err := k.get("secrets"); !errors.Is(err, ErrNotKept) || k.total != 0 {
		t.Fatalf("get after the drop: %v (total %d)", err, k.total)
	}
	k.set("a", []byte("x"))
	k.clearAll()
	if _, err := k.get("a"); !errors.Is(err, ErrNotKept) {
		t.Fatalf("get after clearAll: %v", err)
	}
}

func TestKeepWithoutVM(t *testing.T) {
	var s Sandbox
	ctx := context.Background()
	if err := s.Keep(ctx, "a", []byte("x")); err == nil {
		t.Fatal("Keep without a VM succeeded")
	}
	if _, err := s.Kept(ctx, "a"); err == nil {
		t.Fatal("Kept without a VM succeeded")
	}
}
