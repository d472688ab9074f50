package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// TestKVMSnapshot boots one sandbox, leaves a counting loop running in it,
// saves it, and restores the snapshot: once alone, then as 8 clones one
// after the other. The loop counts on after restore; every clone writes
// only its own files, draws different random bytes and has the host's
// time.
func TestKVMSnapshot(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	sb, err := Start(ctx, Options{Agent: kvmtest.AgentBinary(t), CPUs: 1, MemoryMiB: 256, Hostname: "snap"})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer sb.Close(context.Background())
	sh := func(t *testing.T, c *client.Client, script string) string {
		t.Helper()
		var out, errOut bytes.Buffer
		st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errOut})
		if err != nil || !st.Success() {
			t.Fatalf("%q: %v %v; stderr %q", script, st, err, errOut.String())
		}
		return strings.TrimSpace(out.String())
	}
	counter := func(t *testing.T, c *client.Client) int {
		t.Helper()
		n, err := strconv.Atoi(sh(t, c, "cat /run/count"))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	sh(t, sb.Client(), `echo before-save > /tmp/marker
(i=0; while :; do i=$((i+1)); echo $i > /run/count.new; mv /run/count.new /run/count; sleep 0.2; done) >/dev/null 2>&1 &
sleep 1`)
	dir := filepath.Join(t.TempDir(), "snap")
	begin := time.Now()
	if err := sb.Save(ctx, dir); err != nil {
		t.Fatalf("Save: %v", err)
	}
	t.Logf("saved in %v", time.Since(begin).Round(time.Millisecond))
	saved := counter(t, sb.Client()) // the original runs on: at least this

	t.Run("fork a running sandbox", func(t *testing.T) {
		begin := time.Now()
		kids, err := sb.Fork(ctx, 2)
		if err != nil {
			t.Fatalf("Fork: %v", err)
		}
		t.Logf("2 children answering after %v", time.Since(begin).Round(time.Millisecond))
		for _, k := range kids {
			defer k.Close(context.Background())
		}
		for i, k := range kids {
			sh(t, k.Client(), fmt.Sprintf("echo %d > /tmp/kid", i))
			if got := sh(t, k.Client(), "hostname"); got != fmt.Sprintf("snap-%d", i) {
				t.Errorf("child %d hostname %q", i, got)
			}
			if got := sh(t, k.Client(), "cat /tmp/marker"); got != "before-save" {
				t.Errorf("child %d lost the parent's file: %q", i, got)
			}
		}
		for i, k := range kids {
			if got := sh(t, k.Client(), "cat /tmp/kid"); got != fmt.Sprint(i) {
				t.Errorf("child %d reads %q from its own file", i, got)
			}
		}
		// The parent runs on, and sees none of it.
		if got := sh(t, sb.Client(), "cat /tmp/kid 2>/dev/null || echo none"); got != "none" {
			t.Errorf("the parent sees a child's file: %q", got)
		}
		if a, b := counter(t, sb.Client()), counter(t, kids[0].Client()); a < saved || b < saved {
			t.Errorf("counters after fork: parent %d, child %d, saved %d", a, b, saved)
		}
		// A child forks in turn: the grandchild has its parent's file.
		grand, err := kids[0].Fork(ctx, 1)
		if err != nil {
			t.Fatalf("Fork of a child: %v", err)
		}
		defer grand[0].Close(context.Background())
		if got := sh(t, grand[0].Client(), "cat /tmp/kid; hostname"); got != "0\nsnap-0-0" {
			t.Errorf("grandchild: %q", got)
		}
	})

	if err := sb.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}

	t.Run("restore", func(t *testing.T) {
		begin := time.Now()
		r, err := Restore(ctx, dir, RestoreOptions{})
		if err != nil {
			t.Fatalf("Restore: %v", err)
		}
		defer r.Close(context.Background())
		t.Logf("restored to a working agent in %v", time.Since(begin).Round(time.Millisecond))
		if got := sh(t, r.Client(), "cat /tmp/marker"); got != "before-save" {
			t.Fatalf("tmpfs file after restore: %q", got)
		}
		first := counter(t, r.Client())
		time.Sleep(2 * time.Second)
		second := counter(t, r.Client())
		t.Logf("counter: %d when saved (or later), %d and %d after restore", saved, first, second)
		if first <= 0 || second <= first {
			t.Fatalf("the counting loop did not go on after restore: %d then %d", first, second)
		}
	})

	t.Run("8 clones", func(t *testing.T) {
		// Eight clones of one snapshot, one after the other: several
		// guests restored and torn down at once have crashed the emulated
		// L1 the tests run in, and uniqueness does not need them to
		// overlap (kiln fork runs clones at once; its test covers that).
		const n = 8
		random := map[string]int{}
		for i := range n {
			begin := time.Now()
			c, err := Restore(ctx, dir, RestoreOptions{Hostname: fmt.Sprintf("clone-%d", i)})
			if err != nil {
				t.Fatalf("clone %d: %v", i, err)
			}
			t.Logf("clone %d answering after %v", i, time.Since(begin).Round(time.Millisecond))
			r, ok := func() (string, bool) {
				defer c.Close(context.Background())
				return checkClone(t, c, i, sh)
			}()
			if !ok {
				t.FailNow()
			}
			if k, dup := random[r]; dup {
				t.Errorf("clones %d and %d read the same bytes from /dev/urandom: %s", k, i, r)
			}
			random[r] = i
		}
		if len(random) != n {
			t.Errorf("%d different /dev/urandom readings from %d clones", len(random), n)
		}
	})
}

// checkClone checks clone i of the snapshot: it writes a file of its own
// and sees no other clone's, has its own host name and the host's time
// (within a second, busybox's date having whole seconds). It returns the
// first bytes the clone reads from /dev/urandom, and false when a check
// could not run.
func checkClone(t *testing.T, c *Sandbox, i int, sh func(*testing.T, *client.Client, string) string) (string, bool) {
	t.Helper()
	sh(t, c.Client(), fmt.Sprintf("echo %d > /tmp/mine-%d", i, i))
	if got := sh(t, c.Client(), "ls /tmp/ | grep mine- | tr '\\n' ' '"); got != fmt.Sprintf("mine-%d", i) {
		t.Errorf("clone %d sees %q", i, got)
	}
	if got := sh(t, c.Client(), "hostname"); got != fmt.Sprintf("clone-%d", i) {
		t.Errorf("clone %d hostname %q", i, got)
	}
	r := sh(t, c.Client(), "head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
	before := time.Now()
	secs, err := strconv.ParseInt(sh(t, c.Client(), "date +%s"), 10, 64)
	after := time.Now()
	if err != nil {
		t.Errorf("clone %d: %v", i, err)
		return r, false
	}
	guest := time.Unix(secs, 0)
	if guest.Before(before.Add(-2*time.Second)) || guest.After(after.Add(time.Second)) {
		t.Errorf("clone %d: clock %v, host between %v and %v", i, guest, before, after)
	}
	return r, true
}
