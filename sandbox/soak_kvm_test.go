package sandbox_test

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kilnvm/kiln/cgroup"
	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/internal/leakcheck"
	"github.com/kilnvm/kiln/jail"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/snapshot"
	"github.com/kilnvm/kiln/vmmproc"
	"golang.org/x/sys/unix"
)

// TestKVMSandboxSoak restores the warm snapshot into a VMM process
// (through one snapshot.Cache, as kilnd's creates from a template do) and
// closes it, N times (KILN_SOAK_CYCLES, default 16), four in flight; every
// 25th sandbox runs an exec. As root (always, in the harness's L1) each
// VMM process is jailed as kilnd jails it (kiln-vmm without cgo, an id of
// its own, namespaces, pivot_root) and starts in a cgroup of its own,
// made before the restore and removed after the close. After a warm-up,
// this process's descriptors, goroutines, threads and memfds, the host's
// kiln memfds and VMM processes, the cgroups, the held jail ids, the
// mounts and every file under the test's TMPDIR (the sandboxes' folders)
// are counted; after the cycles each must be back where it started.
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
	proc, cgroups, ids := soakConfinement(t)
	// The host key the warm snapshot was saved with: where no user
	// config folder is writable (L1's read-only root) its file lies under
	// TMPDIR, which changes below.
	key, err := snapshot.LoadKey(sandbox.SnapshotKeyFile())
	if err != nil {
		t.Fatal(err)
	}
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
		p := *proc
		if cgroups != nil {
			id := fmt.Sprintf("soak-%d", i+100)
			g, err := cgroups.Create(id, cgroup.Limits{CPUs: 1, MemoryMiB: 512, OverheadMiB: 256, PidsMax: 256})
			if err != nil {
				return fmt.Errorf("cycle %d: %w", i, err)
			}
			defer cgroups.Remove(context.Background(), id)
			p.Cgroup = g.Path
		}
		sb, err := sandbox.Restore(ctx, snap, sandbox.RestoreOptions{Hostname: fmt.Sprintf("soak-%d", i+100), Process: &p, SnapshotCache: cache, SnapshotKey: key})
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
		if cgroups != nil {
			if err := cgroups.Remove(ctx, fmt.Sprintf("soak-%d", i+100)); err != nil {
				return fmt.Errorf("cycle %d: remove its cgroup: %w (%v)", i, err, errExec)
			}
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
	if cgroups != nil {
		opts.Cgroups = cgroups.Root()
	}
	if ids != nil {
		opts.Counters = map[string]func() ([]string, error){"jail ids held": func() ([]string, error) {
			var held []string
			for id := jail.FirstID; id < jail.FirstID+soakIDs; id++ {
				h, err := ids.Held(id)
				if err != nil {
					return held, err
				}
				if h {
					held = append(held, strconv.Itoa(id))
				}
			}
			return held, nil
		}}
	}
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

// soakIDs is how many jail ids the soak's allocator hands out: more than
// it ever holds at once (four sandboxes in flight).
const soakIDs = 64

// soakConfinement returns the soak's VMM process options: as root, jailed
// (kiln-vmm without cgo, ids from a fresh allocator) with a cgroup v2
// manager under a folder of the test's own in the host's hierarchy, for a
// cgroup per sandbox; otherwise the plain VMM process, with neither (said
// in the log).
func soakConfinement(t *testing.T) (*sandbox.ProcessOptions, *cgroup.Manager, *jail.IDs) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Log("not root: VMM processes not jailed, no cgroup per sandbox")
		return vmmProcess(), nil, nil
	}
	ids, err := jail.NewIDs(t.TempDir(), jail.FirstID, soakIDs)
	if err != nil {
		t.Fatal(err)
	}
	proc := &sandbox.ProcessOptions{Command: []string{kvmtest.VMMBinary(t)}, Jail: &sandbox.JailOptions{IDs: ids}}
	var st unix.Statfs_t
	if err := unix.Statfs(cgroup.DefaultMount, &st); err != nil || st.Type != unix.CGROUP2_SUPER_MAGIC {
		t.Fatalf("%s is not a cgroup v2 mount (%v): the KVM harness's L1 has one", cgroup.DefaultMount, err)
	}
	// The root cgroup may hold processes and still delegate.
	if err := os.WriteFile(filepath.Join(cgroup.DefaultMount, "cgroup.subtree_control"), []byte("+cpu +memory +pids +io"), 0); err != nil {
		t.Fatalf("enable controllers in the root cgroup: %v", err)
	}
	root := filepath.Join(cgroup.DefaultMount, fmt.Sprintf("kiln-soak-%d", os.Getpid()))
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatal(err)
	}
	m, err := cgroup.Open(root)
	if err != nil {
		unix.Rmdir(root)
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		left, _ := m.List()
		for _, id := range left {
			m.Remove(ctx, id)
		}
		unix.Rmdir(filepath.Join(root, cgroup.SandboxesDir))
		if err := unix.Rmdir(root); err != nil {
			t.Errorf("remove the soak's cgroup folder: %v", err)
		}
	})
	return proc, m, ids
}
