package vmm

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/seccomp"
)

// vcpu runs one KVM vCPU on its own locked OS thread.
type vcpu struct {
	vm  *VM
	kv  *kvm.VCPU
	tid atomic.Int32 // OS thread id while the loop runs, else 0
	// exits counts KVM_RUN returns, for a diagnosis: a count that stops
	// moving means the vCPU is halted or spinning inside the guest.
	exits atomic.Uint64
}

// kick forces the vCPU out of KVM_RUN: immediate_exit makes the next entry
// return at once, and a signal interrupts an entry already under way. SIGURG
// is the signal the Go runtime itself uses for preemption, so its handler
// ignores one it did not send.
func (c *vcpu) kick() {
	c.kv.SetImmediateExit(true)
	if tid := c.tid.Load(); tid != 0 {
		unix.Tgkill(unix.Getpid(), int(tid), unix.SIGURG)
	}
}

// loop runs the vCPU until the VM stops.
func (c *vcpu) loop() {
	runtime.LockOSThread()
	v := c.vm
	if v.cfg.VCPUSeccomp == seccomp.Off {
		defer runtime.UnlockOSThread()
	} else {
		// Never unlocked, whether or not the filter went on: the thread
		// ends with this goroutine (Config.VCPUSeccomp).
		c.confine()
	}
	c.tid.Store(int32(unix.Gettid()))
	defer c.tid.Store(0)
	c.kv.SetHoldP(v.cfg.HoldProcs)
	for {
		if !c.checkpoint() {
			return
		}
		reason, err := c.kv.Run()
		c.exits.Add(1)
		if err != nil {
			v.stop(ReasonError, fmt.Sprintf("vCPU %d: KVM_RUN: %v", c.kv.ID(), err))
			return
		}
		if !c.handleExit(reason) {
			return
		}
	}
}

// confine loads the VMM's seccomp filter on this vCPU's thread
// (Config.VCPUSeccomp), or says why it runs without.
func (c *vcpu) confine() {
	v := c.vm
	p := seccomp.VMM()
	p.Mode = v.cfg.VCPUSeccomp
	if err := p.InstallThread(); err != nil {
		v.log.Warn("vCPU thread runs without its seccomp filter", "vcpu", c.kv.ID(), "err", err)
		return
	}
	v.log.Debug("vCPU thread filtered", "vcpu", c.kv.ID(), "mode", p.Mode.String())
}

// parkVCPUs asks every vCPU to park at its next exit, kicks them out of
// the guest, and waits until all are parked, the VM stops or ctx ends:
// the lifecycle's park hook (it holds the turn; on an error it calls
// unparkVCPUs).
func (v *VM) parkVCPUs(ctx context.Context) error {
	v.mu.Lock()
	if v.stopping {
		v.mu.Unlock()
		return errors.New("the VM stopped")
	}
	v.paused = true
	v.kickAll()
	v.mu.Unlock()

	stopWait := context.AfterFunc(ctx, func() {
		v.mu.Lock()
		v.cond.Broadcast()
		v.mu.Unlock()
	})
	defer stopWait()
	v.mu.Lock()
	defer v.mu.Unlock()
	for v.parked < len(v.vcpus) && !v.stopping {
		if ctx.Err() != nil {
			return fmt.Errorf("%d of %d vCPUs parked: %w", v.parked, len(v.vcpus), context.Cause(ctx))
		}
		v.cond.Wait()
	}
	if v.stopping {
		return errors.New("the VM stopped")
	}
	return nil
}

// unparkVCPUs lets parked vCPUs (and those on their way to park) run
// again, and resumes the virtio transports a state save paused: the
// lifecycle's unpark hook.
func (v *VM) unparkVCPUs() {
	v.mu.Lock()
	v.paused = false
	for _, c := range v.vcpus {
		c.kv.SetImmediateExit(false)
	}
	v.cond.Broadcast()
	devices := v.devicesPaused
	v.devicesPaused = false
	v.mu.Unlock()
	if devices {
		v.resumeDevices()
	}
}

