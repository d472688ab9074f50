package acpi

import (
	"encoding/binary"
	"fmt"
)

// Identification written into every table header.
const (
	oemID           = "KILN  "
	oemTableID      = "KILNVMM "
	oemRevision     = 1
	creatorID       = "KILN"
	creatorRevision = 1
	hypervisorID    = "KILNVMM\x00" // FADT Hypervisor Vendor Identity
)

// Table revisions (ACPI 6.5).
const (
	xsdtRevision      = 1
	fadtRevision      = 6
	fadtMinorRevision = 5
	madtRevision      = 5
	dsdtRevision      = 2 // 64-bit integers
)

// Table sizes and offsets (ACPI 6.5, chapter 5).
const (
	headerSize = 36  // System Description Table Header
	rsdpSize   = 36  // RSDP revision 2
	fadtSize   = 276 // FADT revision 6
	madtFixed  = 44  // MADT header, Local Interrupt Controller Address, Flags

	madtLAPICSize  = 8
	madtIOAPICSize = 12
	madtNMISize    = 6
)

// FADT fields (ACPI 6.5, table 5.9): byte offsets.
const (
	fadtPMProfile    = 45
	fadtSCIInt       = 46
	fadtIAPCBootArch = 109
	fadtFlags        = 112
	fadtResetReg     = 116
	fadtResetValue   = 128
	fadtMinorVersion = 131
	fadtXDSDT        = 140
	fadtSleepControl = 244
	fadtSleepStatus  = 256
	fadtHypervisorID = 268
)

// FADT flags and IA-PC boot architecture flags.
const (
	fadtFlagResetRegSup   = 1 << 10
	fadtFlagHWReducedACPI = 1 << 20

	// Bit 1 (8042) is clear: there is no keyboard controller. Bit 0
	// (LEGACY_DEVICES) and bit 5 (CMOS RTC not present) are clear, as
	// on QEMU's microvm.
	iapcVGANotPresent    = 1 << 2
	iapcMSINotSupported  = 1 << 3
	iapcBootArchDefaults = iapcVGANotPresent | iapcMSINotSupported
)

// MADT, GAS, layout and DSDT values.
const (
	madtFlagPCATCompat  = 1 << 0
	madtTypeLAPIC       = 0
	madtTypeIOAPIC      = 1
	madtTypeLAPICNMI    = 4
	madtLAPICEnabled    = 1 << 0
	madtAllProcessors   = 0xFF
	madtNMILINT1        = 1
	ioapicID            = 0
	gasSystemMemory     = 0
	gasAccessByte       = 1
	tableAlign          = 16
	rsdpChecksumLen     = 20
	rsdpRevision        = 2
	xsdtEntrySize       = 8
	virtioMMIOHID       = "LNRO0005" // Linux's virtio_mmio_acpi_match
	gedHID              = "ACPI0013" // Generic Event Device
	vmgenidHID          = "KILN0001" // a valid ACPI ID; the driver matches _CID
	notifyDeviceSpecial = 0x80
)

// The compatible IDs of the VM Generation ID device: Microsoft's
// "VM_Gen_Counter" (which ACPICA upper-cases to the "VM_GEN_COUNTER"
// Linux's vmgenid driver matches) and "VMGENCTR", the driver's other ID,
// matched as is.
const (
	vmgenidCID     = "VM_Gen_Counter"
	vmgenidLinuxID = "VMGENCTR"
)

// layout places the tables at cfg.Base and fills them in; aml is the body
// of the DSDT.
func layout(cfg *Config, aml []byte) (*Image, error) {
	dsdtSize := headerSize + len(aml)
	madtSize := madtFixed + cfg.CPUs*madtLAPICSize + madtIOAPICSize + madtNMISize
	xsdtSize := headerSize + 2*xsdtEntrySize

	off := 0
	place := func(size int) int {
		at := off
		off = alignUp(off+size, tableAlign)
		return at
	}
	rsdpOff := place(rsdpSize)
	xsdtOff := place(xsdtSize)
	fadtOff := place(fadtSize)
	madtOff := place(madtSize)
	dsdtOff := place(dsdtSize)
	end := dsdtOff + dsdtSize
	if cfg.Base+uint64(end) < cfg.Base {
		return nil, invalid("Base", "%#x: the %d bytes of tables wrap past the top of the address space", cfg.Base, end)
	}

	img := &Image{Base: cfg.Base, Bytes: make([]byte, end), RSDP: cfg.Base + uint64(rsdpOff)}
	addr := func(off int) uint64 { return cfg.Base + uint64(off) }

	writeDSDT(img.Bytes[dsdtOff:end], aml)
	writeMADT(img.Bytes[madtOff:madtOff+madtSize], cfg)
	writeFADT(img.Bytes[fadtOff:fadtOff+fadtSize], cfg, addr(dsdtOff))
	writeXSDT(img.Bytes[xsdtOff:xsdtOff+xsdtSize], addr(fadtOff), addr(madtOff))
	writeRSDP(img.Bytes[rsdpOff:rsdpOff+rsdpSize], addr(xsdtOff))
	return img, nil
}

