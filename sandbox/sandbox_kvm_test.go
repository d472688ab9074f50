package sandbox

import (
	"bytes"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"fmt"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
)

// hashWriter counts and hashes what is written to it.
type hashWriter struct {
	n    int64
	h    hashState
	last atomic.Int64 // unix nanoseconds of the last write
	seen atomic.Int64 // bytes so far, for the stall watch
}

type hashState interface {
	io.Writer
	Sum([]byte) []byte
}

func newHashWriter() *hashWriter { return &hashWriter{h: sha256.New()} }

func (w *hashWriter) Write(p []byte) (int, error) {
	w.n += int64(len(p))
	w.seen.Store(w.n)
	w.last.Store(time.Now().UnixNano())
	return w.h.Write(p)
}

// watchStall logs the sandbox's diagnosis when w has had no data for
// stall, so that a stream that stops says where it stopped (device or
// guest). It returns a function that ends the watch.
func watchStall(t *testing.T, sb *Sandbox, w *hashWriter, stall time.Duration) func() {
	t.Helper()
	w.last.Store(time.Now().UnixNano())
	done := make(chan struct{})
	go func() {
		tick := time.NewTicker(stall / 4)
		defer tick.Stop()
		reported := int64(0)
		for {
			select {
			case <-done:
				return
			case <-tick.C:
			}
			last := w.last.Load()
			if time.Since(time.Unix(0, last)) < stall || last == reported {
				continue
			}
			reported = last
			t.Logf("no data for %v after %d bytes; VM:\n%s", stall, w.seen.Load(), sb.Diagnose())
		}
	}()
	return func() { close(done) }
}

