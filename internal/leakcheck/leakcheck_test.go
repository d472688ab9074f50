package leakcheck_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/leakcheck"
)

// TestLeaks: each kind of leak a test can make here shows as a
// difference that names the leaked item, and goes once it is undone.
func TestLeaks(t *testing.T) {
	dir := t.TempDir()
	var held []string // what the caller's own counter sees
	opts := leakcheck.Options{Trees: map[string]string{"tmp": dir}, Counters: map[string]func() ([]string, error){
		"ids held": func() ([]string, error) { return slices.Clone(held), nil },
	}}
	for _, tc := range []struct {
		name    string
		counter string
		leak    func(t *testing.T) (undo func())
		want    string
	}{
		{"file descriptor", "fds", func(t *testing.T) func() {
			f, err := os.Open(filepath.Join(dir, "."))
			if err != nil {
				t.Fatal(err)
			}
			return func() { f.Close() }
		}, dir},
		{"goroutine", "goroutines", func(t *testing.T) func() {
			// Ten, so a goroutine of the last subtest still ending
			// does not hide them.
			stop := make(chan struct{})
			for range 10 {
				go func() { <-stop }()
			}
			return func() { close(stop) }
		}, "goroutines: "},
		{"file in a tree", "files (tmp)", func(t *testing.T) func() {
			p := filepath.Join(dir, "left", "behind")
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(p, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			return func() { os.RemoveAll(filepath.Join(dir, "left")) }
		}, "+ left/behind"},
		{"thread blocked in a call", "threads (not parked)", func(t *testing.T) func() {
			// A thread stuck in a blocking read (a raw syscall, not the
			// netpoller), as a leaked worker would be.
			var p [2]int
			if err := syscall.Pipe(p[:]); err != nil {
				t.Fatal(err)
			}
			started := make(chan struct{})
			go func() {
				runtime.LockOSThread()
				close(started)
				var b [1]byte
				syscall.Read(p[0], b[:])
			}()
			<-started
			for deadline := time.Now().Add(5 * time.Second); !inPipeRead() && time.Now().Before(deadline); {
				time.Sleep(5 * time.Millisecond)
			}
			return func() {
				syscall.Write(p[1], []byte{0})
				syscall.Close(p[1])
				time.Sleep(10 * time.Millisecond)
				syscall.Close(p[0])
			}
		}, "pipe_read"},
		{"caller's counter", "ids held", func(t *testing.T) func() {
			held = append(held, "900007")
			return func() { held = nil }
		}, "+ 900007"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// The last subtest's goroutine may still be ending.
			for n, i := runtime.NumGoroutine(), 0; i < 100; i++ {
				time.Sleep(5 * time.Millisecond)
				if m := runtime.NumGoroutine(); m == n {
					break
				} else {
					n = m
				}
			}
			before, err := leakcheck.Take(opts)
			if err != nil {
				t.Fatal(err)
			}
			undo := tc.leak(t)
			after, err := leakcheck.Take(opts)
			if err != nil {
				t.Fatal(err)
			}
			d := leakcheck.Diff(before, after)
			if !strings.Contains(d, tc.counter+": ") || !strings.Contains(d, tc.want) {
				t.Errorf("diff after a leaked %s:\n%s\nwant %q under %q", tc.name, d, tc.want, tc.counter)
			}
			if tab := leakcheck.Table(before, after); !strings.Contains(tab, "differs") {
				t.Errorf("table marks no difference:\n%s", tab)
			}
			undo()
			// The Go runtime may start threads meanwhile (and keeps
			// them): only the leak's own counter must be back.
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			if _, d, err := leakcheck.Settle(ctx, before, opts, 10*time.Millisecond); err != nil || strings.Contains(d, tc.counter+": ") {
				t.Errorf("after undoing the leak: %v\n%s", err, d)
			}
		})
	}
}

// TestMissingTree: a folder that is not there counts as empty, not as
// an error (a state folder made later).
func TestMissingTree(t *testing.T) {
	c, err := leakcheck.Take(leakcheck.Options{Trees: map[string]string{"gone": filepath.Join(t.TempDir(), "none")}})
	if err != nil || c.N["files (gone)"] != 0 {
		t.Fatalf("Take = %v, %v", c.N, err)
	}
}

// TestCounterError: a caller's counter that fails makes Take fail,
// naming it, with what it did count kept.
func TestCounterError(t *testing.T) {
	c, err := leakcheck.Take(leakcheck.Options{Counters: map[string]func() ([]string, error){
		"ids held": func() ([]string, error) { return []string{"1"}, errors.New("probe failed") },
	}})
	if err == nil || !strings.Contains(err.Error(), "ids held: probe failed") || c.N["ids held"] != 1 {
		t.Fatalf("Take = %v, %v; want the counter's error named and its one item", c.N, err)
	}
}

// inPipeRead reports whether a thread of this process waits in a pipe read.
func inPipeRead() bool {
	tasks, _ := os.ReadDir("/proc/self/task")
	for _, t := range tasks {
		if w, _ := os.ReadFile(filepath.Join("/proc/self/task", t.Name(), "wchan")); strings.Contains(string(w), "pipe") {
			return true
		}
	}
	return false
}
