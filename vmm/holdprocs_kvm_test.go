package vmm

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

// codeHaltForever halts with interrupts off: nothing but a signal brings
// its vCPU out of KVM_RUN.
var codeHaltForever = []byte{
	0xfa,       // cli
	0xf4,       // hlt
	0xeb, 0xfd, // jmp back to hlt
}

// TestKVMHoldProcs runs a guest halted for good with its vCPU holding its
// P and with it released, and checks what holding changes and what it must
// not: held, the runtime still preempts the vCPU (KVM_RUN returns to Go
// code), after which the idle vCPU blocks instead of being preempted
// again and again; a garbage collection's stop-the-world does not wait on
// the guest; and pause, resume and cancel work as they do released.
func TestKVMHoldProcs(t *testing.T) {
	kvmtest.Require(t)
	for _, hold := range []bool{true, false} {
		t.Run(map[bool]string{true: "held", false: "released"}[hold], func(t *testing.T) {
			defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
			if hold {
				runtime.GOMAXPROCS(ProcsFor(1))
			}
			vm, err := New(Config{Spec: Spec{Kernel: elfKernel(t, codeHaltForever), CPUs: 1, MemoryMiB: 32}, HoldProcs: hold})
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
			c := vm.vcpus[0]
			// The guest halts at once, with interrupts off: it never
			// leaves KVM_RUN on its own.
			deadline := time.Now().Add(time.Minute)
			for c.tid.Load() == 0 && time.Now().Before(deadline) {
				time.Sleep(10 * time.Millisecond)
			}
			if hold {
				// Held, the runtime preempts a goroutine that runs
				// 10 ms on end: its signal makes KVM_RUN return.
				for c.exits.Load() == 0 && time.Now().Before(deadline) {
					time.Sleep(10 * time.Millisecond)
				}
				if c.exits.Load() == 0 {
					t.Fatal("held vCPU never returned from KVM_RUN in a minute: the runtime did not preempt it")
				}
			}
			// Preempted once, a held vCPU's next entry blocks until the
			// guest exits on its own: a halted guest is left alone, not
			// woken every 10 ms (about 100 exits a second). Released,
			// nothing brings it out.
			time.Sleep(300 * time.Millisecond)
			quiet := c.exits.Load()
			if !hold && quiet != 0 {
				t.Errorf("released, the halted guest's vCPU left KVM_RUN %d times", quiet)
			}
			time.Sleep(time.Second)
			if n := c.exits.Load() - quiet; n > 5 {
				t.Errorf("the halted guest's vCPU left KVM_RUN %d times in a second", n)
			}
			gcDone := make(chan struct{})
			go func() { runtime.GC(); close(gcDone) }()
			select {
			case <-gcDone:
			case <-time.After(30 * time.Second):
				t.Fatal("a garbage collection waited 30 s on the halted guest")
			}
			pctx, pcancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer pcancel()
			if err := vm.Pause(pctx); err != nil {
				t.Fatalf("Pause: %v", err)
			}
			if err := vm.Resume(); err != nil {
				t.Fatalf("Resume: %v", err)
			}
			cancel()
			expectCancelled(t, result)
		})
	}
}

func TestProcsFor(t *testing.T) {
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(0))
	for _, c := range []struct{ base, cpus, want int }{
		{1, 1, 2}, {1, 8, 9}, {2, 1, 3}, {16, 1, 1 + DeviceProcs}, {64, 8, 8 + DeviceProcs},
	} {
		runtime.GOMAXPROCS(c.base)
		if got := ProcsFor(c.cpus); got != c.want {
			t.Errorf("ProcsFor(%d) = %d with GOMAXPROCS %d, want %d", c.cpus, got, c.base, c.want)
		}
	}
}
