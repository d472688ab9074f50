package kvm

// Structures below mirror <linux/kvm.h> and <asm/kvm.h> for x86-64 field by
// field; abi_unsafe_test.go checks their sizes and offsets against the kernel ABI.

// UserspaceMemoryRegion is struct kvm_userspace_memory_region.
type UserspaceMemoryRegion struct {
	Slot          uint32
	Flags         uint32
	GuestPhysAddr uint64
	MemorySize    uint64
	UserspaceAddr uint64
}

// Memory region flags.
const (
	MemLogDirtyPages = 1 << 0
	MemReadonly      = 1 << 1
)

// Regs is struct kvm_regs: the general-purpose registers.
type Regs struct {
	RAX, RBX, RCX, RDX uint64
	RSI, RDI, RSP, RBP uint64
	R8, R9, R10, R11   uint64
	R12, R13, R14, R15 uint64
	RIP, RFLAGS        uint64
}

// Segment is struct kvm_segment.
type Segment struct {
	Base     uint64
	Limit    uint32
	Selector uint16
	Type     uint8
	Present  uint8
	DPL      uint8
	DB       uint8
	S        uint8
	L        uint8
	G        uint8
	AVL      uint8
	Unusable uint8
	_        uint8
}

// DTable is struct kvm_dtable (a GDT or IDT register).
type DTable struct {
	Base  uint64
	Limit uint16
	_     [3]uint16
}

// Sregs is struct kvm_sregs: segment and control registers.
type Sregs struct {
	CS, DS, ES, FS, GS, SS Segment
	TR, LDT                Segment
	GDT, IDT               DTable
	CR0, CR2, CR3, CR4     uint64
	CR8                    uint64
	EFER                   uint64
	APICBase               uint64
	InterruptBitmap        [4]uint64
}

// FPU is struct kvm_fpu (FXSAVE layout).
type FPU struct {
	FPR        [8][16]uint8
	FCW        uint16
	FSW        uint16
	FTWX       uint8
	_          uint8
	LastOpcode uint16
	LastIP     uint64
	LastDP     uint64
	XMM        [16][16]uint8
	MXCSR      uint32
	_          uint32
}

// XSave is struct kvm_xsave: the XSAVE area as KVM_GET_XSAVE returns it.
// Hosts with AMX need a larger buffer (KVM_CAP_XSAVE2); see VCPU.XSave.
type XSave struct {
	Region [1024]uint32
}

// XCR is struct kvm_xcr.
type XCR struct {
	XCR   uint32
	_     uint32
	Value uint64
}

// XCRs is struct kvm_xcrs.
type XCRs struct {
	NrXCRs uint32
	Flags  uint32
	XCRs   [16]XCR
	_      [16]uint64
}

// MSREntry is struct kvm_msr_entry.
type MSREntry struct {
	Index uint32
	_     uint32
	Data  uint64
}

// LAPICState is struct kvm_lapic_state: the local APIC's register page.
type LAPICState struct {
	Regs [1024]uint8
}

// VCPUEvents is struct kvm_vcpu_events: pending exceptions, interrupts, NMIs.
type VCPUEvents struct {
	Exception struct {
		Injected     uint8
		Nr           uint8
		HasErrorCode uint8
		Pending      uint8
		ErrorCode    uint32
	}
	Interrupt struct {
		Injected uint8
		Nr       uint8
		Soft     uint8
		Shadow   uint8
	}
	NMI struct {
		Injected uint8
		Pending  uint8
		Masked   uint8
		_        uint8
	}
	SIPIVector uint32
	Flags      uint32
	SMI        struct {
		SMM          uint8
		Pending      uint8
		SMMInsideNMI uint8
		LatchedInit  uint8
	}
	TripleFault struct {
		Pending uint8
	}
	_                   [26]uint8
	ExceptionHasPayload uint8
	ExceptionPayload    uint64
}

// MPState is struct kvm_mp_state.
type MPState struct {
	State uint32
}

