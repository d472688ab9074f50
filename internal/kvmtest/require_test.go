package kvmtest

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

// fakeTB records what Require asks of a test.
type fakeTB struct {
	testing.TB
	name        string
	fatal, skip bool
	msg         string
}

func (f *fakeTB) Name() string { return f.name }
func (f *fakeTB) Helper()      {}
func (f *fakeTB) Fatal(args ...any) {
	f.fatal, f.msg = true, fmt.Sprint(args...)
}
func (f *fakeTB) Fatalf(format string, args ...any) {
	f.fatal, f.msg = true, fmt.Sprintf(format, args...)
}
func (f *fakeTB) Skip(args ...any) {
	f.skip, f.msg = true, fmt.Sprint(args...)
}
func (f *fakeTB) Skipf(format string, args ...any) {
	f.skip, f.msg = true, fmt.Sprintf(format, args...)
}

func TestRequire(t *testing.T) {
	ok := func() error { return nil }
	noKVM := func() error { return errors.New("opening /dev/kvm: no such file") }
	tests := []struct {
		name, test, mode string
		usable           func() error
		wantFatal        bool
		wantSkip         bool
		wantMsg          string
	}{
		{name: "usable", test: "TestKVMBoot", usable: ok},
		{name: "usable subtest", test: "TestKVMBoot/one", mode: ModeRequire, usable: ok},
		{name: "bad name", test: "TestBoot", usable: ok, wantFatal: true, wantMsg: "must be named TestKVM"},
		{name: "bad name outside", test: "TestBoot", mode: ModeOutside, usable: ok, wantFatal: true, wantMsg: "TestKVM"},
		{name: "outside", test: "TestKVMBoot", mode: ModeOutside, usable: ok, wantSkip: true, wantMsg: "runs in the KVM harness"},
		{name: "missing skips", test: "TestKVMBoot", usable: noKVM, wantSkip: true, wantMsg: "no such file"},
		{name: "missing required", test: "TestKVMBoot", mode: ModeRequire, usable: noKVM, wantFatal: true, wantMsg: "no such file"},
		{name: "bad mode", test: "TestKVMBoot", mode: "yes", usable: ok, wantFatal: true, wantMsg: `KILN_KVM_TESTS="yes"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeTB{name: tt.test}
			require(f, tt.mode, tt.usable)
			if f.fatal != tt.wantFatal || f.skip != tt.wantSkip {
				t.Fatalf("fatal=%v skip=%v (%q), want fatal=%v skip=%v", f.fatal, f.skip, f.msg, tt.wantFatal, tt.wantSkip)
			}
			if !strings.Contains(f.msg, tt.wantMsg) {
				t.Fatalf("message %q, want it to contain %q", f.msg, tt.wantMsg)
			}
		})
	}
}

func TestUsableMatchesDevice(t *testing.T) {
	err := Usable()
	t.Logf("Usable() = %v", err)
	if _, statErr := os.Stat("/dev/kvm"); statErr != nil && err == nil {
		t.Fatalf("Usable() = nil without /dev/kvm (%v)", statErr)
	}
	cpuinfo, _ := os.ReadFile("/proc/cpuinfo")
	if !hasVirtFlag(string(cpuinfo)) && err == nil {
		t.Fatal("Usable() = nil on a CPU without vmx or svm")
	}
	if err != nil && !strings.Contains(err.Error(), "/dev/kvm") && !strings.Contains(err.Error(), "KVM") {
		t.Fatalf("Usable() error %q names neither /dev/kvm nor KVM", err)
	}
}

func TestBusyboxInitrd(t *testing.T) {
	if _, err := os.Stat("/bin/busybox"); err != nil {
		t.Skip("busybox-static not installed")
	}
	p := BusyboxInitrd(t, "echo hi\n")
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Size() < 1<<20 {
		t.Fatalf("initrd %s is %d bytes, want busybox inside", p, fi.Size())
	}
}

func TestHasVirtFlag(t *testing.T) {
	tests := []struct {
		name, cpuinfo string
		want          bool
	}{
		{"amd", "processor\t: 0\nflags\t\t: fpu vme svm npt\n", true},
		{"intel", "flags\t: fpu vmx ept\nbugs\t: spectre\n", true},
		{"none", "flags\t\t: fpu hypervisor\n", false},
		{"svm in another field", "flags\t: fpu\nmodel name\t: svm vmx\n", false},
		{"substring", "flags\t: svmlock vmxnot\n", false},
		{"empty", "", false},
	}
	for _, tt := range tests {
		if got := hasVirtFlag(tt.cpuinfo); got != tt.want {
			t.Errorf("%s: hasVirtFlag = %v, want %v", tt.name, got, tt.want)
		}
	}
}
