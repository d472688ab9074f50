package vmmproc

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

// TestMainBadArguments: a VMM process started wrongly exits 2 at once,
// saying why, before it opens anything.
func TestMainBadArguments(t *testing.T) {
	t.Setenv(SocketEnv, "")
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--no-such-flag"}, "not defined"},
		{[]string{"vmm"}, `unexpected argument "vmm"`},
		{nil, ""}, // no socket: ServeMain says so on the process's stderr
	} {
		var stderr bytes.Buffer
		if code := mainWith(context.Background(), c.args, &stderr); code != 2 || !strings.Contains(stderr.String(), c.want) {
			t.Errorf("Main(%q) = %d, stderr %q; want 2 and %q", c.args, code, stderr.String(), c.want)
		}
	}
}
