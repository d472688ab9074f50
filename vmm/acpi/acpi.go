// Package acpi generates the ACPI tables of a Kiln guest: a hardware-reduced
// ACPI platform (no PM blocks, no SCI, no FACS) made of RSDP, XSDT, FADT,
// MADT and a DSDT describing the serial ports, the virtio-mmio transports
// ("LNRO0005"), an optional Generic Event Device with a power button, and
// an optional VM Generation ID device.
//
// The guest powers off by writing (SLP_TYP<<2)|SLP_EN, 0x34 for S5, to the
// FADT sleep control register, and reboots by writing the reset value to
// the FADT reset register; both reach the VMM as MMIO writes. Build checks
// the Config and lays the tables out as one Image to copy into guest memory.
//
// Linux on a hardware-reduced ACPI platform without EFI reboots through a
// jump to the BIOS reset vector unless its command line says reboot=acpi
// (arch/x86/kernel/reboot.c picks EFI reboot when the FADT has
// HW_REDUCED_ACPI and reboot= is not given). A VMM without firmware should
// pass reboot=acpi to use the reset register, or reboot=k with a keyboard
// controller reset (0xFE to port 0x64) of its own.
package acpi

import (
	"fmt"
	"slices"
)

// Default interrupt controller addresses.
const (
	DefaultLAPICAddr  = 0xFEE00000
	DefaultIOAPICAddr = 0xFEC00000
)

// IOAPICPins is the number of pins (GSIs 0-23) of KVM's in-kernel I/O APIC,
// the only I/O APIC the MADT describes.
const IOAPICPins = 24

// MaxCPUs is the most vCPUs Build accepts: xAPIC IDs 0-254 (255 is the
// broadcast ID, and processor UID 0xFF means "all" in the MADT).
const MaxCPUs = 254

// Values of the sleep registers. To power off, Linux writes WakeStatus to
// the sleep status register, then S5SleepType<<2 | SleepEnable (0x34) to
// the sleep control register, then polls the sleep status register until
// WakeStatus is set; the VMM stops the VM on the sleep control write.
const (
	S5SleepType = 5      // SLP_TYP of \_S5
	SleepEnable = 1 << 5 // SLP_EN in the sleep control register
	WakeStatus  = 1 << 7 // WAK_STS in the sleep status register
)

// Sizes of the regions the DSDT and MADT describe, used to check that no
// two of them overlap.
const (
	lapicSize      = 0x1000
	ioapicSize     = 0x100 // KVM's in-kernel I/O APIC window
	gedSize        = 4
	vmgenidSize    = 16
	minVirtioSize  = 0x100 // virtio-mmio registers before the device config
	serialPortSize = 8
	maxSerialPorts = 9   // COM1-COM9
	maxVirtioMMIO  = 256 // VR00-VRFF
)

// Config describes the machine the tables present.
type Config struct {
	// Base is the guest-physical address where the tables are laid,
	// RSDP first; it must be 16-byte aligned (e.g. 0xE0000, which Linux
	// scans for the RSDP).
	Base uint64
	// CPUs is the number of vCPUs, 1 to MaxCPUs. vCPU i gets a MADT
	// Processor Local APIC entry with processor UID = APIC ID = i.
	CPUs int
	// LAPICAddr is the local APIC address; 0 means DefaultLAPICAddr.
	LAPICAddr uint32
	// IOAPICAddr is the address of I/O APIC 0 (GSI base 0, IOAPICPins
	// pins); 0 means DefaultIOAPICAddr.
	IOAPICAddr uint32
	// Serial lists the 16550 UARTs, described as PNP0501 devices COM1,
	// COM2, ...
	Serial []SerialPort
	// VirtioMMIO lists the virtio-mmio transports, described as
	// "LNRO0005" devices VR00, VR01, ... with _UID 0, 1, ...
	VirtioMMIO []MMIODevice
	// SleepControl is the address of the FADT sleep control register
	// (SystemMemory, 8 bits); see S5SleepType for the protocol.
	SleepControl uint64
	// SleepStatus is the address of the FADT sleep status register
	// (SystemMemory, 8 bits).
	SleepStatus uint64
	// ResetReg is the address of the FADT reset register (SystemMemory,
	// 8 bits); the guest writes ResetValue there to reboot (Linux does
	// only with reboot=acpi on its command line; see the package comment).
	ResetReg   uint64
	ResetValue uint8
	// GED, when set, adds a Generic Event Device and a power button.
	GED *GED
	// VMGenID, when set, adds a VM Generation ID device.
	VMGenID *VMGenID
}

// SerialPort is a 16550-compatible UART: 8 I/O ports at Port, interrupt
// IRQ (an ISA IRQ 0-15, or a GSI up to 23, edge-triggered, active high).
type SerialPort struct {
	Port uint16
	IRQ  uint32
}

