package vmm

// Guest-physical layout of a Kiln VM on x86-64.
const (
	gdtAddr      = 0x500
	idtAddr      = 0x520
	pvhInfoAddr  = 0x6000 // hvm_start_info, then its memory map and module list
	pvhMemmap    = 0x6040
	zeroPageAddr = 0x7000
	bootStack    = 0x8ff0
	pml4Addr     = 0x9000
	pdptAddr     = 0xa000
	pdAddr       = 0xb000 // four page directories: identity map of 4 GiB
	cmdlineAddr  = 0x20000
	cmdlineMax   = 0x10000
	ebdaStart    = 0x9fc00
	acpiBase     = 0xe0000 // ACPI tables, up to 1 MiB
	acpiEnd      = 0x100000
	himemStart   = 0x100000

	// The 1 GiB below 4 GiB holds no RAM: device MMIO, the IOAPIC, LAPIC.
	mmioGapStart = 0xc0000000
	mmioGapEnd   = 0x100000000

	// VirtioMMIOBase is where virtio-mmio transports start (one page each).
	VirtioMMIOBase = 0xd0000000

	powerBase  = 0xfeb00000 // ACPI sleep control/status and reset registers
	powerSize  = 0x1000
	tssAddr    = 0xfffbd000
	identMap   = 0xfffbc000
	ioapicAddr = 0xfec00000
	lapicAddr  = 0xfee00000

	com1Port = 0x3f8
	com1IRQ  = 4
)
