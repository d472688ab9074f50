package sandbox_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/internal/leakcheck"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestKVMSandboxSoak restores the warm snapshot into a VMM process
// (through one snapshot.Cache, as kilnd's creates from a template do) and
// closes it, N times (KILN_SOAK_CYCLES, default 16), four in flight; every
// 25th sandbox runs an exec. After a warm-up, this process's descriptors,
// goroutines, threads and memfds, the host's kiln memfds and VMM
// processes, the mounts and every file under the test's TMPDIR (the
// sandboxes' folders) are counted; after the cycles each must be back
// where it started.
func TestKVMSandboxSoak(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	n := 16
	if s := os.Getenv("KILN_SOAK_CYCLES"); s != "" {
		var err error
		if n, err = strconv.Atoi(s); err != nil || n < 1 {
			t.Fatalf("KILN_SOAK_CYCLES=%q: want a positive number of cycles", s)
		}
	}
	snap := sandbox.WarmSnapshot(t)
	// The sandboxes' folders land under a TMPDIR of the test's own, so
	// only its files are counted; short, for their Unix sockets.
	tmp, err := os.MkdirTemp("", "ss-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(tmp) })
	t.Setenv("TMPDIR", tmp)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Hour)
	defer cancel()

	const inFlight, execEvery = 4, 25
	// The restores share one checked, sealed copy of the snapshot's
	// memory, as kilnd's creates from a template do (its backend keeps a
	// snapshot.Cache): made in the warm-up, counted in the baseline.
	cache := snapshot.NewCache(1)
	t.Cleanup(func() { cache.Close() })
	cycle := func(i int) error {
		sb, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Hostname: fmt.Sprintf("soak-%d", i+100), Process: vmmProcess(), SnapshotCache: cache})
		if err != nil {
			return fmt.Errorf("cycle %d: restore: %w", i, err)
		}
		var errExec error
		if i < 0 || i%execEvery == 0 {
			var out bytes.Buffer
			st, err := sb.Client().Exec(ctx, client.ExecOptions{Argv: []string{"hostname"}, Stdout: &out})
			if want := fmt.Sprintf("soak-%d\n", i+100); err != nil || !st.Success() || out.String() != want {
				errExec = fmt.Errorf("cycle %d: exec: %v %v %q, want %q", i, st, err, out.String(), want)
			}
		}
		if err := sb.Close(ctx); err != nil {
			return fmt.Errorf("cycle %d: close: %w (%v)", i, err, errExec)
		}
		return errExec
	}
	run := func(from, to int) {
		t.Helper()
		var next atomic.Int64
		next.Store(int64(from))
		var failed atomic.Int32
		var wg sync.WaitGroup
		start := time.Now()
		for range inFlight {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for failed.Load() < 3 {
					i := int(next.Add(1) - 1)
					if i >= to {
						return
					}
					if err := cycle(i); err != nil {
						failed.Add(1)
						t.Error(err)
					}
					if d := i - from + 1; d%100 == 0 {
						t.Logf("%d cycles after %v", d, time.Since(start).Round(time.Second))
					}
				}
			}()
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
	}
	opts := leakcheck.Options{Trees: map[string]string{"TMPDIR": tmp}, ProcessEnv: vmmproc.SocketEnv}
	run(-2*inFlight, 0) // warm-up: what lives on is made here
	before, err := leakcheck.Take(opts)
	if err != nil {
		t.Fatal(err)
	}
	began := time.Now()
	run(0, n)
	elapsed := time.Since(began)
	t.Logf("%d cycles (restore in a VMM process, an exec every %d, close; %d in flight): %v, %v per cycle",
		n, execEvery, inFlight, elapsed.Round(time.Millisecond), (elapsed / time.Duration(n)).Round(time.Millisecond))
	sctx, scancel := context.WithTimeout(ctx, 2*time.Minute)
	defer scancel()
	after, diff, err := leakcheck.Settle(sctx, before, opts, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("after %d cycles:\n%s", n, leakcheck.Table(before, after))
	if diff != "" {
		t.Errorf("left after %d cycles:\n%s", n, strings.TrimSpace(diff))
	}
}
