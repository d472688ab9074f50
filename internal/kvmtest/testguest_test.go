package kvmtest

import (
	"os"
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
