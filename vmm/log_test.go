package vmm

import (
	"bytes"
	"log/slog"
	"strings"
	"testing"

	"github.com/kilnvm/kiln/internal/ratelog"
)

// TestVMLogIsRateLimited: what the VM and its devices log goes through a
// rate limit of the VM's own (its devices and transports get v.log), and
// Close reports what it dropped. A guest resetting a device 10,000 times
// wrote 10,000 lines once.
func TestVMLogIsRateLimited(t *testing.T) {
	var out bytes.Buffer
	v := newVM(Config{Logger: slog.New(slog.NewTextHandler(&out, nil))})
	dev := v.log.With("gsi", 5, "device_id", "blk0") // as attachVirtio gives a transport
	for range 10000 {
		dev.Warn("virtio device needs reset", "err", "queue 0: malformed")
	}
	during := strings.Count(out.String(), "\n")
	if err := v.Close(); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	t.Logf("10000 warnings: %d lines, %d at Close: %s", during, len(lines)-during, lines[len(lines)-1])
	if during > ratelog.DefaultBurst {
		t.Fatalf("%d lines for 10000 warnings, want at most %d", during, ratelog.DefaultBurst)
	}
	if len(lines) != during+1 || !strings.Contains(lines[len(lines)-1], "suppressed=9990") {
		t.Fatalf("Close wrote %d lines, want one summary of 9990: %q", len(lines)-during, lines[during:])
	}
	// A second VM over the same logger has a budget of its own.
	out.Reset()
	w := newVM(Config{Logger: v.log})
	w.log.Warn("virtio device needs reset")
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(out.String(), "\n"); n != 1 {
		t.Fatalf("a new VM's first warning: %d lines", n)
	}
}
