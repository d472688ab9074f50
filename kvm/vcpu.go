package kvm

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// VCPU is a KVM virtual CPU and its mapped kvm_run page. Its methods must be
// called from one goroutine at a time; KVM_RUN should always come from the
// same locked OS thread.
type VCPU struct {
	id  int
	fd  int
	run []byte
	// holdP: Run enters the guest by a raw system call (SetHoldP).
	holdP bool
	// yieldP: the last entry was held and a signal ended it; the next
	// blocks (Run).
	yieldP bool
}

// SetHoldP chooses how Run enters the guest. Held, KVM_RUN is a raw system
// call: the calling goroutine keeps its P (its slot in Go's scheduler)
// while the guest runs, so the runtime sees a running goroutine instead of
// a blocking system call, and its monitor thread (sysmon) neither polls
// every 20 µs to take the P back nor hands the P to another thread. The
// runtime still preempts the goroutine every 10 ms with a signal, which
// makes KVM_RUN return (an ExitIntr), and a stop-the-world garbage
// collection interrupts the guest the same way. The cost: the vCPU
// occupies a P for as long as it runs, so GOMAXPROCS must count it.
// A held entry that a signal ends is followed by one that blocks, until
// the guest next exits on its own: a guest idle in its halt is left alone
// rather than preempted every 10 ms. Not held (the default), KVM_RUN is
// an ordinary blocking system call.
func (v *VCPU) SetHoldP(on bool) { v.holdP = on }

// nextHeld reports whether the next entry is held.
func (v *VCPU) nextHeld() bool { return v.holdP && !v.yieldP }

// afterEntry notes how an entry ended. A held entry that a signal ended
// (the runtime's preemption after 10 ms in the guest, or a kick) most
// likely found the guest idle in its halt: the next entry blocks, giving
// the P back, until the guest exits on its own, so an idle vCPU is not
// woken 100 times a second.
func (v *VCPU) afterEntry(held bool, err error) {
	v.yieldP = held && errors.Is(err, unix.EINTR)
}

// ID returns the vCPU index (its APIC ID).
func (v *VCPU) ID() int { return v.id }

// FD returns the vCPU's file descriptor.
func (v *VCPU) FD() int { return v.fd }

// Close unmaps the run page and closes the vCPU.
func (v *VCPU) Close() error {
	if v.run != nil {
		unix.Munmap(v.run)
		v.run = nil
	}
	return unix.Close(v.fd)
}

// vcpuIoctl issues the vCPU ioctl req (named what in errors) on *p.
func vcpuIoctl[T any](v *VCPU, req uintptr, p *T, what string) error {
	if _, err := ioctlRef(v.fd, req, p); err != nil {
		return fmt.Errorf("vCPU %d: %s: %w", v.id, what, err)
	}
	return nil
}

// Regs returns the general-purpose registers.
func (v *VCPU) Regs() (Regs, error) {
	var r Regs
	return r, vcpuIoctl(v, reqGetRegs, &r, "KVM_GET_REGS")
}

// SetRegs sets the general-purpose registers.
func (v *VCPU) SetRegs(r *Regs) error { return vcpuIoctl(v, reqSetRegs, r, "KVM_SET_REGS") }

// Sregs returns the segment and control registers.
func (v *VCPU) Sregs() (Sregs, error) {
	var s Sregs
	return s, vcpuIoctl(v, reqGetSregs, &s, "KVM_GET_SREGS")
}

// SetSregs sets the segment and control registers.
func (v *VCPU) SetSregs(s *Sregs) error {
	return vcpuIoctl(v, reqSetSregs, s, "KVM_SET_SREGS")
}

// FPU returns the x87/SSE state.
func (v *VCPU) FPU() (FPU, error) {
	var f FPU
	return f, vcpuIoctl(v, reqGetFPU, &f, "KVM_GET_FPU")
}

// SetFPU sets the x87/SSE state.
func (v *VCPU) SetFPU(f *FPU) error { return vcpuIoctl(v, reqSetFPU, f, "KVM_SET_FPU") }

// XSave returns the XSAVE area. size is KVM_CHECK_EXTENSION(KVM_CAP_XSAVE2)
// on the VM when it is larger than 4096 (AMX hosts), else 0 or 4096.
func (v *VCPU) XSave(size int) ([]byte, error) {
	if size <= 4096 {
		var x XSave
		if err := vcpuIoctl(v, reqGetXSave, &x, "KVM_GET_XSAVE"); err != nil {
			return nil, err
		}
		return append([]byte(nil), wordBytes(x.Region[:])...), nil
	}
	buf := make([]uint32, (size+3)/4)
	if err := vcpuIoctl(v, reqGetXSave2, &buf[0], "KVM_GET_XSAVE2"); err != nil {
		return nil, err
	}
	return append([]byte(nil), wordBytes(buf)[:size]...), nil
}

// SetXSave sets the XSAVE area from a buffer XSave returned (at least 4096 bytes).
func (v *VCPU) SetXSave(b []byte) error {
	if len(b) < 4096 {
		return fmt.Errorf("vCPU %d: KVM_SET_XSAVE: area of %d bytes, need at least 4096", v.id, len(b))
	}
	buf := make([]uint32, (len(b)+3)/4)
	copy(wordBytes(buf), b)
	return vcpuIoctl(v, reqSetXSave, &buf[0], "KVM_SET_XSAVE")
}

// XCRs returns the extended control registers.
func (v *VCPU) XCRs() (XCRs, error) {
	var x XCRs
	return x, vcpuIoctl(v, reqGetXCRs, &x, "KVM_GET_XCRS")
}