// MP states.
const (
	MPStateRunnable      = 0
	MPStateUninitialized = 1
	MPStateInitReceived  = 2
	MPStateHalted        = 3
	MPStateSIPIReceived  = 4
)

// ClockData is struct kvm_clock_data.
type ClockData struct {
	Clock    uint64
	Flags    uint32
	_        uint32
	Realtime uint64
	HostTSC  uint64
	_        [4]uint32
}

// IRQChip chip ids for IRQChip.ChipID.
const (
	IRQChipPICMaster = 0
	IRQChipPICSlave  = 1
	IRQChipIOAPIC    = 2
)

// IRQChip is struct kvm_irqchip: the state of one in-kernel PIC or the IOAPIC.
type IRQChip struct {
	ChipID uint32
	_      uint32
	Chip   [512]byte
}

// PITChannelState is struct kvm_pit_channel_state.
type PITChannelState struct {
	Count         uint32
	LatchedCount  uint16
	CountLatched  uint8
	StatusLatched uint8
	Status        uint8
	ReadState     uint8
	WriteState    uint8
	WriteLatch    uint8
	RWMode        uint8
	Mode          uint8
	BCD           uint8
	Gate          uint8
	CountLoadTime int64
}

// PITState2 is struct kvm_pit_state2.
type PITState2 struct {
	Channels [3]PITChannelState
	Flags    uint32
	_        [9]uint32
}

// PITConfig is struct kvm_pit_config.
type PITConfig struct {
	Flags uint32
	_     [15]uint32
}

// PITSpeakerDummy makes the in-kernel PIT emulate port 0x61 (speaker) too.
const PITSpeakerDummy = 1

// IRQLevel is struct kvm_irq_level.
type IRQLevel struct {
	IRQ   uint32
	Level uint32
}

// IRQFD is struct kvm_irqfd.
type IRQFD struct {
	FD         uint32
	GSI        uint32
	Flags      uint32
	ResampleFD uint32
	_          [16]uint8
}

// IRQFD flags.
const (
	IRQFDFlagDeassign = 1 << 0
	IRQFDFlagResample = 1 << 1
)

// IOEventFD is struct kvm_ioeventfd.
type IOEventFD struct {
	DataMatch uint64
	Addr      uint64
	Len       uint32
	FD        int32
	Flags     uint32
	_         [36]uint8
}

// IOEventFD flags.
const (
	IOEventFDFlagDataMatch = 1 << 0
	IOEventFDFlagPIO       = 1 << 1
	IOEventFDFlagDeassign  = 1 << 2
)

// CPUIDEntry is struct kvm_cpuid_entry2.
type CPUIDEntry struct {
	Function uint32
	Index    uint32
	Flags    uint32
	EAX      uint32
	EBX      uint32
	ECX      uint32
	EDX      uint32
	_        [3]uint32
}

// CPUID entry flags.
const (
	CPUIDFlagSignificantIndex = 1 << 0
)

// EnableCap is struct kvm_enable_cap.
type EnableCap struct {
	Cap   uint32
	Flags uint32
	Args  [4]uint64
	_     [64]uint8
}

// Capabilities passed to CheckExtension.
const (
	CapIRQChip          = 0
	CapNrVCPUs          = 9
	CapAdjustClock      = 39
	CapMaxVCPUs         = 66
	CapTSCDeadlineTimer = 72
	CapImmediateExit    = 136
	CapXSave2           = 208
)

// cpuid2 is struct kvm_cpuid2 with room for maxCPUIDEntries entries.
type cpuid2 struct {
	Nent    uint32
	_       uint32
	Entries [maxCPUIDEntries]CPUIDEntry
}

// maxMSRs bounds one KVM_GET_MSRS/KVM_SET_MSRS call.
const maxMSRs = 512

// msrs is struct kvm_msrs with room for maxMSRs entries.
type msrs struct {
	NMSRs   uint32
	_       uint32
	Entries [maxMSRs]MSREntry
}
