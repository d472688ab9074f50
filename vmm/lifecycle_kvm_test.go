package vmm

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kilnvm/kiln/internal/kvmtest"
)

// TestKVMLifecycleHammer runs Pause, Resume, SaveState, Checkpoint and
// Fork(1) on one two-vCPU guest that counts in rbx (codeCount) from 16
// goroutines in random order, then Close from half of them while the
// others go on. Every operation must succeed or be refused with a
// *StateError; the counts that checkpoints see, one after another, never
// go back; the guest counts on after the hammer; every child of a fork
// runs (counts on) and stops when closed; and Close stops the running
// parent, whose Run returns.
func TestKVMLifecycleHammer(t *testing.T) {
	kvmtest.Require(t)
	const (
		goroutines = 16
		opsEach    = 5
	)
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	vm, err := New(Config{Spec: Spec{Kernel: elfKernel(t, codeCount), CPUs: 2, MemoryMiB: 32}})
	if err != nil {
		t.Fatal(err)
	}
	defer vm.Close()
	ran := make(chan Exit, 1)
	go func() {
		exit, err := vm.Run(ctx)
		if err != nil {
			t.Errorf("Run: %v", err)
		}
		ran <- exit
	}()

	// count returns the guest's count (vCPU 0's rbx; the other vCPU
	// waits for a SIPI) through a checkpoint, and checks that the counts
	// checkpoints see, in their order, never go back.
	var countMu sync.Mutex
	var lastSeen uint64
	count := func(v *VM) (uint64, error) {
		var n uint64
		err := v.Checkpoint(ctx, func(st *State) error {
			if len(st.VCPUs) != 2 {
				return fmt.Errorf("state of %d vCPUs", len(st.VCPUs))
			}
			if s := v.State(); s != StateSaving {
				return fmt.Errorf("checkpoint's function runs in state %v", s)
			}
			n = st.VCPUs[0].Regs.RBX
			if v == vm {
				countMu.Lock()
				defer countMu.Unlock()
				if n < lastSeen {
					return fmt.Errorf("count went back from %d to %d", lastSeen, n)
				}
				lastSeen = n
			}
			return nil
		})
		return n, err
	}
	// progress checks that v counts on.
	progress := func(v *VM, what string) {
		a, err := count(v)
		if err != nil {
			t.Errorf("%s: first count: %v", what, err)
			return
		}
		deadline := time.Now().Add(30 * time.Second)
		for {
			time.Sleep(20 * time.Millisecond)
			b, err := count(v)
			if err != nil {
				t.Errorf("%s: count: %v", what, err)
				return
			}
			if b > a {
				return
			}
			if time.Now().After(deadline) {
				t.Errorf("%s: the count stays at %d", what, a)
				return
			}
		}
	}
	// child runs a forked child, checks that it counts, closes it while it
	// runs and checks that its Run ends.
	var children atomic.Int32
	child := func(c *VM) {
		defer c.Close()
		children.Add(1)
		if s := c.State(); s != StateCreated {
			t.Errorf("a new child is %v", s)
		}
		cran := make(chan Exit, 1)
		go func() {
			exit, err := c.Run(ctx)
			if err != nil {
				t.Errorf("child's Run: %v", err)
			}
			cran <- exit
		}()
		for c.State() == StateCreated && ctx.Err() == nil {
			time.Sleep(time.Millisecond)
		}
		progress(c, "child")
		if err := c.Close(); err != nil {
			t.Errorf("close the child: %v", err)
		}
		select {
		case exit := <-cran:
			if exit.Reason != ReasonCancelled {
				t.Errorf("closed child stopped with %v", exit)
			}
		case <-ctx.Done():
			t.Error("a closed child's Run did not return")
		}
		if s := c.State(); s != StateStopped {
			t.Errorf("a closed child is %v", s)
		}
	}

	var ok, refused sync.Map
	tally := func(m *sync.Map, op string) {
		n, _ := m.LoadOrStore(op, new(atomic.Int32))
		n.(*atomic.Int32).Add(1)
	}
	// do runs op on the parent and checks how it ended.
	do := func(op string) {
		var err error
		switch op {
		case "pause":
			err = vm.Pause(ctx)
		case "resume":
			err = vm.Resume()
		case "save state":
			var st *State
			if st, err = vm.SaveState(ctx); err == nil && len(st.VCPUs) != 2 {
				t.Errorf("SaveState: %d vCPUs", len(st.VCPUs))
			}
		case "checkpoint":
			_, err = count(vm)
		case "fork":
			var kids []*VM
			if kids, err = vm.Fork(ctx, 1, ForkConfig{}); err == nil {
				for _, c := range kids {
					child(c)
				}
			}
		case "close":
			err = vm.Close()
		}
		var se *StateError
		switch {
		case err == nil:
			tally(&ok, op)
		case errors.As(err, &se) && errors.Is(err, ErrState) && se.Op == op:
			tally(&refused, op)
		default:
			t.Errorf("%s: %v", op, err)
		}
	}
	ops := []string{"pause", "resume", "resume", "save state", "checkpoint", "fork"}
	hammer := func(seed uint64, n int, closing bool) {
		var wg sync.WaitGroup
		for g := range goroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := rand.New(rand.NewPCG(seed, uint64(g)))
				for i := range n {
					if closing && g%2 == 0 && i == n/2 {
						do("close")
						continue
					}
					do(ops[r.IntN(len(ops))])
				}
			}()
		}
		wg.Wait()
	}

	start := time.Now()
	for vm.State() == StateCreated {
		time.Sleep(time.Millisecond)
	}
	hammer(1, opsEach, false)
	t.Logf("hammered in %v, %d children", time.Since(start).Round(time.Millisecond), children.Load())
	switch s := vm.State(); s {
	case StatePaused:
		if err := vm.Resume(); err != nil {
			t.Fatalf("Resume after the hammer: %v", err)
		}
	case StateRunning:
	default:
		t.Fatalf("state %v after the hammer", s)
	}
	progress(vm, "parent after the hammer")

	// Close from half the goroutines while the others go on.
	hammer(2, 4, true)
	if s := vm.State(); s != StateStopped {
		t.Errorf("state %v after Close", s)
	}
	select {
	case exit := <-ran:
		if exit.Reason != ReasonCancelled || exit.Message != "VM closed" {
			t.Errorf("closed VM stopped with %v", exit)
		}
	case <-ctx.Done():
		t.Fatal("Run did not return after Close")
	}
	report := func(m *sync.Map) string {
		s := ""
		for _, op := range []string{"pause", "resume", "save state", "checkpoint", "fork", "close"} {
			if n, ok := m.Load(op); ok {
				s += fmt.Sprintf(" %s=%d", op, n.(*atomic.Int32).Load())
			}
		}
		return s
	}
	t.Logf("succeeded:%s; refused:%s; %d children ran; last count %d; took %v",
		report(&ok), report(&refused), children.Load(), lastSeen, time.Since(start).Round(time.Millisecond))
	for _, op := range []string{"pause", "resume", "save state", "checkpoint", "fork", "close"} {
		if _, found := ok.Load(op); !found {
			t.Errorf("no %s succeeded", op)
		}
	}
}
