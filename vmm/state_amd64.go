package vmm

import (
	"fmt"
	"slices"

	"github.com/kilnvm/kiln/kvm"
)

// VCPUState is one x86-64 vCPU in a snapshot, each part as its KVM ioctl
// reads it.
type VCPUState struct {
	ID int `json:"id"`
	// TSCKHz is the TSC frequency the guest saw (0: unknown). A restore
	// onto a host whose TSC runs otherwise scales the guest's.
	TSCKHz uint32 `json:"tsc_khz"`
	// CPUID is what the guest saw; a restore sets the CPUID that New
	// computes on the restoring host and warns where the two differ.
	CPUID     []kvm.CPUIDEntry `json:"cpuid"`
	MPState   uint32           `json:"mp_state"`
	Regs      kvm.Regs         `json:"regs"`
	Sregs     kvm.Sregs        `json:"sregs"`
	XSave     []byte           `json:"xsave"` // KVM_GET_XSAVE(2): 4096 bytes or more
	XCRs      kvm.XCRs         `json:"xcrs"`
	DebugRegs kvm.DebugRegs    `json:"debug_regs"`
	LAPIC     []byte           `json:"lapic"` // struct kvm_lapic_state: 1024 bytes
	// MSRs are those of KVM_GET_MSR_INDEX_LIST (and the MTRRs) that
	// KVM_GET_MSRS returned, TSC and kvmclock's among them.
	MSRs   []MSR          `json:"msrs"`
	Events kvm.VCPUEvents `json:"events"`
}

// MSR is one model-specific register's value.
type MSR struct {
	Index uint32 `json:"index"`
	Data  uint64 `json:"data"`
}

// MSRs a restore orders: the TSC before every other (the TSC deadline and
// kvmclock are read against it), the TSC deadline after the LAPIC and the
// TSC (KVM arms the LAPIC timer from it only in TSC-deadline mode).
const (
	msrTSCDeadline = 0x6e0
	msrMTRRPhys0   = 0x200 // eight base/mask pairs
	msrMTRRFix64K  = 0x250
	msrMTRRFix16K0 = 0x258
	msrMTRRFix16K1 = 0x259
	msrMTRRFix4K0  = 0x268 // eight of them
)

// extraStateMSRs are saved beside KVM_GET_MSR_INDEX_LIST, which leaves out
// the MTRRs: the boot setup enables them (MTRRdefType), and a guest that
// lost them would run with caching off.
func extraStateMSRs() []uint32 {
	msrs := []uint32{msrMTRRDefType, msrMTRRFix64K, msrMTRRFix16K0, msrMTRRFix16K1}
	for i := uint32(0); i < 8; i++ {
		msrs = append(msrs, msrMTRRFix4K0+i)
	}
	for i := uint32(0); i < 16; i++ {
		msrs = append(msrs, msrMTRRPhys0+i)
	}
	return msrs
}

// stateMSRs returns the MSRs to save: KVM's list and the extra ones, once
// each.
func (v *VM) stateMSRs() ([]uint32, error) {
	list, err := v.sys.MSRIndexList()
	if err != nil {
		return nil, err
	}
	seen := make(map[uint32]bool, len(list))
	var out []uint32
	for _, i := range append(list, extraStateMSRs()...) {
		if !seen[i] {
			seen[i] = true
			out = append(out, i)
		}
	}
	return out, nil
}

// xsaveSize returns the XSAVE area's size on this host: KVM_CAP_XSAVE2's
// answer where KVM has it (larger than 4096 with AMX), else 4096.
func (v *VM) xsaveSize() int {
	return max(v.vm.CheckExtension(kvm.CapXSave2), xsaveMinSize)
}

