package vmm

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

func runVM(t *testing.T, cfg Config, timeout time.Duration) (Exit, string) {
	t.Helper()
	var out kvmtest.Console
	cfg.Console = &out
	vm, err := New(cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	defer vm.Close()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	exit, err := vm.Run(ctx)
	if err != nil {
		t.Fatalf("Run: %v (console: %q)", err, out.String())
	}
	return exit, out.String()
}

// TestKVMStopReasons runs tiny 64-bit guests (no Linux) that end in each way a
// guest can end, through the real vCPU loop, serial port and power devices.
func TestKVMStopReasons(t *testing.T) {
	kvmtest.Require(t)
	tests := []struct {
		name    string
		code    []byte
		reason  Reason
		console string
	}{
		{"serial then ACPI power-off", codeHelloPowerOff, ReasonPowerOff, "ok\n"},
		{"triple fault", codeTripleFault, ReasonTripleFault, ""},
		{"i8042 reset", codeI8042Reset, ReasonReboot, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			exit, out := runVM(t, Config{Spec: Spec{Kernel: elfKernel(t, tt.code), CPUs: 1, MemoryMiB: 32}}, time.Minute)
			if exit.Reason != tt.reason {
				t.Errorf("stopped with %v, want %v", exit, tt.reason)
			}
			if out != tt.console {
				t.Errorf("console %q, want %q", out, tt.console)
			}
		})
	}
}

// TestKVMCancelPauseResume checks that cancelling Run's context stops a guest
// that never stops by itself, and that Pause parks every vCPU (its registers
// stop changing) until Resume.
func TestKVMCancelPauseResume(t *testing.T) {
	kvmtest.Require(t)
	vm, err := New(Config{Spec: Spec{Kernel: elfKernel(t, codeCount), CPUs: 2, MemoryMiB: 32}})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	result := make(chan Exit, 1)
	go func() {
		exit, err := vm.Run(ctx)
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		result <- exit
	}()
	// Let the guest count a while, then pause.
	time.Sleep(200 * time.Millisecond)
	pctx, pcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer pcancel()
	if err := vm.Pause(pctx); err != nil {
		t.Fatalf("Pause: %v", err)
	}
	r1, err := vm.vcpus[0].kv.Regs()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond)
	r2, err := vm.vcpus[0].kv.Regs()
	if err != nil {
		t.Fatal(err)
	}
	if r1.RBX == 0 || r1.RBX != r2.RBX {
		t.Errorf("paused guest's counter moved from %d to %d (or never ran)", r1.RBX, r2.RBX)
	}
	if err := vm.Resume(); err != nil {
		t.Fatalf("Resume: %v", err)
	}
	time.Sleep(100 * time.Millisecond)
	if err := vm.Pause(pctx); err != nil {
		t.Fatalf("second Pause: %v", err)
	}
	r3, _ := vm.vcpus[0].kv.Regs()
	if r3.RBX <= r2.RBX {
		t.Errorf("resumed guest's counter did not advance: %d then %d", r2.RBX, r3.RBX)
	}
	vm.Resume()
	cancel()
	expectCancelled(t, result)
}

// expectCancelled waits up to 30 s for Run's exit on result, after its
// context was cancelled, and checks that the VM stopped for that.
func expectCancelled(t *testing.T, result <-chan Exit) {
	t.Helper()
	select {
	case exit := <-result:
		if exit.Reason != ReasonCancelled {
			t.Errorf("stopped with %v, want cancelled", exit)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
}

// TestKVMBootLinuxPVH boots Debian's kernel as an ELF vmlinux through its PVH
// entry, pauses and resumes it while it boots, and checks that userspace runs
// and powers off. (kiln boot's tests boot the bzImage on two vCPUs;
// TestKVMCancelPauseResume pauses two vCPUs.)
func TestKVMBootLinuxPVH(t *testing.T) {
	kvmtest.Require(t)
	k := kvmtest.Kernel(t)
	if k.Vmlinux == "" {
		t.Fatal("the kernel cache has no vmlinux (make kernel extracts it)")
	}
	initrd := kvmtest.BusyboxInitrd(t, `
mount -t proc proc /proc
mount -t sysfs sys /sys
echo "KILN-MARKER cpus=$(grep -c ^processor /proc/cpuinfo) online=$(cat /sys/devices/system/cpu/online)"
poweroff -f
`)
	var out kvmtest.Console
	vm, err := New(Config{Spec: Spec{Kernel: k.Vmlinux, Initrd: initrd, CPUs: 1, MemoryMiB: 512}, Console: &out})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	result := make(chan Exit, 1)
	go func() {
		exit, err := vm.Run(ctx)
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		result <- exit
	}()
	// Pause once the kernel has started printing, then let it go on.
	for out.String() == "" && ctx.Err() == nil {
		time.Sleep(10 * time.Millisecond)
	}
	if err := vm.Pause(ctx); err != nil {
		t.Fatalf("Pause while booting: %v", err)
	}
	before := out.String()
	time.Sleep(200 * time.Millisecond)
	if after := out.String(); after != before {
		t.Errorf("console grew while paused: %q", after[len(before):])
	}
	if err := vm.Resume(); err != nil {
		t.Fatal(err)
	}
	exit := <-result
	if exit.Reason != ReasonPowerOff {
		t.Fatalf("stopped with %v; console:\n%s", exit, out.String())
	}
	if !strings.Contains(out.String(), "KILN-MARKER cpus=1 online=0") {
		t.Fatalf("no marker in the console:\n%s", out.String())
	}
}
