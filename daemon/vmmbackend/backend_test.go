package daemon

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kilnvm/kiln/sandbox"
)

// The real backend without KVM: its failures are errors that say what is
// wrong, and leave no process behind. (Its sandboxes run in
// TestKVMDaemon, under the harness.)
func TestSandboxBackendErrors(t *testing.T) {
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
		b    *SandboxBackend
		spec CreateSpec
		want string
	}{
		{"no command", &SandboxBackend{Runtime: rt}, CreateSpec{Image: "busybox"}, "no VMM process command"},
		{"no source", &SandboxBackend{Runtime: rt, Process: sandbox.ProcessOptions{Command: []string{"false"}}}, CreateSpec{}, "an image or a checkpoint"},
		{"no checkpoint", &SandboxBackend{Runtime: rt, Process: sandbox.ProcessOptions{Command: []string{"false"}}}, CreateSpec{Checkpoint: filepath.Join(dir, "none")}, "none"},
		{"no image", &SandboxBackend{Runtime: rt, Images: filepath.Join(dir, "images"), Process: sandbox.ProcessOptions{Command: []string{"false"}}}, CreateSpec{Image: "busybox"}, "busybox"},
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
	b := &SandboxBackend{Runtime: rt, Process: sandbox.ProcessOptions{Command: []string{"false"}}}
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
