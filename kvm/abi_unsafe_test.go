package kvm

import (
	"testing"
	"unsafe"
)

// The expected figures were read from <linux/kvm.h> for x86-64 (sizeof and
// offsetof in C); they are the kernel ABI and never change.
func TestStructSizes(t *testing.T) {
	tests := []struct {
		name string
		got  uintptr
		want uintptr
	}{
		{"kvm_userspace_memory_region", unsafe.Sizeof(UserspaceMemoryRegion{}), 32},
		{"kvm_regs", unsafe.Sizeof(Regs{}), 144},
		{"kvm_segment", unsafe.Sizeof(Segment{}), 24},
		{"kvm_dtable", unsafe.Sizeof(DTable{}), 16},
		{"kvm_sregs", unsafe.Sizeof(Sregs{}), 312},
		{"kvm_fpu", unsafe.Sizeof(FPU{}), 416},
		{"kvm_xsave", unsafe.Sizeof(XSave{}), 4096},
		{"kvm_xcrs", unsafe.Sizeof(XCRs{}), 392},
		{"kvm_msr_entry", unsafe.Sizeof(MSREntry{}), 16},
		{"kvm_lapic_state", unsafe.Sizeof(LAPICState{}), 1024},
		{"kvm_vcpu_events", unsafe.Sizeof(VCPUEvents{}), 64},
		{"kvm_mp_state", unsafe.Sizeof(MPState{}), 4},
		{"kvm_clock_data", unsafe.Sizeof(ClockData{}), 48},
		{"kvm_irqchip", unsafe.Sizeof(IRQChip{}), 520},
		{"kvm_pit_channel_state", unsafe.Sizeof(PITChannelState{}), 24},
		{"kvm_pit_state2", unsafe.Sizeof(PITState2{}), 112},
		{"kvm_pit_config", unsafe.Sizeof(PITConfig{}), 64},
		{"kvm_irq_level", unsafe.Sizeof(IRQLevel{}), 8},
		{"kvm_irqfd", unsafe.Sizeof(IRQFD{}), 32},
		{"kvm_ioeventfd", unsafe.Sizeof(IOEventFD{}), 64},
		{"kvm_cpuid_entry2", unsafe.Sizeof(CPUIDEntry{}), 40},
		{"kvm_enable_cap", unsafe.Sizeof(EnableCap{}), 104},
		{"kvm_cpuid2 header", unsafe.Offsetof(cpuid2{}.Entries), 8},
		{"kvm_msrs header", unsafe.Offsetof(msrs{}.Entries), 8},
		{"kvm_run header", unsafe.Sizeof(runHeader{}), runUnionOffset},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("sizeof(%s) = %d, kernel ABI says %d", tt.name, tt.got, tt.want)
		}
	}
}