// saveVCPU reads a vCPU's state. The order is Firecracker's and QEMU's:
// KVM_GET_MP_STATE first (it may let the LAPIC accept pending INIT/SIPI,
// which changes the rest), KVM_GET_VCPU_EVENTS last.
func (v *VM) saveVCPU(c *kvm.VCPU, msrs []uint32, xsaveSize int) (VCPUState, error) {
	s := VCPUState{ID: c.ID()}
	mp, err := c.MPState()
	if err != nil {
		return s, err
	}
	s.MPState = mp.State
	if s.Regs, err = c.Regs(); err != nil {
		return s, err
	}
	if s.Sregs, err = c.Sregs(); err != nil {
		return s, err
	}
	if s.XSave, err = c.XSave(xsaveSize); err != nil {
		return s, err
	}
	if s.XCRs, err = c.XCRs(); err != nil {
		return s, err
	}
	if s.DebugRegs, err = c.DebugRegs(); err != nil {
		return s, err
	}
	lapic, err := c.LAPIC()
	if err != nil {
		return s, err
	}
	s.LAPIC = append([]byte(nil), lapic.Regs[:]...)
	if s.TSCKHz, err = c.TSCKHz(); err != nil {
		v.log.Warn("TSC frequency unknown: a restore cannot scale the guest's TSC", "vcpu", c.ID(), "err", err)
		s.TSCKHz = 0
	}
	cpuid, err := c.CPUID()
	if err != nil {
		return s, err
	}
	s.CPUID = trimCPUID(cpuid)
	entries, err := c.ReadMSRs(msrs)
	if err != nil {
		return s, err
	}
	for _, e := range entries {
		s.MSRs = append(s.MSRs, MSR{Index: e.Index, Data: e.Data})
	}
	if s.Events, err = c.VCPUEvents(); err != nil {
		return s, err
	}
	return s, nil
}

// validate checks a vCPU's state: its ID and the sizes of its fixed-size
// areas.
func (s *VCPUState) validate(i int) error {
	if s.ID != i {
		return fmt.Errorf("state is of vCPU %d", s.ID)
	}
	if n := len(s.XSave); n < xsaveMinSize || n > maxXSaveSize || n%4 != 0 {
		return fmt.Errorf("XSAVE area of %d bytes: want a multiple of 4 from %d to %d", n, xsaveMinSize, maxXSaveSize)
	}
	if len(s.LAPIC) != lapicStateSize {
		return fmt.Errorf("LAPIC state is %d bytes, want %d", len(s.LAPIC), lapicStateSize)
	}
	if s.XCRs.NrXCRs > maxXCRs {
		return fmt.Errorf("%d XCRs, at most %d", s.XCRs.NrXCRs, maxXCRs)
	}
	if len(s.MSRs) > maxStateMSRs {
		return fmt.Errorf("%d MSRs, at most %d", len(s.MSRs), maxStateMSRs)
	}
	if len(s.CPUID) > maxStateCPUID {
		return fmt.Errorf("%d CPUID entries, at most %d", len(s.CPUID), maxStateCPUID)
	}
	if s.MPState > kvm.MPStateSIPIReceived {
		return fmt.Errorf("unknown MP state %d", s.MPState)
	}
	return nil
}

// tscTolerancePPM is how far a host's TSC frequency may be from the
// saved one without scaling: calibration differs by this much between
// boots of one machine (QEMU's and Firecracker's figure).
const tscTolerancePPM = 250

// restoreVCPU writes a vCPU's state into a fresh vCPU whose CPUID is set.
// The order follows KVM's dependencies (and Firecracker's restore):
// MP state, then regs (KVM_SET_REGS drops a pending exception, which the
// events put back), sregs (the APIC base) before the LAPIC, the LAPIC
// before the MSRs (the TSC deadline counts only in TSC-deadline mode), the
// TSC before every other MSR and the TSC deadline last, the events at the
// end.
func (v *VM) restoreVCPU(c *kvm.VCPU, s *VCPUState, xsaveSize int) error {
	if s.TSCKHz != 0 {
		khz, err := c.TSCKHz()
		if err != nil {
			return err
		}
		diff := int64(khz) - int64(s.TSCKHz)
		if diff < 0 {
			diff = -diff
		}
		if diff*1_000_000 > int64(s.TSCKHz)*tscTolerancePPM {
			if err := c.SetTSCKHz(s.TSCKHz); err != nil {
				return fmt.Errorf("the snapshot's TSC ran at %d kHz, this host's at %d kHz, and KVM cannot scale it: %w", s.TSCKHz, khz, err)
			}
		}
	}
	if err := c.SetMPState(&kvm.MPState{State: s.MPState}); err != nil {
		return err
	}
	regs := s.Regs
	if err := c.SetRegs(&regs); err != nil {
		return err
	}
	sregs := s.Sregs
	if err := c.SetSregs(&sregs); err != nil {
		return err
	}
	if len(s.XSave) > xsaveSize {
		return fmt.Errorf("vCPU %d: the snapshot's XSAVE area is %d bytes, this host's KVM takes %d", c.ID(), len(s.XSave), xsaveSize)
	}
	// KVM_SET_XSAVE reads the host's full size; the area's header says
	// which components it holds, so zeros past the saved ones are none.
	xsave := make([]byte, xsaveSize)
	copy(xsave, s.XSave)
	if err := c.SetXSave(xsave); err != nil {
		return err
	}
	xcrs := s.XCRs
	if err := c.SetXCRs(&xcrs); err != nil {
		return err
	}
	dr := s.DebugRegs
	if err := c.SetDebugRegs(&dr); err != nil {
		return err
	}
	var lapic kvm.LAPICState
	copy(lapic.Regs[:], s.LAPIC)
	if err := c.SetLAPIC(&lapic); err != nil {
		return err
	}
	for _, batch := range orderMSRs(s.MSRs) {
		if err := c.SetMSRs(batch); err != nil {
			return err
		}
	}
	events := s.Events
	// Take the pending NMI and the SIPI vector from the state too (the
	// flags KVM_GET_VCPU_EVENTS returns do not ask for them).
	events.Flags |= kvm.VCPUEventValidNMIPending | kvm.VCPUEventValidSIPIVector
	if err := c.SetVCPUEvents(&events); err != nil {
		return err
	}
	return nil
}