// checkpoint parks the vCPU while the VM is paused and reports whether it
// should keep running.
func (c *vcpu) checkpoint() bool {
	v := c.vm
	v.mu.Lock()
	pausing := v.paused && !v.stopping
	if !pausing {
		// The common case, on every exit: one lock and back to the guest.
		stopping := v.stopping
		v.mu.Unlock()
		return !stopping
	}
	v.mu.Unlock()
	if !c.completeExit() {
		return false
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.paused && !v.stopping {
		v.parked++
		v.cond.Broadcast()
		for v.paused && !v.stopping {
			v.cond.Wait()
		}
		v.parked--
	}
	if !v.paused && !v.stopping {
		// Resumed before it parked: completeExit's immediate_exit must
		// not outlive the pause.
		c.kv.SetImmediateExit(false)
	}
	return !v.stopping
}

// completeExit finishes the instruction of the exit just handled before the
// vCPU parks. KVM completes an I/O or MMIO instruction only on the next
// KVM_RUN (Documentation/virt/kvm/api.rst, KVM_RUN): entering with
// immediate_exit set completes it and returns without running guest code,
// so that the registers a snapshot reads are whole, and a restored guest
// does not repeat the access. A completion may exit again (the next part of
// a string I/O); those exits are handled too. False means the vCPU must
// stop.
func (c *vcpu) completeExit() bool {
	c.kv.SetImmediateExit(true)
	for {
		reason, err := c.kv.Run()
		if err != nil {
			c.vm.stop(ReasonError, fmt.Sprintf("vCPU %d: KVM_RUN: %v", c.kv.ID(), err))
			return false
		}
		if reason == kvm.ExitIntr {
			return true
		}
		if !c.handleExit(reason) {
			return false
		}
	}
}

// handleExit services one exit; false means the vCPU must stop.
func (c *vcpu) handleExit(reason kvm.ExitReason) bool {
	v := c.vm
	switch reason {
	case kvm.ExitIO:
		port, size, out, data, ok := c.kv.IO()
		if !ok {
			v.stop(ReasonError, fmt.Sprintf("vCPU %d: malformed I/O exit", c.kv.ID()))
			return false
		}
		for i := 0; i+size <= len(data); i += size {
			if out {
				v.pio.Write(uint64(port), data[i:i+size])
			} else {
				v.pio.Read(uint64(port), data[i:i+size])
			}
		}
	case kvm.ExitMMIO:
		addr, data, write := c.kv.MMIO()
		if write {
			v.mmio.Write(addr, data)
		} else {
			v.mmio.Read(addr, data)
		}
	case kvm.ExitIntr:
		// Kicked (pause or stop) or a stray signal: checkpoint decides.
	case kvm.ExitHLT:
		v.stop(ReasonPowerOff, "guest halted")
		return false
	case kvm.ExitShutdown:
		v.stop(ReasonTripleFault, fmt.Sprintf("vCPU %d: triple fault (KVM_EXIT_SHUTDOWN)", c.kv.ID()))
		return false
	case kvm.ExitSystemEvent:
		typ, _ := c.kv.SystemEvent()
		switch typ {
		case kvm.SystemEventShutdown:
			v.stop(ReasonPowerOff, "guest powered off")
		case kvm.SystemEventReset:
			v.stop(ReasonReboot, "guest rebooted")
		case kvm.SystemEventCrash:
			v.stop(ReasonPanic, "guest crashed")
		default:
			v.stop(ReasonError, fmt.Sprintf("vCPU %d: system event %d", c.kv.ID(), typ))
		}
		return false
	case kvm.ExitFailEntry:
		hw, cpu := c.kv.FailEntry()
		v.stop(ReasonError, fmt.Sprintf("vCPU %d: entry failed, hardware reason %#x on CPU %d", c.kv.ID(), hw, cpu))
		return false
	case kvm.ExitInternalError:
		sub, data := c.kv.InternalError()
		v.stop(ReasonError, fmt.Sprintf("vCPU %d: KVM internal error %d %x", c.kv.ID(), sub, data))
		return false
	default:
		v.stop(ReasonError, fmt.Sprintf("vCPU %d: unhandled exit %v", c.kv.ID(), reason))
		return false
	}
	return true
}