func TestFieldOffsets(t *testing.T) {
	var s Sregs
	var f FPU
	var e VCPUEvents
	var h runHeader
	var m runMMIO
	var ev runEvent
	tests := []struct {
		name string
		got  uintptr
		want uintptr
	}{
		{"kvm_sregs.gdt", unsafe.Offsetof(s.GDT), 192},
		{"kvm_sregs.cr0", unsafe.Offsetof(s.CR0), 224},
		{"kvm_sregs.efer", unsafe.Offsetof(s.EFER), 264},
		{"kvm_sregs.apic_base", unsafe.Offsetof(s.APICBase), 272},
		{"kvm_sregs.interrupt_bitmap", unsafe.Offsetof(s.InterruptBitmap), 280},
		{"kvm_fpu.xmm", unsafe.Offsetof(f.XMM), 152},
		{"kvm_fpu.mxcsr", unsafe.Offsetof(f.MXCSR), 408},
		{"kvm_vcpu_events.sipi_vector", unsafe.Offsetof(e.SIPIVector), 16},
		{"kvm_vcpu_events.smi", unsafe.Offsetof(e.SMI), 24},
		{"kvm_vcpu_events.triple_fault", unsafe.Offsetof(e.TripleFault), 28},
		{"kvm_vcpu_events.exception_payload", unsafe.Offsetof(e.ExceptionPayload), 56},
		{"kvm_run.exit_reason", unsafe.Offsetof(h.ExitReason), 8},
		{"kvm_run.cr8", unsafe.Offsetof(h.CR8), 16},
		{"kvm_run.mmio.len", runUnionOffset + unsafe.Offsetof(m.Len), 48},
		{"kvm_run.mmio.is_write", runUnionOffset + unsafe.Offsetof(m.IsWrite), 52},
		{"kvm_run.system_event.data", runUnionOffset + unsafe.Offsetof(ev.Data), 40},
		{"kvm_ioeventfd.fd", unsafe.Offsetof(IOEventFD{}.FD), 20},
		{"kvm_pit_state2.flags", unsafe.Offsetof(PITState2{}.Flags), 72},
		{"kvm_clock_data.realtime", unsafe.Offsetof(ClockData{}.Realtime), 16},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("offsetof(%s) = %d, kernel ABI says %d", tt.name, tt.got, tt.want)
		}
	}
}

