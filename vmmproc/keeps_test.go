package vmmproc

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

func TestCheckKeepKey(t *testing.T) {
	for _, tc := range []struct {
		key  string
		want string // part of the error; "" for none
	}{
		{"secrets", ""},
		{"a.b_c-9", ""},
		{strings.Repeat("k", MaxKeepKey), ""},
		{"", "empty"},
		{strings.Repeat("k", MaxKeepKey+1), "at most"},
		{"a/b", "byte 1"},
		{"a b", "byte 1"},
	} {
		err := CheckKeepKey(tc.key)
		if tc.want == "" && err != nil || tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)) {
			t.Errorf("CheckKeepKey(%.20q) = %v, want %q", tc.key, err, tc.want)
		}
	}
}

func TestKeepTable(t *testing.T) {
	kt := newKeepTable()
	big := bytes.Repeat([]byte{'x'}, MaxKeepValue)
	for _, tc := range []struct {
		name  string
		key   string
		value []byte
		code  codes.Code
		total int
	}{
		{"first", "a", []byte("one"), codes.OK, 3},
		{"replaced", "a", []byte("three"), codes.OK, 5},
		{"bad key", "a/b", []byte("x"), codes.InvalidArgument, 5},
		{"too big", "b", append(big, 'y'), codes.ResourceExhausted, 5},
		{"largest", "b", big, codes.OK, 5 + MaxKeepValue},
		{"second largest", "c", big[:MaxKeepValue-5], codes.OK, MaxKept},
		{"past the total", "d", []byte("z"), codes.ResourceExhausted, MaxKept},
		{"dropped", "b", nil, codes.OK, MaxKept - MaxKeepValue},
		{"room again", "d", []byte("z"), codes.OK, MaxKept - MaxKeepValue + 1},
	} {
		err := kt.set(tc.key, tc.value)
		if status.Code(err) != tc.code || kt.total != tc.total {
			t.Fatalf("%s: set = %v (total %d), want %v (total %d)", tc.name, err, kt.total, tc.code, tc.total)
		}
	}
	v, err := kt.get("a")
	if err != nil || string(v) != "three" {
		t.Fatalf("get a = %q, %v", v, err)
	}
	v[0] = 'X' // a copy: the table's stays
	if v, _ := kt.get("a"); string(v) != "three" {
		t.Fatalf("get a after changing the copy = %q", v)
	}
	if _, err := kt.get("b"); status.Code(err) != codes.NotFound {
		t.Fatalf("get of a dropped key: %v", err)
	}
}

func TestProcessKeeps(t *testing.T) {
	p := startSelf(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := p.Kept(ctx, "secrets"); !errors.Is(err, ErrNotKept) {
		t.Fatalf("Kept before Keep: %v", err)
	}
	value := []byte("value kept in the VMM process\x00\xff")
	if err := p.Keep(ctx, "secrets", value); err != nil {
		t.Fatalf("Keep: %v", err)
	}
	// A second parent (as after a restart) finds it.
	q, err := Attach(ctx, p.Socket(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer q.Close(ctx)
	got, err := q.Kept(ctx, "secrets")
	if err != nil || !bytes.Equal(got, value) {
		t.Fatalf("Kept by another parent = %q, %v", got, err)
	}
	if err := q.Keep(ctx, "bad key", value); err == nil || strings.Contains(err.Error(), string(value[:5])) {
		t.Fatalf("Keep of a bad key: %v", err)
	}
	if err := q.Keep(ctx, "big", make([]byte, MaxKeepValue+1)); err == nil {
		t.Fatal("Keep of an oversized value succeeded")
	}
	if err := q.Keep(ctx, "secrets", nil); err != nil {
		t.Fatalf("Keep of nothing: %v", err)
	}
	if _, err := p.Kept(ctx, "secrets"); !errors.Is(err, ErrNotKept) {
		t.Fatalf("Kept after the drop: %v", err)
	}
}
