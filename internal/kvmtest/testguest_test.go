package kvmtest

import (
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
)

func TestVsockEchoBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a Go program")
	}
	p := VsockEchoBinary(t)
	if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
		t.Fatalf("vsockecho at %s: %v", p, err)
	}
}

func TestAutoloadBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a Go program")
	}
	p := AutoloadBinary(t)
	if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
		t.Fatalf("autoload at %s: %v", p, err)
	}
}

// TestGuestBinarySources: the folders a guest binary's hash covers are
// every package of this module it uses, so that a change to any of them
// builds it again (a stale agent in the KVM tests otherwise).
func TestGuestBinarySources(t *testing.T) {
	if testing.Short() {
		t.Skip("runs go list")
	}
	root, err := moduleRoot()
	if err != nil {
		t.Fatal(err)
	}
	const module = "github.com/kilnvm/kiln/"
	for _, tc := range []struct {
		pkg  string
		dirs []string
	}{
		{agentPkg, agentSrcDirs},
		{vsockEchoPkg, []string{"internal/testguest/vsockecho"}},
		{autoloadPkg, []string{"internal/testguest/autoload"}},
	} {
		cmd := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", tc.pkg)
		cmd.Dir = root
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps %s: %v", tc.pkg, err)
		}
		for _, p := range strings.Fields(string(out)) {
			if dir, ok := strings.CutPrefix(p, module); ok && !slices.Contains(tc.dirs, dir) {
				t.Errorf("%s uses %s, which its build's hash does not cover", tc.pkg, dir)
			}
		}
	}
}

func TestAgentBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a Go program")
	}
	p := AgentBinary(t)
	if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
		t.Fatalf("kiln-agent at %s: %v", p, err)
	}
}

func TestVMMBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a Go program")
	}
	p := VMMBinary(t)
	if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
		t.Fatalf("kiln-vmm at %s: %v", p, err)
	}
}

func TestKilnBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a Go program")
	}
	p := KilnBinary(t)
	if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
		t.Fatalf("kiln at %s: %v", p, err)
	}
}

func TestShimBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a Go program")
	}
	p := ShimBinary(t)
	if fi, err := os.Stat(p); err != nil || fi.Size() == 0 {
		t.Fatalf("containerd-shim-kiln-v2 at %s: %v", p, err)
	}
}