// TestIoctlNumbers checks the request numbers against <linux/kvm.h>, and that
// each encoded size matches the Go struct it carries.
func TestIoctlNumbers(t *testing.T) {
	tests := []struct {
		name string
		got  uintptr
		want uintptr
		arg  uintptr // sizeof the Go argument; 0 for _IO
	}{
		{"KVM_GET_API_VERSION", reqGetAPIVersion, 0xae00, 0},
		{"KVM_CREATE_VM", reqCreateVM, 0xae01, 0},
		{"KVM_GET_MSR_INDEX_LIST", reqGetMSRIndexList, 0xc004ae02, 4},
		{"KVM_GET_SUPPORTED_CPUID", reqGetSupportedCPUID, 0xc008ae05, unsafe.Offsetof(cpuid2{}.Entries)},
		{"KVM_CREATE_VCPU", reqCreateVCPU, 0xae41, 0},
		{"KVM_SET_USER_MEMORY_REGION", reqSetUserMemoryRegion, 0x4020ae46, unsafe.Sizeof(UserspaceMemoryRegion{})},
		{"KVM_SET_IDENTITY_MAP_ADDR", reqSetIdentityMapAddr, 0x4008ae48, 8},
		{"KVM_IRQ_LINE", reqIRQLine, 0x4008ae61, unsafe.Sizeof(IRQLevel{})},
		{"KVM_GET_IRQCHIP", reqGetIRQChip, 0xc208ae62, unsafe.Sizeof(IRQChip{})},
		{"KVM_SET_IRQCHIP", reqSetIRQChip, 0x8208ae63, unsafe.Sizeof(IRQChip{})},
		{"KVM_IRQFD", reqIRQFD, 0x4020ae76, unsafe.Sizeof(IRQFD{})},
		{"KVM_CREATE_PIT2", reqCreatePIT2, 0x4040ae77, unsafe.Sizeof(PITConfig{})},
		{"KVM_IOEVENTFD", reqIOEventFD, 0x4040ae79, unsafe.Sizeof(IOEventFD{})},
		{"KVM_SET_CLOCK", reqSetClock, 0x4030ae7b, unsafe.Sizeof(ClockData{})},
		{"KVM_GET_CLOCK", reqGetClock, 0x8030ae7c, unsafe.Sizeof(ClockData{})},
		{"KVM_GET_PIT2", reqGetPIT2, 0x8070ae9f, unsafe.Sizeof(PITState2{})},
		{"KVM_SET_PIT2", reqSetPIT2, 0x4070aea0, unsafe.Sizeof(PITState2{})},
		{"KVM_ENABLE_CAP", reqEnableCap, 0x4068aea3, unsafe.Sizeof(EnableCap{})},
		{"KVM_RUN", reqRun, 0xae80, 0},
		{"KVM_GET_REGS", reqGetRegs, 0x8090ae81, unsafe.Sizeof(Regs{})},
		{"KVM_SET_REGS", reqSetRegs, 0x4090ae82, unsafe.Sizeof(Regs{})},
		{"KVM_GET_SREGS", reqGetSregs, 0x8138ae83, unsafe.Sizeof(Sregs{})},
		{"KVM_SET_SREGS", reqSetSregs, 0x4138ae84, unsafe.Sizeof(Sregs{})},
		{"KVM_GET_MSRS", reqGetMSRs, 0xc008ae88, unsafe.Offsetof(msrs{}.Entries)},
		{"KVM_SET_MSRS", reqSetMSRs, 0x4008ae89, unsafe.Offsetof(msrs{}.Entries)},
		{"KVM_GET_FPU", reqGetFPU, 0x81a0ae8c, unsafe.Sizeof(FPU{})},
		{"KVM_SET_FPU", reqSetFPU, 0x41a0ae8d, unsafe.Sizeof(FPU{})},
		{"KVM_GET_LAPIC", reqGetLAPIC, 0x8400ae8e, unsafe.Sizeof(LAPICState{})},
		{"KVM_SET_LAPIC", reqSetLAPIC, 0x4400ae8f, unsafe.Sizeof(LAPICState{})},
		{"KVM_SET_CPUID2", reqSetCPUID2, 0x4008ae90, unsafe.Offsetof(cpuid2{}.Entries)},
		{"KVM_GET_CPUID2", reqGetCPUID2, 0xc008ae91, unsafe.Offsetof(cpuid2{}.Entries)},
		{"KVM_GET_MP_STATE", reqGetMPState, 0x8004ae98, unsafe.Sizeof(MPState{})},
		{"KVM_SET_MP_STATE", reqSetMPState, 0x4004ae99, unsafe.Sizeof(MPState{})},
		{"KVM_GET_VCPU_EVENTS", reqGetVCPUEvents, 0x8040ae9f, unsafe.Sizeof(VCPUEvents{})},
		{"KVM_SET_VCPU_EVENTS", reqSetVCPUEvents, 0x4040aea0, unsafe.Sizeof(VCPUEvents{})},
		{"KVM_GET_XSAVE", reqGetXSave, 0x9000aea4, unsafe.Sizeof(XSave{})},
		{"KVM_SET_XSAVE", reqSetXSave, 0x5000aea5, unsafe.Sizeof(XSave{})},
		{"KVM_GET_XCRS", reqGetXCRs, 0x8188aea6, unsafe.Sizeof(XCRs{})},
		{"KVM_SET_XCRS", reqSetXCRs, 0x4188aea7, unsafe.Sizeof(XCRs{})},
		{"KVM_GET_XSAVE2", reqGetXSave2, 0x9000aecf, unsafe.Sizeof(XSave{})},
		{"KVM_KVMCLOCK_CTRL", reqKVMClockCtrl, 0xaead, 0},
	}
	for _, tt := range tests {
		if tt.got != tt.want {
			t.Errorf("%s = %#x, <linux/kvm.h> says %#x", tt.name, tt.got, tt.want)
		}
		if size := (tt.got >> iocSizeShift) & 0x3fff; size != tt.arg {
			t.Errorf("%s encodes a %d-byte argument, the Go type has %d", tt.name, size, tt.arg)
		}
	}
}

func TestExitReasonString(t *testing.T) {
	tests := []struct {
		r    ExitReason
		want string
	}{
		{ExitIO, "IO"}, {ExitMMIO, "MMIO"}, {ExitShutdown, "SHUTDOWN"}, {ExitReason(99), "EXIT_99"},
	}
	for _, tt := range tests {
		if got := tt.r.String(); got != tt.want {
			t.Errorf("ExitReason(%d) = %q, want %q", tt.r, got, tt.want)
		}
	}
}
