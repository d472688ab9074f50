package vmmbackend

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/sandbox"
	"github.com/kilnvm/kiln/vmmproc"
)

// The real backend without KVM: its failures are errors that say what is
// wrong, and leave no process behind. (Its sandboxes run in
// TestKVMDaemon, under the harness.)
func TestBackendErrors(t *testing.T) {
	dir := t.TempDir()
	kernel := filepath.Join(dir, "vmlinux")
	initrd := filepath.Join(dir, "initrd")
	os.WriteFile(kernel, []byte("not a kernel"), 0o644)
	os.WriteFile(initrd, []byte("not an initrd"), 0o644)
	rt := sandbox.Runtime{Kernel: kernel, Initrd: initrd}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	tests := []struct {
		name string
		b    *Backend
		spec daemon.CreateSpec
		want string
	}{
		{"no command", &Backend{Runtime: rt}, daemon.CreateSpec{Image: "busybox"}, "no VMM process command"},
		{"no source", &Backend{Runtime: rt, Process: sandbox.ProcessOptions{Command: []string{"false"}}}, daemon.CreateSpec{}, "an image or a checkpoint"},
		{"no checkpoint", &Backend{Runtime: rt, Process: sandbox.ProcessOptions{Command: []string{"false"}}}, daemon.CreateSpec{Checkpoint: filepath.Join(dir, "none")}, "none"},
		{"no image", &Backend{Runtime: rt, Images: filepath.Join(dir, "images"), Process: sandbox.ProcessOptions{Command: []string{"false"}}}, daemon.CreateSpec{Image: "busybox"}, "busybox"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.spec.Dir = t.TempDir()
			in, err := tc.b.Create(ctx, tc.spec)
			if err == nil {
				in.Close(ctx)
				t.Fatal("created")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %q does not name %q", err, tc.want)
			}
		})
	}
	actx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	b := &Backend{Runtime: rt, Process: sandbox.ProcessOptions{Command: []string{"false"}}}
	if _, err := b.Attach(actx, t.TempDir(), false); err == nil || !strings.Contains(err.Error(), "attach") {
		t.Errorf("attach to an empty folder: %v", err)
	}
}

func TestReap(t *testing.T) {
	cmd := exec.Command("sleep", "100")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	if err := reap(cmd.Process.Pid, 50*time.Millisecond); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("reap left the process running")
	}
	if st := cmd.ProcessState.Sys().(syscall.WaitStatus); !st.Signaled() || st.Signal() != syscall.SIGKILL {
		t.Errorf("process ended with %v, want SIGKILL", st)
	}
	if err := reap(os.Getpid(), time.Millisecond); err != nil {
		t.Errorf("reap of this process: %v", err)
	}
}

// The daemon's plain types say what the guest's and the VMM process's
// do: its bound on detached processes is the agent's, on a kept value the
// VMM process's, its watch operations are the client's.
func TestPlainTypes(t *testing.T) {
	if daemon.MaxDetached != agentpb.MaxDetached {
		t.Errorf("daemon.MaxDetached %d, the agent keeps %d", daemon.MaxDetached, agentpb.MaxDetached)
	}
	if daemon.MaxKeepValue != vmmproc.MaxKeepValue {
		t.Errorf("daemon.MaxKeepValue %d, a VMM process keeps %d", daemon.MaxKeepValue, vmmproc.MaxKeepValue)
	}
	for _, op := range []client.WatchOp{client.WatchCreate, client.WatchWrite, client.WatchRemove, client.WatchRename, client.WatchChmod} {
		if got := watchOp(op); int(got) != int(op) {
			t.Errorf("watch op %v is %d, want %d", op, got, op)
		}
	}
	for _, err := range []error{sandbox.ErrNotHeld, sandbox.ErrNotKept} {
		m := markErr(fmt.Errorf("wrapped: %w", err))
		if !errors.Is(m, err) || m.Error() != "wrapped: "+err.Error() {
			t.Errorf("marked %v: %v", err, m)
		}
	}
	if !errors.Is(markErr(sandbox.ErrNotHeld), daemon.ErrNotHeld) || !errors.Is(markErr(sandbox.ErrNotKept), daemon.ErrNotKept) {
		t.Error("not marked")
	}
}

func TestNewLongStateDir(t *testing.T) {
	long := filepath.Join(t.TempDir(), strings.Repeat("x", 100))
	if _, err := New(Options{StateDir: long, Command: []string{"kiln-vmm"}}); err == nil || !strings.Contains(err.Error(), "too long") {
		t.Errorf("New over %s: %v", long, err)
	}
	if _, err := New(Options{StateDir: t.TempDir()}); err == nil {
		t.Error("New without a command")
	}
}
