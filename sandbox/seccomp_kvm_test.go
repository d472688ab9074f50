package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/internal/seccomptest"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestKVMSeccomp runs sandboxes in VMM processes under their seccomp
// filter (kill mode): every thread of each VMM process is filtered
// (Seccomp: 2, NoNewPrivs: 1); a restore of the warm snapshot, execs, a
// file written and read, a save, a restore of that in a second VMM process
// and a fork into a third all work under it; and a VMM process that makes
// a forbidden call (mount(2), through the test binary's trigger) dies of
// SIGSYS, which its sandbox reports as a seccomp kill while the others run
// on. A cold boot under the filter is not repeated here: every other test
// that boots in a VMM process (kilnd's templates, the CLI's) runs under
// the same default filter.
func TestKVMSeccomp(t *testing.T) {
	kvmtest.Require(t)
	kvmtest.Kernel(t)
	warm := warmSnapshot(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	trigger := t.TempDir()
	proc := testProcess()
	proc.Env = append(proc.Env, seccomptest.TriggerEnv+"="+trigger)

	begin := time.Now()
	a, err := Restore(ctx, warm, RestoreOptions{Hostname: "filtered", Process: proc})
	if err != nil {
		t.Fatalf("Restore: %v", err)
	}
	defer a.Close(context.Background())
	t.Logf("restored in a filtered VMM process %d in %v", a.PID(), time.Since(begin).Round(time.Millisecond))
	checkFiltered(t, "a", a.PID())

	run := func(sb *Sandbox, script string) string {
		t.Helper()
		return shOut(t, ctx, sb, script)
	}
	if got := run(a, "hostname; echo $((6*7))"); got != "filtered\n42" {
		t.Fatalf("exec: %q", got)
	}
	data := bytes.Repeat([]byte("kiln seccomp "), 10000)
	if err := a.Client().WriteFile(ctx, "/tmp/f", bytes.NewReader(data), 0o644); err != nil {
		t.Fatalf("WriteFile: %v", err)
	}
	var back bytes.Buffer
	if _, err := a.Client().ReadFile(ctx, "/tmp/f", &back); err != nil || !bytes.Equal(back.Bytes(), data) {
		t.Fatalf("ReadFile: %d bytes, %v", back.Len(), err)
	}

	snap := filepath.Join(t.TempDir(), "snap")
	if err := a.Save(ctx, snap); err != nil {
		t.Fatalf("Save under the filter: %v", err)
	}
	b, err := Restore(ctx, snap, RestoreOptions{Hostname: "restored", Process: proc})
	if err != nil {
		t.Fatalf("Restore in a second VMM process: %v", err)
	}
	defer b.Close(context.Background())
	checkFiltered(t, "b", b.PID())
	if got := run(b, "hostname; cat /tmp/f | wc -c"); got != fmt.Sprintf("restored\n%d", len(data)) {
		t.Fatalf("restored: %q", got)
	}
	kids, err := b.Fork(ctx, 1, ForkOptions{})
	if err != nil {
		t.Fatalf("Fork under the filter: %v", err)
	}
	defer kids[0].Close(context.Background())
	checkFiltered(t, "b's child", kids[0].PID())
	if got := run(kids[0], "hostname"); got != "restored-0" {
		t.Fatalf("child: %q", got)
	}
	if got := run(a, "echo after save; sync"); got != "after save" {
		t.Fatalf("a after the save: %q", got)
	}

	// The forbidden call: a's VMM process calls mount(2).
	if err := os.WriteFile(seccomptest.File(trigger, a.PID()), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	select {
	case <-a.Done():
	case <-time.After(2 * time.Minute):
		t.Fatal("the sandbox did not notice its VMM process died")
	}
	_, err = a.Exit()
	var pe *vmmproc.ProcessError
	if !errors.As(err, &pe) || !pe.Seccomp || !strings.Contains(err.Error(), "seccomp filter (SIGSYS)") || pe.PID != a.PID() {
		t.Fatalf("Exit after the forbidden call: %v", err)
	}
	t.Logf("a: %v", err)
	if got := run(b, "echo still here"); got != "still here" {
		t.Fatalf("b after a's VMM died: %q", got)
	}
}

// checkFiltered checks every thread of process pid for the VMM's filter.
func checkFiltered(t *testing.T, name string, pid int) {
	t.Helper()
	if pid == os.Getpid() {
		t.Fatalf("%s runs in this process", name)
	}
	tasks, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(tasks) == 0 {
		t.Fatalf("%s: tasks of %d: %v", name, pid, err)
	}
	for _, f := range tasks {
		st, err := os.ReadFile(f)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !bytes.Contains(st, []byte("\nSeccomp:\t2\n")) || !bytes.Contains(st, []byte("\nNoNewPrivs:\t1\n")) {
			t.Fatalf("%s: %s is not filtered:\n%s", name, f, st)
		}
	}
	t.Logf("%s: VMM process %d: %d threads, all Seccomp: 2, NoNewPrivs: 1", name, pid, len(tasks))
}