// SetXCRs sets the extended control registers.
func (v *VCPU) SetXCRs(x *XCRs) error { return vcpuIoctl(v, reqSetXCRs, x, "KVM_SET_XCRS") }

// MSRs reads the MSRs named by entries[i].Index into entries[i].Data.
func (v *VCPU) MSRs(entries []MSREntry) error {
	for len(entries) > 0 {
		n := min(len(entries), maxMSRs)
		m := &msrs{NMSRs: uint32(n)}
		copy(m.Entries[:], entries[:n])
		r, err := ioctlRef(v.fd, reqGetMSRs, m)
		if err != nil {
			return fmt.Errorf("vCPU %d: KVM_GET_MSRS: %w", v.id, err)
		}
		if int(r) != n {
			return fmt.Errorf("vCPU %d: KVM_GET_MSRS: read %d of %d MSRs, stopped at %#x", v.id, r, n, entries[r].Index)
		}
		copy(entries[:n], m.Entries[:n])
		entries = entries[n:]
	}
	return nil
}

// SetMSRs writes MSRs.
func (v *VCPU) SetMSRs(entries []MSREntry) error {
	for len(entries) > 0 {
		n := min(len(entries), maxMSRs)
		m := &msrs{NMSRs: uint32(n)}
		copy(m.Entries[:], entries[:n])
		r, err := ioctlRef(v.fd, reqSetMSRs, m)
		if err != nil {
			return fmt.Errorf("vCPU %d: KVM_SET_MSRS: %w", v.id, err)
		}
		if int(r) != n {
			return fmt.Errorf("vCPU %d: KVM_SET_MSRS: wrote %d of %d MSRs, refused %#x", v.id, r, n, entries[r].Index)
		}
		entries = entries[n:]
	}
	return nil
}

// LAPIC returns the local APIC's register page.
func (v *VCPU) LAPIC() (LAPICState, error) {
	var l LAPICState
	return l, vcpuIoctl(v, reqGetLAPIC, &l, "KVM_GET_LAPIC")
}

// SetLAPIC sets the local APIC's register page.
func (v *VCPU) SetLAPIC(l *LAPICState) error {
	return vcpuIoctl(v, reqSetLAPIC, l, "KVM_SET_LAPIC")
}

// VCPUEvents returns pending exceptions, interrupts and NMIs.
func (v *VCPU) VCPUEvents() (VCPUEvents, error) {
	var e VCPUEvents
	return e, vcpuIoctl(v, reqGetVCPUEvents, &e, "KVM_GET_VCPU_EVENTS")
}

// SetVCPUEvents sets pending exceptions, interrupts and NMIs.
func (v *VCPU) SetVCPUEvents(e *VCPUEvents) error {
	return vcpuIoctl(v, reqSetVCPUEvents, e, "KVM_SET_VCPU_EVENTS")
}

// MPState returns the multiprocessing state.
func (v *VCPU) MPState() (MPState, error) {
	var s MPState
	return s, vcpuIoctl(v, reqGetMPState, &s, "KVM_GET_MP_STATE")
}

// SetMPState sets the multiprocessing state.
func (v *VCPU) SetMPState(s *MPState) error {
	return vcpuIoctl(v, reqSetMPState, s, "KVM_SET_MP_STATE")
}

// SetCPUID sets the CPUID leaves the guest sees.
func (v *VCPU) SetCPUID(entries []CPUIDEntry) error {
	if len(entries) > maxCPUIDEntries {
		return fmt.Errorf("vCPU %d: KVM_SET_CPUID2: %d entries, at most %d", v.id, len(entries), maxCPUIDEntries)
	}
	c := &cpuid2{Nent: uint32(len(entries))}
	copy(c.Entries[:], entries)
	return vcpuIoctl(v, reqSetCPUID2, c, "KVM_SET_CPUID2")
}

// CPUID returns the CPUID leaves set on the vCPU.
func (v *VCPU) CPUID() ([]CPUIDEntry, error) {
	c := &cpuid2{Nent: maxCPUIDEntries}
	if err := vcpuIoctl(v, reqGetCPUID2, c, "KVM_GET_CPUID2"); err != nil {
		return nil, err
	}
	return append([]CPUIDEntry(nil), c.Entries[:min(c.Nent, maxCPUIDEntries)]...), nil
}

// TSCKHz returns the vCPU's TSC frequency in kHz.
func (v *VCPU) TSCKHz() (uint32, error) {
	r, err := ioctl(v.fd, reqGetTSCKHz, 0)
	if err != nil {
		return 0, fmt.Errorf("vCPU %d: KVM_GET_TSC_KHZ: %w", v.id, err)
	}
	return uint32(r), nil
}

// SetTSCKHz sets the vCPU's TSC frequency in kHz (restore onto another host).
func (v *VCPU) SetTSCKHz(khz uint32) error {
	if _, err := ioctl(v.fd, reqSetTSCKHz, uintptr(khz)); err != nil {
		return fmt.Errorf("vCPU %d: KVM_SET_TSC_KHZ %d: %w", v.id, khz, err)
	}
	return nil
}

// KVMClockCtrl tells the guest's kvmclock it was paused (avoids soft-lockup
// warnings after a long pause). EINVAL when the guest does not use kvmclock.
func (v *VCPU) KVMClockCtrl() error {
	if _, err := ioctl(v.fd, reqKVMClockCtrl, 0); err != nil {
		return fmt.Errorf("vCPU %d: KVM_KVMCLOCK_CTRL: %w", v.id, err)
	}
	return nil
}