// TestKVMAgent restores one sandbox from the run's warm snapshot (Debian's
// kernel with its virtio modules, the agent as init) and runs the guest
// agent's must-shows in it.
func TestKVMAgent(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute) // to the agent
	defer cancel()
	var console kvmtest.Console
	start := time.Now()
	// One vCPU: under TCG-nested KVM, guests with two vCPUs doing heavy
	// I/O have stalled (an RCU stall on one vCPU, a soft lockup on the
	// other, as if an IPI were lost); two-vCPU guests are covered by the
	// kiln boot test.
	sb, err := Restore(ctx, warmSnapshot(t), RestoreOptions{Hostname: "kvmtest", Console: &console})
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	t.Logf("agent ready after %v", time.Since(start).Round(time.Millisecond))
	defer func() {
		if err := sb.Close(context.Background()); err != nil {
			t.Errorf("Close: %v", err)
		}
		exit, _ := sb.Exit()
		t.Logf("VM stopped: %v", exit)
		if t.Failed() {
			t.Logf("guest console:\n%s", console.String())
		}
	}()
	c := sb.Client()

	run := func(ctx context.Context, t *testing.T, opts client.ExecOptions) (string, string, client.ExitStatus) {
		t.Helper()
		var stdout, stderr bytes.Buffer
		opts.Stdout, opts.Stderr = &stdout, &stderr
		st, err := c.Exec(ctx, opts)
		if err != nil {
			t.Fatalf("Exec %q: %v", opts.Argv, err)
		}
		return stdout.String(), stderr.String(), st
	}
	alive := func(ctx context.Context, t *testing.T) {
		t.Helper()
		out, _, st := run(ctx, t, client.ExecOptions{Argv: []string{"echo", "still here"}})
		if out != "still here\n" || !st.Success() {
			t.Fatalf("agent after the test: %q %v", out, st)
		}
	}

	// subCtx is a check's context: it ends after 5 minutes, or at once
	// when the VM stops (a check cannot pass then).
	subCtx := func() (context.Context, context.CancelFunc) {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		go func() {
			select {
			case <-sb.Done():
				cancel()
			case <-ctx.Done():
			}
		}()
		return ctx, cancel
	}
	// sub runs one check; when it fails and the agent no longer answers,
	// the checks after it cannot run: stop there instead of letting each
	// wait for its deadline.
	sub := func(name string, f func(t *testing.T)) {
		if t.Run(name, f) {
			return
		}
		select {
		case <-sb.Done():
			exit, err := sb.Exit()
			t.Fatalf("after %q failed: the VM stopped: %v %v", name, exit, err)
		default:
		}
		hctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := c.Health(hctx); err != nil {
			t.Fatalf("after %q failed, the agent no longer answers: %v", name, err)
		}
	}

	// The kernel's modules disk, in the initramfs root of a sandbox
	// restored from a snapshot: still mounted read-only at
	// /lib/modules/$(uname -r), and busybox's modprobe loads from it.
	sub("modules disk", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		script := `r=$(uname -r)
grep " /lib/modules/$r " /proc/mounts | cut -d' ' -f3,4 | cut -d, -f1
touch /lib/modules/$r/x 2>/dev/null && echo writable
modprobe br_netfilter && grep -c '^br_netfilter ' /proc/modules
modprobe overlay && grep -c '^overlay ' /proc/modules`
		out, errOut, st := run(ctx, t, client.ExecOptions{Argv: []string{"sh", "-c", script}})
		if want := "ext4 ro\n1\n1\n"; out != want || !st.Success() {
			t.Fatalf("modules disk: stdout %q (want %q), stderr %q, %v", out, want, errOut, st)
		}
	})
	sub("streams and exit code", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		out, errOut, st := run(ctx, t, client.ExecOptions{Argv: []string{"sh", "-c", "echo out; echo err >&2; exit 3"}})
		if out != "out\n" || errOut != "err\n" || st.Code != 3 {
			t.Fatalf("stdout %q stderr %q status %v", out, errOut, st)
		}
	})
	sub("info", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		info, err := c.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("guest: %+v", info)
		if info.Hostname != "kvmtest" || info.NumCPU != 1 || info.MemTotal < 400<<20 || !strings.HasPrefix(info.KernelRelease, "6.") {
			t.Fatalf("info %+v", info)
		}
	})
	sub("100 MiB of stdout", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		const size = 100 << 20
		w := newHashWriter()
		defer watchStall(t, sb, w, 45*time.Second)()
		st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"head", "-c", fmt.Sprint(size), "/dev/zero"}, Stdout: w})
		if err != nil || !st.Success() {
			t.Fatalf("Exec: %v %v", st, err)
		}
		want := sha256.Sum256(make([]byte, size))
		if w.n != size || !bytes.Equal(w.h.Sum(nil), want[:]) {
			t.Fatalf("got %d bytes, sha256 %x", w.n, w.h.Sum(nil))
		}
		t.Logf("after the stream (queue indices count packets, modulo 65536): %s", sb.Diagnose())
	})
	sub("stdin through cat", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		data := make([]byte, 8<<20)
		rand.Read(data)
		w := newHashWriter()
		defer watchStall(t, sb, w, 45*time.Second)()
		st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"cat"}, Stdin: bytes.NewReader(data), Stdout: w})
		if err != nil || !st.Success() {
			t.Fatalf("Exec: %v %v", st, err)
		}
		want := sha256.Sum256(data)
		if w.n != int64(len(data)) || !bytes.Equal(w.h.Sum(nil), want[:]) {
			t.Fatalf("cat gave back %d of %d bytes, sha256 %x", w.n, len(data), w.h.Sum(nil))
		}
	})
	sub("50 concurrent execs", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		var wg sync.WaitGroup
		errs := make(chan error, 50)
		for i := range 50 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				var out bytes.Buffer
				st, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", fmt.Sprintf("sleep 0.$((%d %% 5)); echo exec-%d", i, i)}, Stdout: &out})
				if err != nil || !st.Success() || out.String() != fmt.Sprintf("exec-%d\n", i) {
					errs <- fmt.Errorf("exec %d: %q %v %v", i, out.String(), st, err)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	})
	sub("timeout", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		begin := time.Now()
		_, _, st := run(ctx, t, client.ExecOptions{Argv: []string{"sleep", "600"}, Timeout: 2 * time.Second})
		if !st.TimedOut || st.Signal != 9 {
			t.Fatalf("status %v, want killed by the timeout", st)
		}
		if d := time.Since(begin); d > time.Minute {
			t.Fatalf("the timeout took %v", d)
		}
	})
	sub("file round trip", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		data := make([]byte, 10<<20)
		rand.Read(data)
		if err := c.WriteFile(ctx, "/tmp/kiln/blob", bytes.NewReader(data), 0o640, client.MakeParents()); err != nil {
			t.Fatal(err)
		}
		fi, err := c.Stat(ctx, "/tmp/kiln/blob")
		if err != nil || fi.Size != int64(len(data)) || fi.Mode.Perm() != 0o640 {
			t.Fatalf("Stat: %+v %v", fi, err)
		}
		var back bytes.Buffer
		if _, err := c.ReadFile(ctx, "/tmp/kiln/blob", &back); err != nil {
			t.Fatal(err)
		}
		if sha256.Sum256(back.Bytes()) != sha256.Sum256(data) {
			t.Fatalf("read back %d bytes that differ", back.Len())
		}
		// The guest sees the same bytes.
		out, _, _ := run(ctx, t, client.ExecOptions{Argv: []string{"sha256sum", "/tmp/kiln/blob"}})
		if want := fmt.Sprintf("%x", sha256.Sum256(data)); !strings.HasPrefix(out, want) {
			t.Fatalf("guest sha256sum %q, want %s", out, want)
		}
	})
	sub("errors", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		_, err := c.Exec(ctx, client.ExecOptions{Argv: []string{"no-such-binary"}})
		if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), "no-such-binary") {
			t.Errorf("missing binary: %v", err)
		}
		_, err = c.Exec(ctx, client.ExecOptions{Argv: []string{"true"}, Dir: "/no/such/dir"})
		if err == nil || !strings.Contains(err.Error(), "/no/such/dir") {
			t.Errorf("bad working directory: %v", err)
		}
		if _, err := c.ReadFile(ctx, "/no/such/file", io.Discard); status.Code(err) != codes.NotFound {
			t.Errorf("reading a missing file: %v", err)
		}
		// A file too large for the guest: a 1 MiB tmpfs.
		if _, _, st := run(ctx, t, client.ExecOptions{Argv: []string{"sh", "-c", "mkdir -p /small && mount -t tmpfs -o size=1m tmpfs /small"}}); !st.Success() {
			t.Fatalf("mounting a small tmpfs: %v", st)
		}
		err = c.WriteFile(ctx, "/small/big", bytes.NewReader(make([]byte, 4<<20)), 0o644)
		if status.Code(err) != codes.ResourceExhausted {
			t.Errorf("writing 4 MiB into 1 MiB: %v", err)
		}
		if _, err := c.Stat(ctx, "/small/big"); status.Code(err) != codes.NotFound {
			t.Errorf("a failed write left a file behind: %v", err)
		}
		alive(ctx, t)
	})
	sub("memory flood", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		_, _, st := run(ctx, t, client.ExecOptions{Argv: []string{"sh", "-c", `a=xxxxxxxxxxxxxxxx; while :; do a="$a$a"; done`}, Timeout: 5 * time.Minute})
		if st.Success() || st.TimedOut {
			t.Fatalf("a memory hog ended with %v", st)
		}
		t.Logf("memory hog: %v", st)
		alive(ctx, t)
	})
	sub("fork bomb", func(t *testing.T) {
		ctx, cancel := subCtx()
		defer cancel()
		_, _, st := run(ctx, t, client.ExecOptions{Argv: []string{"sh", "-c", `b() { b | b & }; b; sleep 600`}, Timeout: 10 * time.Second})
		t.Logf("fork bomb: %v", st)
		if !st.TimedOut {
			t.Fatalf("fork bomb ended with %v, want the timeout to kill it", st)
		}
		alive(ctx, t)
		out, _, _ := run(ctx, t, client.ExecOptions{Argv: []string{"sh", "-c", "ls /proc | grep -c '^[0-9]'"}})
		t.Logf("processes left: %s", strings.TrimSpace(out))
	})
}