func alignUp(n, align int) int { return (n + align - 1) / align * align }

// writeHeader fills the System Description Table Header of t, whose length
// is len(t); the checksum is set by setChecksum once the body is written.
func writeHeader(t []byte, signature string, revision byte) {
	copy(t[0:4], signature)
	binary.LittleEndian.PutUint32(t[4:8], uint32(len(t)))
	t[8] = revision
	copy(t[10:16], oemID)
	copy(t[16:24], oemTableID)
	binary.LittleEndian.PutUint32(t[24:28], oemRevision)
	copy(t[28:32], creatorID)
	binary.LittleEndian.PutUint32(t[32:36], creatorRevision)
}

// setChecksum sets t[at] so that the bytes of t sum to 0 (mod 256).
func setChecksum(t []byte, at int) {
	t[at] = 0
	var sum byte
	for _, b := range t {
		sum += b
	}
	t[at] = -sum
}

func writeRSDP(t []byte, xsdt uint64) {
	copy(t[0:8], "RSD PTR ")
	copy(t[9:15], oemID)
	t[15] = rsdpRevision
	// RsdtAddress (16:20) stays 0: there is only an XSDT.
	binary.LittleEndian.PutUint32(t[20:24], rsdpSize)
	binary.LittleEndian.PutUint64(t[24:32], xsdt)
	setChecksum(t[:rsdpChecksumLen], 8)
	setChecksum(t[:rsdpSize], 32)
}

func writeXSDT(t []byte, entries ...uint64) {
	writeHeader(t, "XSDT", xsdtRevision)
	for i, e := range entries {
		binary.LittleEndian.PutUint64(t[headerSize+i*xsdtEntrySize:], e)
	}
	setChecksum(t, 9)
}

// putGAS writes a Generic Address Structure for an 8-bit SystemMemory
// register at addr.
func putGAS(b []byte, addr uint64) {
	b[0] = gasSystemMemory
	b[1] = 8 // register bit width
	b[2] = 0 // bit offset
	b[3] = gasAccessByte
	binary.LittleEndian.PutUint64(b[4:12], addr)
}

// writeFADT writes a hardware-reduced FADT: no FACS, no PM/GPE blocks, SCI
// interrupt 0; sleep control, sleep status and reset registers in memory.
func writeFADT(t []byte, cfg *Config, dsdt uint64) {
	writeHeader(t, "FACP", fadtRevision)
	// FIRMWARE_CTRL, DSDT (32-bit), X_FIRMWARE_CTRL stay 0: no FACS, and
	// the DSDT is given by X_DSDT alone.
	t[fadtPMProfile] = 0 // unspecified
	binary.LittleEndian.PutUint16(t[fadtSCIInt:], 0)
	binary.LittleEndian.PutUint16(t[fadtIAPCBootArch:], iapcBootArchDefaults)
	binary.LittleEndian.PutUint32(t[fadtFlags:], fadtFlagHWReducedACPI|fadtFlagResetRegSup)
	putGAS(t[fadtResetReg:], cfg.ResetReg)
	t[fadtResetValue] = cfg.ResetValue
	t[fadtMinorVersion] = fadtMinorRevision
	binary.LittleEndian.PutUint64(t[fadtXDSDT:], dsdt)
	putGAS(t[fadtSleepControl:], cfg.SleepControl)
	putGAS(t[fadtSleepStatus:], cfg.SleepStatus)
	copy(t[fadtHypervisorID:], hypervisorID)
	setChecksum(t, 9)
}

