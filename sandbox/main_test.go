package sandbox

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/guest/client"
	"github.com/kilnvm/kiln/internal/kvmtest"
	"github.com/kilnvm/kiln/internal/seccomptest"
	"github.com/kilnvm/kiln/vmmproc"
)

// TestMain lets the test binary serve as a VMM process (testProcess): the
// out-of-process tests start it again with vmmproc.SocketEnv set (and
// seccomptest.TriggerEnv for TestKVMSeccomp).
func TestMain(m *testing.M) {
	if os.Getenv(vmmproc.SocketEnv) != "" {
		if trigger := os.Getenv(seccomptest.TriggerEnv); trigger != "" {
			go seccomptest.Watch(context.Background(), trigger)
		}
		os.Exit(vmmproc.Main(context.Background(), nil))
	}
	os.Exit(m.Run())
}

// testRuntime is the cached Debian kernel with the agent built from this
// tree.
func testRuntime(t testing.TB) Runtime {
	t.Helper()
	rt, err := NewRuntime(RuntimeConfig{Kernel: kvmtest.Kernel(t), Agent: kvmtest.AgentBinary(t)})
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

// testProcess runs a sandbox's VM in a VMM process: this test binary.
func testProcess() *ProcessOptions {
	return &ProcessOptions{Command: []string{os.Args[0], "-test.run=^$"}}
}

// warmSnapshot is a snapshot of a plain sandbox (the agent's initramfs as
// root, 1 vCPU, 512 MiB, host name "warm"), made once per harness run
// (TestKVMWarmSnapshot, which the harness runs first) and restored by the
// tests that need a running agent but no boot of their own.
func warmSnapshot(t *testing.T) string {
	t.Helper()
	return kvmtest.Shared(t, "sandbox-warm", func(dir string) error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
		defer cancel()
		sb, err := Start(ctx, Options{Runtime: testRuntime(t), CPUs: 1, MemoryMiB: 512, Hostname: "warm"})
		if err != nil {
			return err
		}
		defer sb.Close(context.Background())
		// kvmtest.Shared renames dir into place: the snapshot lies in a
		// folder of its own inside it, and records no path of dir.
		return sb.Save(ctx, filepath.Join(dir, "snap"))
	}) + "/snap"
}

// shOut runs script in sb's guest with sh -c and returns its stdout,
// trimmed; a failure or a non-zero exit fails the test.
func shOut(t *testing.T, ctx context.Context, sb *Sandbox, script string) string {
	t.Helper()
	var out, errOut bytes.Buffer
	st, err := sb.Client().Exec(ctx, client.ExecOptions{Argv: []string{"sh", "-c", script}, Stdout: &out, Stderr: &errOut})
	if err != nil || !st.Success() {
		t.Fatalf("%q: %v %v; stderr %q", script, st, err, errOut.String())
	}
	return strings.TrimSpace(out.String())
}
