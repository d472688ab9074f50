package vmmproc

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestStartCgroupRefused: a cgroup that is not there, or a folder that
// is not a cgroup, fails Start with the cgroup named, and nothing is left
// running (the process never starts outside its cgroup).
func TestStartCgroupRefused(t *testing.T) {
	notCgroup := t.TempDir()
	for _, tc := range []struct {
		name, cgroup, want string
	}{
		{"missing", filepath.Join(notCgroup, "nope"), "the VMM process's cgroup " + filepath.Join(notCgroup, "nope")},
		{"not a cgroup", notCgroup, "in cgroup " + notCgroup},
		{"a file", "/proc/self/status", "the VMM process's cgroup /proc/self/status"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			p, err := Start(ctx, StartConfig{Command: []string{os.Args[0], "-test.run=^$"}, Dir: dir, Cgroup: tc.cgroup})
			if err == nil {
				p.Close(context.Background())
				t.Fatalf("Start in %s succeeded", tc.cgroup)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Start: %v, want %q", err, tc.want)
			}
		})
	}
}
