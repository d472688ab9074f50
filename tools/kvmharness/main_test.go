package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// TestRunFlags: flags that cannot work are refused before anything runs,
// naming what is wrong.
func TestRunFlags(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"-run", "(", "./..."}, "-run: error parsing regexp"},
		{[]string{"-mem", "100", "./..."}, "-mem must be at least 256"},
		{[]string{"-mode", "magic", "./..."}, `-mode="magic"`},
	} {
		var stdout, stderr bytes.Buffer
		if code := run(context.Background(), c.args, &stdout, &stderr); code != 2 {
			t.Errorf("%v: exit %d, want 2 (stderr %q)", c.args, code, stderr.String())
		}
		if !strings.Contains(stderr.String(), c.want) {
			t.Errorf("%v: stderr %q, want %q", c.args, stderr.String(), c.want)
		}
	}
}
