package daemon_test

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// TestSeam: the daemon imports no layer below its Backend seam: no VMM,
// VMM process, sandbox, snapshot, image, device or guest package
// (vmmbackend, which kilnd wires in, does); nor does its test double,
// daemontest.
func TestSeam(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command:", err)
	}
	below := []string{"vmm", "vmmproc", "sandbox", "snapshot", "image", "virtio", "kvm", "memory", "guest", "jail", "seccomp", "initramfs", "guestkernel"}
	for _, dir := range []string{".", "./daemontest"} {
		out, err := exec.Command(goBin, "list", "-deps", dir).Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", dir, err)
		}
		for _, pkg := range strings.Fields(string(out)) {
			rest, ok := strings.CutPrefix(pkg, "github.com/kilnvm/kiln/")
			if !ok {
				continue
			}
			top, _, _ := strings.Cut(rest, "/")
			if slices.Contains(below, top) {
				t.Errorf("%s imports %s, below the seam", dir, pkg)
			}
		}
	}
}