// MMIODevice is a virtio-mmio transport: registers at [Base, Base+Size)
// below 4 GiB, interrupt GSI (level-triggered, active high).
type MMIODevice struct {
	Base, Size uint64
	GSI        uint32
	// Edge describes the interrupt as edge-triggered (an irqfd that the VMM
	// pulses) instead of level-triggered (a line the VMM holds).
	Edge bool
}

// GED is a Generic Event Device (ACPI0013), through which the host raises
// events in the guest. Its protocol:
//
//   - The event selector is a 32-bit MMIO register at Base. A guest read
//     returns the pending event bits and clears them (read-to-clear);
//     guest writes are ignored.
//   - To raise an event, the VMM sets its bit in the selector and raises
//     an edge on GSI (edge-triggered, active high).
//   - The guest's _EVT method reads the selector once and handles every
//     bit set: GEDEventPowerButton notifies the power button PWRB (PNP0C0C)
//     with 0x80, so that the guest's init starts a graceful power-off;
//     GEDEventVMGenID notifies the VM Generation ID device (when there is
//     one) with 0x80, so that the guest rereads the generation ID.
type GED struct {
	Base uint64
	GSI  uint32
}

// GED event selector bits.
const (
	GEDEventPowerButton uint32 = 1 << 0
	GEDEventVMGenID     uint32 = 1 << 1
)

// VMGenID is a VM Generation ID device: 16 bytes at Addr (8-byte aligned,
// in guest memory the VMM reserves) hold the generation ID; the device's
// ADDR method returns Addr as a package of two 32-bit integers (low, high).
// Linux's vmgenid driver binds it through its _CID and reseeds its RNG
// when the ID changes (see GEDEventVMGenID).
type VMGenID struct {
	Addr uint64
}

// Image holds the laid-out tables.
type Image struct {
	Base  uint64 // guest-physical address of Bytes[0]
	Bytes []byte // the tables, to be written into guest memory at Base
	RSDP  uint64 // guest-physical address of the RSDP
}

// Len returns the size of the image in bytes.
func (img *Image) Len() int { return len(img.Bytes) }

// ConfigError reports an invalid Config field.
type ConfigError struct {
	Field  string // the field, as in "VirtioMMIO[2].GSI"
	Reason string
}

func (e *ConfigError) Error() string {
	return "acpi: config " + e.Field + ": " + e.Reason
}

func invalid(field, format string, args ...any) error {
	return &ConfigError{Field: field, Reason: fmt.Sprintf(format, args...)}
}

// Build checks cfg and lays out the tables at cfg.Base: RSDP, XSDT, FADT,
// MADT and DSDT, each 16-byte aligned and checksummed.
func Build(cfg Config) (*Image, error) {
	if cfg.LAPICAddr == 0 {
		cfg.LAPICAddr = DefaultLAPICAddr
	}
	if cfg.IOAPICAddr == 0 {
		cfg.IOAPICAddr = DefaultIOAPICAddr
	}
	regions, err := validate(&cfg)
	if err != nil {
		return nil, err
	}
	dsdt, err := buildDSDT(&cfg)
	if err != nil {
		return nil, fmt.Errorf("acpi: build DSDT: %w", err)
	}
	img, err := layout(&cfg, dsdt)
	if err != nil {
		return nil, err
	}
	tables := region{"Base", cfg.Base, cfg.Base + uint64(img.Len())}
	if err := checkOverlaps(append(regions, tables)); err != nil {
		return nil, err
	}
	return img, nil
}

// region is a guest-physical range [start, end) named by the field that
// places it.
type region struct {
	field      string
	start, end uint64
}

// newRegion returns the region of size bytes at addr, or an error when it
// wraps past the top of the address space.
func newRegion(field string, addr, size uint64) (region, error) {
	if addr+size < addr {
		return region{}, invalid(field, "%#x bytes at %#x wrap past the top of the address space", size, addr)
	}
	return region{field, addr, addr + size}, nil
}

