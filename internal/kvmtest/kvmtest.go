// Package kvmtest gives tests that need a real /dev/kvm one way to ask for
// it, so that tools/kvmharness can run them on every machine: directly where
// the host has KVM, and inside an emulated L1 VM where it has not.
//
// A KVM test is named TestKVM... and starts with kvmtest.Require(t). The
// environment variable KILN_KVM_TESTS decides what happens without KVM:
//
//	(unset)  skip, with the reason
//	require  fail, with the reason (the harness sets this where KVM must work)
//	outside  skip at once: the harness runs KVM tests separately, in L1
package kvmtest

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/initramfs"
)

// EnvVar is the environment variable that tells KVM tests how to behave.
const EnvVar = "KILN_KVM_TESTS"

// Values of EnvVar.
const (
	ModeRequire = "require"
	ModeOutside = "outside"
)

// NamePrefix starts the name of every test that calls Require.
const NamePrefix = "TestKVM"

const (
	// kvmAPIVersion is the only KVM_GET_API_VERSION answer Linux has ever given.
	kvmAPIVersion = 12
	// kvmGetAPIVersion is _IO(KVMIO, 0x00).
	kvmGetAPIVersion = 0xAE00
)

// Require makes t a KVM test: it must be named TestKVM... (the harness counts
// KVM tests by that prefix), and it is skipped or failed, as EnvVar says,
// when /dev/kvm is not usable.
func Require(t testing.TB) {
	t.Helper()
	require(t, os.Getenv(EnvVar), Usable)
}

func require(t testing.TB, mode string, usable func() error) {
	t.Helper()
	top, _, _ := strings.Cut(t.Name(), "/")
	if !strings.HasPrefix(top, NamePrefix) {
		t.Fatalf("kvmtest.Require called from %s: KVM tests must be named %s... so the harness counts them", t.Name(), NamePrefix)
		return
	}
	switch mode {
	case "", ModeRequire:
	case ModeOutside:
		t.Skip("runs in the KVM harness")
		return
	default:
		t.Fatalf("%s=%q: want %q, %q or unset", EnvVar, mode, ModeRequire, ModeOutside)
		return
	}
	if err := usable(); err != nil {
		if mode == ModeRequire {
			t.Fatalf("KVM required (%s=%s) but not usable: %v", EnvVar, mode, err)
			return
		}
		t.Skipf("KVM not usable: %v", err)
	}
}

// Usable reports why /dev/kvm cannot be used, or nil when it can: it opens
// it read-write, checks KVM_GET_API_VERSION, and checks that the CPU has
// hardware virtualization (vmx or svm). Without it /dev/kvm is a
// paravirtual implementation such as kvm_pvm, which runs only guest kernels
// built for it: a stock kernel does not boot there.
func Usable() error {
	fd, err := unix.Open("/dev/kvm", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening /dev/kvm: %w", err)
	}
	defer unix.Close(fd)
	v, err := unix.IoctlRetInt(fd, kvmGetAPIVersion)
	if err != nil {
		return fmt.Errorf("KVM_GET_API_VERSION: %w", err)
	}
	if v != kvmAPIVersion {
		return fmt.Errorf("KVM API version %d, want %d", v, kvmAPIVersion)
	}
	cpuinfo, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return fmt.Errorf("checking for hardware virtualization: %w", err)
	}
	if !hasVirtFlag(string(cpuinfo)) {
		reason := "the CPU has no vmx or svm flag"
		if _, err := os.Stat("/sys/module/kvm_pvm"); err == nil {
			reason += "; /dev/kvm is kvm_pvm"
		}
		return fmt.Errorf("/dev/kvm cannot boot stock guest kernels: %s", reason)
	}
	return nil
}

// hasVirtFlag reports whether a /proc/cpuinfo "flags" line lists vmx or svm.
func hasVirtFlag(cpuinfo string) bool {
	for _, line := range strings.Split(cpuinfo, "\n") {
		key, value, ok := strings.Cut(line, ":")
		if !ok || strings.TrimSpace(key) != "flags" {
			continue
		}
		for _, f := range strings.Fields(value) {
			if f == "vmx" || f == "svm" {
				return true
			}
		}
	}
	return false
}

// Kernel returns the cached guest kernel, failing the test when `make
// kernel` has not been run.
func Kernel(t testing.TB) *guestkernel.Kernel {
	t.Helper()
	k, err := guestkernel.Find()
	if errors.Is(err, guestkernel.ErrNotCached) {
		t.Fatalf("no guest kernel: %v (run make kernel)", err)
	}
	if err != nil {
		t.Fatalf("guest kernel: %v", err)
	}
	return k
}

// BusyboxInitrd writes an uncompressed initramfs that runs script under
// busybox (see initramfs.BusyboxInit) into t.TempDir and returns its path.
func BusyboxInitrd(t testing.TB, script string) string {
	t.Helper()
	b, err := initramfs.BusyboxInit(script)
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "initrd.cpio")
	if err := b.WriteFile(p, false); err != nil {
		t.Fatal(err)
	}
	return p
}
