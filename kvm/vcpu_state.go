package kvm

import (
	"fmt"
)

// What a snapshot needs beyond the ioctls in vcpu.go and vm.go: the MSRs a
// vCPU actually has, its debug registers, and the flags of the structures
// a restore writes back.

// ioctl request numbers for the debug registers (struct kvm_debugregs is
// 128 bytes; abi_state_unsafe_test.go checks both against <linux/kvm.h>).
var (
	reqGetDebugRegs = ior(0xa1, 128)
	reqSetDebugRegs = iow(0xa2, 128)
)

// DebugRegs is struct kvm_debugregs: DR0-DR3, DR6 and DR7.
type DebugRegs struct {
	DB    [4]uint64
	DR6   uint64
	DR7   uint64
	Flags uint64
	_     [9]uint64
}

// ClockData.Flags bits (KVM_CLOCK_*). KVM_GET_CLOCK reports them;
// KVM_SET_CLOCK takes only KVM_CLOCK_REALTIME (and before Linux 5.16 no
// flag at all).
const (
	ClockTSCStable = 1 << 1
	ClockRealtime  = 1 << 2
	ClockHostTSC   = 1 << 3
)

// VCPUEvents.Flags bits (KVM_VCPUEVENT_VALID_*): which optional fields
// KVM_SET_VCPU_EVENTS takes from the structure.
const (
	VCPUEventValidNMIPending = 1 << 0
	VCPUEventValidSIPIVector = 1 << 1
	VCPUEventValidShadow     = 1 << 2
	VCPUEventValidSMM        = 1 << 3
	VCPUEventValidPayload    = 1 << 4
)

// ReadMSRs reads the MSRs named in indices and returns those KVM returned,
// in the order asked, without the ones it refused. (KVM_GET_MSRS stops at
// the first MSR it cannot read, which KVM_GET_MSR_INDEX_LIST may name all
// the same: one that depends on a CPUID feature the guest lacks, say.)
func (v *VCPU) ReadMSRs(indices []uint32) ([]MSREntry, error) {
	return readMSRs(indices, v.getMSRBatch)
}

// getMSRBatch is one KVM_GET_MSRS over entries (at most maxMSRs): it fills
// the Data of the first n and returns n, where KVM stopped.
func (v *VCPU) getMSRBatch(entries []MSREntry) (int, error) {
	m := &msrs{NMSRs: uint32(len(entries))}
	copy(m.Entries[:], entries)
	r, err := ioctlRef(v.fd, reqGetMSRs, m)
	if err != nil {
		return 0, fmt.Errorf("vCPU %d: KVM_GET_MSRS: %w", v.id, err)
	}
	n := min(int(r), len(entries))
	copy(entries[:n], m.Entries[:n])
	return n, nil
}

// readMSRs asks get for batches of MSRs; where get stops short, the MSR it
// stopped at is left out and the rest asked again.
func readMSRs(indices []uint32, get func([]MSREntry) (int, error)) ([]MSREntry, error) {
	out := make([]MSREntry, 0, len(indices))
	for len(indices) > 0 {
		batch := make([]MSREntry, min(len(indices), maxMSRs))
		for i := range batch {
			batch[i].Index = indices[i]
		}
		n, err := get(batch)
		if err != nil {
			return nil, err
		}
		if n < 0 || n > len(batch) {
			return nil, fmt.Errorf("KVM_GET_MSRS: read %d of %d MSRs", n, len(batch))
		}
		out = append(out, batch[:n]...)
		if n < len(batch) {
			n++ // skip the MSR KVM refused
		}
		indices = indices[n:]
	}
	return out, nil
}

// DebugRegs returns the debug registers.
func (v *VCPU) DebugRegs() (DebugRegs, error) {
	var d DebugRegs
	return d, vcpuIoctl(v, reqGetDebugRegs, &d, "KVM_GET_DEBUGREGS")
}

// SetDebugRegs sets the debug registers.
func (v *VCPU) SetDebugRegs(d *DebugRegs) error {
	return vcpuIoctl(v, reqSetDebugRegs, d, "KVM_SET_DEBUGREGS")
}
