package main

import (
	"bytes"
	"context"
	"os"
	"os/signal"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fakeSignals stands in for signal.Notify: the test delivers signals to
// the exec's forwarder without sending any to the test process.
type fakeSignals struct {
	mu      sync.Mutex
	ch      chan<- os.Signal
	sigs    []os.Signal
	calls   int
	stopped int
}

func (f *fakeSignals) notify(ch chan<- os.Signal, sigs ...os.Signal) func() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ch, f.sigs = ch, sigs
	f.calls++
	return func() {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.ch = nil
		f.stopped++
	}
}

func (f *fakeSignals) send(t *testing.T, sig syscall.Signal) {
	t.Helper()
	f.mu.Lock()
	ch := f.ch
	f.mu.Unlock()
	if ch == nil {
		t.Fatalf("sending %v: no exec is listening for signals", sig)
	}
	ch <- sig
}

// watchWriter is a buffer, safe for concurrent use, that can wait for
// some text to appear in it.
type watchWriter struct {
	mu      sync.Mutex
	b       bytes.Buffer
	changed chan struct{}
}

func newWatchWriter() *watchWriter { return &watchWriter{changed: make(chan struct{}, 1)} }

func (w *watchWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	select {
	case w.changed <- struct{}{}:
	default:
	}
	return w.b.Write(p)
}