// orderMSRs splits saved MSRs into the batches a restore writes in turn:
// the TSC, the others, the TSC deadline. A zero TSC deadline becomes the
// TSC (a timer due at once): Firecracker found that a deadline cleared
// while its interrupt was still undelivered left a restored guest without
// timer interrupts, and a spurious one is harmless.
func orderMSRs(msrs []MSR) [][]kvm.MSREntry {
	var tsc, rest, deadline []kvm.MSREntry
	var tscValue uint64
	haveTSC := false
	for _, m := range msrs {
		e := kvm.MSREntry{Index: m.Index, Data: m.Data}
		switch m.Index {
		case msrIA32TSC:
			tsc = append(tsc, e)
			tscValue, haveTSC = max(tscValue, m.Data), true
		case msrTSCDeadline:
			deadline = append(deadline, e)
		default:
			rest = append(rest, e)
		}
	}
	for i := range deadline {
		if deadline[i].Data == 0 && haveTSC {
			deadline[i].Data = tscValue
		}
	}
	return slices.DeleteFunc([][]kvm.MSREntry{tsc, rest, deadline}, func(b []kvm.MSREntry) bool { return len(b) == 0 })
}

// trimCPUID drops the empty entries some kernels' KVM_GET_CPUID2 leaves
// after the real ones (Firecracker saw them): an entry of leaf 0 whose EAX,
// the highest leaf, is 0 is no real entry.
func trimCPUID(entries []kvm.CPUIDEntry) []kvm.CPUIDEntry {
	return slices.DeleteFunc(slices.Clone(entries), func(e kvm.CPUIDEntry) bool {
		return e.Function == 0 && e.Index == 0 && e.Flags == 0 && e.EAX == 0
	})
}

// cpuidDiff names the first CPUID leaf where a (the snapshot's) and b (this
// host's) differ, or "".
func cpuidDiff(a, b []kvm.CPUIDEntry) string {
	a, b = trimCPUID(a), trimCPUID(b)
	key := func(e kvm.CPUIDEntry) [2]uint32 { return [2]uint32{e.Function, e.Index} }
	m := make(map[[2]uint32]kvm.CPUIDEntry, len(b))
	for _, e := range b {
		m[key(e)] = e
	}
	for _, e := range a {
		o, ok := m[key(e)]
		switch {
		case !ok:
			return fmt.Sprintf("leaf %#x.%d is missing", e.Function, e.Index)
		case o.EAX != e.EAX || o.EBX != e.EBX || o.ECX != e.ECX || o.EDX != e.EDX:
			return fmt.Sprintf("leaf %#x.%d is %#x %#x %#x %#x in the snapshot, %#x %#x %#x %#x here",
				e.Function, e.Index, e.EAX, e.EBX, e.ECX, e.EDX, o.EAX, o.EBX, o.ECX, o.EDX)
		}
	}
	if len(a) != len(b) {
		return fmt.Sprintf("%d leaves, not %d", len(b), len(a))
	}
	return ""
}
