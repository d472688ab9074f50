package daemon_test

import (
	"os/exec"
	"strings"
	"testing"
)

// TestSeam: the daemon imports no layer below its Backend seam: no VMM,
// VMM process, sandbox, snapshot, image, device or guest package
// (vmmbackend, which kilnd wires in, does).
func TestSeam(t *testing.T) {
	goBin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go command:", err)
	}
	out, err := exec.Command(goBin, "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	below := []string{"vmm", "vmmproc", "sandbox", "snapshot", "image", "virtio", "kvm", "memory", "guest", "jail", "seccomp", "initramfs", "guestkernel"}
	for _, pkg := range strings.Fields(string(out)) {
		rest, ok := strings.CutPrefix(pkg, "github.com/kilnvm/kiln/")
		if !ok {
			continue
		}
		top, _, _ := strings.Cut(rest, "/")
		for _, b := range below {
			if top == b {
				t.Errorf("the daemon imports %s, below its seam", pkg)
			}
		}
	}
}