func (w *watchWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// waitFor waits until the buffer holds s.
func (w *watchWriter) waitFor(t *testing.T, s string, done <-chan int) {
	t.Helper()
	deadline := time.After(20 * time.Second)
	for !strings.Contains(w.String(), s) {
		select {
		case <-w.changed:
		case code := <-done:
			t.Fatalf("kiln exited %d before printing %q; stdout %q", code, s, w.String())
		case <-deadline:
			t.Fatalf("no %q after 20 s; stdout %q", s, w.String())
		}
	}
}

// kilnAsync runs the CLI in-process with a's signal source, returning its
// stdout, stderr and a channel for its exit code.
func kilnAsync(ctx context.Context, a *cli, args ...string) (stdout, stderr *watchWriter, done chan int) {
	stdout, stderr, done = newWatchWriter(), newWatchWriter(), make(chan int, 1)
	a.ctx, a.stdin, a.stdout, a.stderr = ctx, strings.NewReader(""), stdout, stderr
	go func() { done <- a.main(args) }()
	return stdout, stderr, done
}

func waitExit(t *testing.T, done <-chan int) int {
	t.Helper()
	select {
	case code := <-done:
		return code
	case <-time.After(30 * time.Second):
		t.Fatal("kiln sandbox exec did not exit within 30 s")
		return -1
	}
}

// TestSandboxExecSignals: kiln sandbox exec and run forward SIGINT,
// SIGTERM, SIGHUP and SIGQUIT to the command's process group, so that its
// own handling runs and kiln exits with its exit code; a second signal
// within the interrupt window ends the call instead.
func TestSandboxExecSignals(t *testing.T) {
	startKilnd(t)
	code, out, errOut := kilnIn(t, "", "sandbox", "create", "--image", "busybox")
	if code != 0 {
		t.Fatalf("create: exit %d: %s", code, errOut)
	}
	id := oneID(t, "create", out)
	// fg is a foreground child that prints ready once it runs with the
	// signal dispositions it inherited (a child forked by sh, before it
	// execs, may swallow a signal that sh traps), and then waits.
	const fg = `sh -c 'echo ready; exec sleep 100'`

	type step struct {
		sig     syscall.Signal
		waitFor string        // on stdout, after sending sig
		pause   time.Duration // after that
	}
	tests := []struct {
		name        string
		args        []string
		window      time.Duration
		steps       []step
		code        int
		out         string
		interrupted bool // kiln says it ended the call
	}{
		{
			name:  "SIGINT runs the trap and kiln exits with its code",
			args:  []string{"exec", id, "--", "sh", "-c", `trap "echo got INT; exit 7" INT; ` + fg},
			steps: []step{{sig: syscall.SIGINT}},
			code:  7, out: "ready\ngot INT\n",
		},
		{
			name:  "run: SIGTERM",
			args:  []string{"run", id, `trap "echo got TERM; exit 3" TERM; ` + fg},
			steps: []step{{sig: syscall.SIGTERM}},
			code:  3, out: "ready\ngot TERM\n",
		},
		{
			name:  "SIGHUP untrapped: 128+1",
			args:  []string{"exec", id, "--", "sh", "-c", fg},
			steps: []step{{sig: syscall.SIGHUP}},
			code:  128 + 1, out: "ready\n",
		},
		{
			// The sleep runs in the background, where SIGQUIT is ignored
			// (no core dump); wait is interrupted by the trapped signal.
			name:  "SIGQUIT",
			args:  []string{"exec", id, "--", "sh", "-c", `sleep 100 >/dev/null 2>&1 & pid=$!; trap 'echo got QUIT; kill $pid; exit 4' QUIT; echo ready; wait $pid`},
			steps: []step{{sig: syscall.SIGQUIT}},
			code:  4, out: "ready\ngot QUIT\n",
		},
		{
			name:  "a second signal within the window ends the call",
			args:  []string{"exec", id, "--", "sh", "-c", `trap "" INT; ` + fg},
			steps: []step{{sig: syscall.SIGINT}, {sig: syscall.SIGINT}},
			code:  128 + 2, out: "ready\n", interrupted: true,
		},
		{
			name:   "a signal after the window is forwarded too",
			args:   []string{"exec", id, "--", "sh", "-c", `trap "echo got INT" INT; ` + fg + `; sh -c 'echo again; exec sleep 100'`},
			window: 50 * time.Millisecond,
			steps:  []step{{sig: syscall.SIGINT, waitFor: "again", pause: 150 * time.Millisecond}, {sig: syscall.SIGTERM}},
			code:   128 + 15, out: "ready\ngot INT\nagain\n",
		},
		{
			name:   "a second SIGTERM ends the call with 128+15",
			args:   []string{"exec", id, "--", "sh", "-c", `trap "" TERM; ` + fg},
			window: time.Minute,
			steps:  []step{{sig: syscall.SIGTERM}, {sig: syscall.SIGTERM}},
			code:   128 + 15, out: "ready\n", interrupted: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, s := range tt.steps {
				// An ignored signal is inherited as ignored, and sh
				// cannot reset it: under nohup SIGHUP kills nothing.
				if signal.Ignored(s.sig) {
					t.Skipf("%v is ignored by this test process (run under nohup?), so the command's processes cannot end of it", s.sig)
				}
			}
			fs := &fakeSignals{}
			a := &cli{notify: fs.notify, interruptWindow: tt.window}
			stdout, stderr, done := kilnAsync(context.Background(), a, append([]string{"sandbox"}, tt.args...)...)
			stdout.waitFor(t, "ready\n", done)
			for _, s := range tt.steps {
				fs.send(t, s.sig)
				if s.waitFor != "" {
					stdout.waitFor(t, s.waitFor, done)
				}
				time.Sleep(s.pause)
			}
			code := waitExit(t, done)
			if code != tt.code || stdout.String() != tt.out {
				t.Errorf("exit %d, stdout %q; want %d, %q (stderr %q)", code, stdout.String(), tt.code, tt.out, stderr.String())
			}
			if got := strings.Contains(stderr.String(), "interrupted; sh was killed"); got != tt.interrupted {
				t.Errorf("stderr %q: says it was interrupted: %v; want %v", stderr.String(), got, tt.interrupted)
			}
			fs.mu.Lock()
			defer fs.mu.Unlock()
			if fs.calls != 1 || fs.stopped != 1 {
				t.Errorf("signals hooked %d times, unhooked %d; want once each", fs.calls, fs.stopped)
			}
			for _, want := range []os.Signal{syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP, syscall.SIGQUIT} {
				if !slices.Contains(fs.sigs, want) {
					t.Errorf("forwarded signals %v lack %v", fs.sigs, want)
				}
			}
		})
	}

	t.Run("the end of kiln's context without a signal ends the call", func(t *testing.T) {
		fs := &fakeSignals{}
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		stdout, stderr, done := kilnAsync(ctx, &cli{notify: fs.notify}, "sandbox", "exec", id, "--", "sh", "-c", fg)
		stdout.waitFor(t, "ready\n", done)
		cancel()
		if code := waitExit(t, done); code != 128+2 || !strings.Contains(stderr.String(), "interrupted; sh was killed") {
			t.Errorf("exit %d, stderr %q; want 130 and that it was interrupted", code, stderr.String())
		}
	})

	t.Run("background execs forward nothing", func(t *testing.T) {
		fs := &fakeSignals{}
		stdout, stderr, done := kilnAsync(context.Background(), &cli{notify: fs.notify}, "sandbox", "exec", "-d", id, "--", "sleep", "30")
		if code := waitExit(t, done); code != 0 || stdout.String() == "" {
			t.Fatalf("exec -d: exit %d, stdout %q, stderr %q", code, stdout.String(), stderr.String())
		}
		if fs.calls != 0 {
			t.Errorf("a background exec hooked signals %d times", fs.calls)
		}
	})

	// The real thing: SIGTERM sent to this process, caught by the
	// signal.NotifyContext that main sets up (which ends kiln's context) and
	// by the forwarder, which must tell that end from a plain cancel.
	t.Run("a real SIGTERM through main's NotifyContext", func(t *testing.T) {
		// Held for the whole subtest, so that a SIGTERM nothing else
		// catches cannot end the test binary.
		guard := make(chan os.Signal, 1)
		signal.Notify(guard, syscall.SIGTERM)
		defer signal.Stop(guard)
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		defer stop()
		stdout, stderr, done := kilnAsync(ctx, &cli{}, "sandbox", "run", id, `trap "echo got TERM; exit 5" TERM; `+fg)
		stdout.waitFor(t, "ready\n", done)
		if err := syscall.Kill(os.Getpid(), syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		code := waitExit(t, done)
		if code != 5 || stdout.String() != "ready\ngot TERM\n" {
			t.Errorf("exit %d, stdout %q, stderr %q; want 5 and the trap's output", code, stdout.String(), stderr.String())
		}
		if ctx.Err() == nil {
			t.Errorf("NotifyContext did not see the SIGTERM")
		}
	})
}
