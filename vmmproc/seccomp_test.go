package vmmproc

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/seccomptest"
)

// TestKilledBySeccomp tells a death by SIGSYS from other ends.
func TestKilledBySeccomp(t *testing.T) {
	tests := []struct {
		script string
		want   bool
	}{
		{"kill -SYS $$", true},
		{"kill -KILL $$", false},
		{"exit 2", false},
		{"exit 0", false},
	}
	for _, tt := range tests {
		err := exec.Command("sh", "-c", tt.script).Run()
		if got := killedBySeccomp(err); got != tt.want {
			t.Errorf("%q (%v): killedBySeccomp %v, want %v", tt.script, err, got, tt.want)
		}
	}
}

// lockedBuffer is a log sink the Wait goroutine and the test share.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestSeccompDeathReported: a VMM process (this test binary, no VM) that
// installs the VMM filter and calls mount(2) dies of SIGSYS, and its
// parent says so: a ProcessError with Seccomp set and the plain Status,
// and one Error line with the PID.
func TestSeccompDeathReported(t *testing.T) {
	dir, err := os.MkdirTemp("", "vmmproc-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	trigger := filepath.Join(dir, "trigger")
	if err := os.Mkdir(trigger, 0o700); err != nil {
		t.Fatal(err)
	}
	var logs lockedBuffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := Start(ctx, StartConfig{Command: []string{os.Args[0], "-test.run=^$"}, Dir: dir, Env: []string{seccomptest.TriggerEnv + "=" + trigger}, Logger: log})
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	defer p.Close(context.Background())
	if err := os.WriteFile(seccomptest.File(trigger, p.PID()), []byte(seccomptest.Install), 0o600); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-ctx.Done():
		t.Fatal("the VMM process did not die")
	}
	var pe *ProcessError
	if err := p.deathError(); !errors.As(err, &pe) || !pe.Seccomp || pe.Status != seccompStatus || pe.PID != p.PID() {
		t.Fatalf("death: %#v", err)
	}
	t.Logf("parent reports: %v", pe)
	if !strings.Contains(pe.LogTail, "calling mount(2)") || strings.Contains(pe.LogTail, "returned") {
		t.Errorf("log tail %q", pe.LogTail)
	}
	line := logs.String()
	if !strings.Contains(line, "level=ERROR") || !strings.Contains(line, "SIGSYS") || !strings.Contains(line, "pid="+strconv.Itoa(p.PID())) {
		t.Errorf("parent's log: %q", line)
	}
	// An RPC to the dead process names the death too.
	if _, err := p.Wait(ctx); !errors.As(err, &pe) || !pe.Seccomp {
		t.Errorf("Wait after the death: %v", err)
	}
}

// TestSeccompModeRefused: a VMM process given a mode that is none exits
// at once, naming the variable.
func TestSeccompModeRefused(t *testing.T) {
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	p, err := Start(ctx, StartConfig{Command: []string{os.Args[0], "-test.run=^$"}, Dir: dir, Env: []string{"KILN_SECCOMP=allow-all"}})
	if err == nil {
		p.Close(context.Background())
		t.Fatal("a VMM process with KILN_SECCOMP=allow-all started")
	}
	var pe *ProcessError
	if !errors.As(err, &pe) || !strings.Contains(pe.LogTail, "KILN_SECCOMP") || !strings.Contains(pe.Status, "exit status 2") {
		t.Fatalf("Start: %v", err)
	}
	t.Log(err)
}