// writeMADT writes one enabled Processor Local APIC per vCPU, I/O APIC 0,
// and a Local APIC NMI on LINT1 for all processors.
func writeMADT(t []byte, cfg *Config) {
	writeHeader(t, "APIC", madtRevision)
	binary.LittleEndian.PutUint32(t[36:40], cfg.LAPICAddr)
	binary.LittleEndian.PutUint32(t[40:44], madtFlagPCATCompat)
	p := t[madtFixed:]
	for i := 0; i < cfg.CPUs; i++ {
		p[0], p[1] = madtTypeLAPIC, madtLAPICSize
		p[2] = byte(i) // ACPI processor UID
		p[3] = byte(i) // APIC ID
		binary.LittleEndian.PutUint32(p[4:8], madtLAPICEnabled)
		p = p[madtLAPICSize:]
	}
	p[0], p[1] = madtTypeIOAPIC, madtIOAPICSize
	p[2] = ioapicID
	binary.LittleEndian.PutUint32(p[4:8], cfg.IOAPICAddr)
	binary.LittleEndian.PutUint32(p[8:12], 0) // GSI base
	p = p[madtIOAPICSize:]
	p[0], p[1] = madtTypeLAPICNMI, madtNMISize
	p[2] = madtAllProcessors
	binary.LittleEndian.PutUint16(p[3:5], 0) // MPS INTI flags: conforming
	p[5] = madtNMILINT1
	setChecksum(t, 9)
}

func writeDSDT(t []byte, aml []byte) {
	writeHeader(t, "DSDT", dsdtRevision)
	copy(t[headerSize:], aml)
	setChecksum(t, 9)
}

// buildDSDT returns the AML of the DSDT body, the part after its header.
func buildDSDT(cfg *Config) ([]byte, error) {
	var sb []Term
	for i, s := range cfg.Serial {
		var irq Descriptor = IRQNoFlags{IRQs: []uint8{uint8(s.IRQ)}}
		if s.IRQ > 15 {
			irq = ExtendedInterrupt{Consumer: true, Edge: true, GSIs: []uint32{s.IRQ}}
		}
		sb = append(sb, Device(fmt.Sprintf("COM%d", i+1),
			Name("_HID", EISAID("PNP0501")),
			Name("_UID", Integer(i+1)),
			Name("_CRS", ResourceTemplate(
				IO{Min: s.Port, Max: s.Port, Align: 1, Length: serialPortSize},
				irq,
			)),
		))
	}
	for i, d := range cfg.VirtioMMIO {
		sb = append(sb, Device(fmt.Sprintf("VR%02X", i),
			Name("_HID", String(virtioMMIOHID)),
			Name("_UID", Integer(i)),
			Name("_CCA", Integer(1)), // cache-coherent DMA
			Name("_CRS", ResourceTemplate(
				Memory32Fixed{Writable: true, Base: uint32(d.Base), Length: uint32(d.Size)},
				ExtendedInterrupt{Consumer: true, Edge: d.Edge, GSIs: []uint32{d.GSI}},
			)),
		))
	}
	if g := cfg.GED; g != nil {
		evt := []Term{
			Store(Path("ESEL"), Local(0)),
			If(LEqual(And(Local(0), Integer(GEDEventPowerButton), nil), Integer(GEDEventPowerButton)),
				Notify(Path("PWRB"), Integer(notifyDeviceSpecial))),
		}
		if cfg.VMGenID != nil {
			evt = append(evt,
				If(LEqual(And(Local(0), Integer(GEDEventVMGenID), nil), Integer(GEDEventVMGenID)),
					Notify(Path("VGEN"), Integer(notifyDeviceSpecial))))
		}
		sb = append(sb,
			Device("GED",
				Name("_HID", String(gedHID)),
				Name("_UID", Integer(0)),
				Name("_CRS", ResourceTemplate(
					ExtendedInterrupt{Consumer: true, Edge: true, GSIs: []uint32{g.GSI}},
				)),
				OperationRegion("EREG", SystemMemory, Integer(g.Base), Integer(gedSize)),
				Field("EREG", DWordAcc, false, WriteAsZeros, FieldUnit{Name: "ESEL", Bits: 32}),
				Method("_EVT", 1, true, evt...),
			),
			Device("PWRB",
				Name("_HID", EISAID("PNP0C0C")),
				Name("_UID", Integer(0)),
			),
		)
	}
	if v := cfg.VMGenID; v != nil {
		sb = append(sb, Device("VGEN",
			Name("_HID", String(vmgenidHID)),
			Name("_CID", Package(String(vmgenidCID), String(vmgenidLinuxID))),
			Name("_DDN", String(vmgenidCID)),
			Method("ADDR", 0, false,
				Return(Package(Integer(v.Addr&0xFFFFFFFF), Integer(v.Addr>>32)))),
		))
	}
	return Encode(
		Scope("_SB", sb...),
		Name("_S5", Package(Integer(S5SleepType), Integer(0), Integer(0), Integer(0))),
	)
}
