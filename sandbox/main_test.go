package sandbox

import (
	"context"
	"os"
	"testing"

	"github.com/kilnvm/kiln/vmmproc"
)

// TestMain lets the test binary serve as a VMM process (testProcess): the
// out-of-process tests start it again with vmmproc.SocketEnv set.
func TestMain(m *testing.M) {
	if os.Getenv(vmmproc.SocketEnv) != "" {
		os.Exit(vmmproc.ServeMain(context.Background(), ""))
	}
	os.Exit(m.Run())
}

// testProcess runs a sandbox's VM in a VMM process: this test binary.
func testProcess() *ProcessOptions {
	return &ProcessOptions{Command: []string{os.Args[0], "-test.run=^$"}}
}