// validate checks every field of cfg but the size of the tables, and
// returns the guest-physical regions the tables describe.
func validate(cfg *Config) ([]region, error) {
	var regions []region
	add := func(field string, addr, size uint64) error {
		r, err := newRegion(field, addr, size)
		if err != nil {
			return err
		}
		regions = append(regions, r)
		return nil
	}

	if cfg.Base == 0 {
		return nil, invalid("Base", "is 0; the tables need an address")
	}
	if cfg.Base%16 != 0 {
		return nil, invalid("Base", "%#x is not 16-byte aligned (the RSDP must be)", cfg.Base)
	}
	if cfg.CPUs < 1 || cfg.CPUs > MaxCPUs {
		return nil, invalid("CPUs", "%d, want 1 to %d", cfg.CPUs, MaxCPUs)
	}
	if cfg.LAPICAddr%lapicSize != 0 {
		return nil, invalid("LAPICAddr", "%#x is not 4 KiB aligned", cfg.LAPICAddr)
	}
	if cfg.IOAPICAddr%lapicSize != 0 {
		return nil, invalid("IOAPICAddr", "%#x is not 4 KiB aligned", cfg.IOAPICAddr)
	}
	if err := add("LAPICAddr", uint64(cfg.LAPICAddr), lapicSize); err != nil {
		return nil, err
	}
	if err := add("IOAPICAddr", uint64(cfg.IOAPICAddr), ioapicSize); err != nil {
		return nil, err
	}

	gsis := map[uint32]string{}
	useGSI := func(field string, gsi uint32) error {
		if gsi >= IOAPICPins {
			return invalid(field, "%d is not below %d (the I/O APIC's pins)", gsi, IOAPICPins)
		}
		if other, ok := gsis[gsi]; ok {
			return invalid(field, "%d is already used by %s", gsi, other)
		}
		gsis[gsi] = field
		return nil
	}

	if len(cfg.Serial) > maxSerialPorts {
		return nil, invalid("Serial", "%d ports, at most %d", len(cfg.Serial), maxSerialPorts)
	}
	for i, s := range cfg.Serial {
		f := fmt.Sprintf("Serial[%d]", i)
		if s.Port == 0 {
			return nil, invalid(f+".Port", "is 0")
		}
		if uint32(s.Port)+serialPortSize > 0x10000 {
			return nil, invalid(f+".Port", "%#x: its %d ports run past 0xFFFF", s.Port, serialPortSize)
		}
		for j, o := range cfg.Serial[:i] {
			if s.Port < o.Port+serialPortSize && o.Port < s.Port+serialPortSize {
				return nil, invalid(f+".Port", "ports %#x-%#x overlap Serial[%d] at %#x", s.Port, s.Port+serialPortSize-1, j, o.Port)
			}
		}
		if err := useGSI(f+".IRQ", s.IRQ); err != nil {
			return nil, err
		}
	}

	if len(cfg.VirtioMMIO) > maxVirtioMMIO {
		return nil, invalid("VirtioMMIO", "%d devices, at most %d", len(cfg.VirtioMMIO), maxVirtioMMIO)
	}
	for i, d := range cfg.VirtioMMIO {
		f := fmt.Sprintf("VirtioMMIO[%d]", i)
		if d.Base == 0 {
			return nil, invalid(f+".Base", "is 0")
		}
		if d.Base%4 != 0 {
			return nil, invalid(f+".Base", "%#x is not 4-byte aligned", d.Base)
		}
		if d.Size < minVirtioSize {
			return nil, invalid(f+".Size", "%#x is below the %#x bytes of the virtio-mmio registers", d.Size, minVirtioSize)
		}
		if d.Base+d.Size < d.Base || d.Base+d.Size > 1<<32 {
			return nil, invalid(f+".Base", "%#x bytes at %#x do not fit below 4 GiB (Memory32Fixed)", d.Size, d.Base)
		}
		if err := add(f, d.Base, d.Size); err != nil {
			return nil, err
		}
		if err := useGSI(f+".GSI", d.GSI); err != nil {
			return nil, err
		}
	}

	for _, r := range []struct {
		field string
		addr  uint64
	}{{"SleepControl", cfg.SleepControl}, {"SleepStatus", cfg.SleepStatus}, {"ResetReg", cfg.ResetReg}} {
		if r.addr == 0 {
			return nil, invalid(r.field, "is 0; the guest needs the register to power off or reboot")
		}
		if err := add(r.field, r.addr, 1); err != nil {
			return nil, err
		}
	}

	if g := cfg.GED; g != nil {
		if g.Base == 0 {
			return nil, invalid("GED.Base", "is 0")
		}
		if g.Base%4 != 0 {
			return nil, invalid("GED.Base", "%#x is not 4-byte aligned", g.Base)
		}
		if err := add("GED.Base", g.Base, gedSize); err != nil {
			return nil, err
		}
		if err := useGSI("GED.GSI", g.GSI); err != nil {
			return nil, err
		}
	}
	if v := cfg.VMGenID; v != nil {
		if v.Addr == 0 {
			return nil, invalid("VMGenID.Addr", "is 0")
		}
		if v.Addr%8 != 0 {
			return nil, invalid("VMGenID.Addr", "%#x is not 8-byte aligned", v.Addr)
		}
		if err := add("VMGenID.Addr", v.Addr, vmgenidSize); err != nil {
			return nil, err
		}
	}
	return regions, checkOverlaps(regions)
}

// checkOverlaps returns an error naming the first two regions that overlap.
func checkOverlaps(regions []region) error {
	sorted := slices.Clone(regions)
	slices.SortStableFunc(sorted, func(a, b region) int {
		switch {
		case a.start < b.start:
			return -1
		case a.start > b.start:
			return 1
		}
		return 0
	})
	for i := 1; i < len(sorted); i++ {
		a, b := sorted[i-1], sorted[i]
		if b.start < a.end {
			return invalid(b.field, "[%#x, %#x) overlaps %s [%#x, %#x)", b.start, b.end, a.field, a.start, a.end)
		}
	}
	return nil
}
