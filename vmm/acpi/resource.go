package acpi

import (
	"encoding/binary"
	"fmt"
)

// Resource descriptors (ACPI 6.5, section 6.4) for the _CRS objects of the
// DSDT. A ResourceTemplate is an AML Buffer holding the descriptors and an
// End Tag.

// Descriptor is a resource descriptor.
type Descriptor interface {
	// AppendResource appends the descriptor's bytes to dst.
	AppendResource(dst []byte) ([]byte, error)
}

// ResourceTemplate is a Buffer holding descs and an End Tag (checksum 0):
// ASL ResourceTemplate() { descs }.
func ResourceTemplate(descs ...Descriptor) Term {
	return termFunc(func(dst []byte) ([]byte, error) {
		var data []byte
		for i, d := range descs {
			if d == nil {
				return nil, fmt.Errorf("aml: ResourceTemplate: descriptor %d is nil", i)
			}
			var err error
			if data, err = d.AppendResource(data); err != nil {
				return nil, fmt.Errorf("aml: ResourceTemplate: %w", err)
			}
		}
		data = append(data, 0x79, 0x00) // End Tag, checksum 0 ("treat as correct")
		return Buffer(data).AppendAML(dst)
	})
}

// IO is a 16-bit-decoded I/O port range (small descriptor 0x08):
// ASL IO(Decode16, Min, Max, Align, Length).
type IO struct {
	Min, Max uint16 // lowest and highest base address
	Align    uint8  // base alignment
	Length   uint8  // number of ports
}

// AppendResource implements Descriptor.
func (d IO) AppendResource(dst []byte) ([]byte, error) {
	if d.Min > d.Max {
		return nil, fmt.Errorf("IO: minimum %#x above maximum %#x", d.Min, d.Max)
	}
	if uint32(d.Max)+uint32(d.Length) > 0x10000 {
		return nil, fmt.Errorf("IO: %d ports at %#x run past port 0xFFFF", d.Length, d.Max)
	}
	dst = append(dst, 0x47, 0x01) // tag 0x08 length 7; Decode16
	dst = binary.LittleEndian.AppendUint16(dst, d.Min)
	dst = binary.LittleEndian.AppendUint16(dst, d.Max)
	return append(dst, d.Align, d.Length), nil
}

// IRQNoFlags is a set of ISA IRQs 0-15, edge-triggered, active high,
// exclusive (small descriptor 0x04 without the flags byte):
// ASL IRQNoFlags() { IRQs }.
type IRQNoFlags struct {
	IRQs []uint8
}

// AppendResource implements Descriptor.
func (d IRQNoFlags) AppendResource(dst []byte) ([]byte, error) {
	var mask uint16
	for _, irq := range d.IRQs {
		if irq > 15 {
			return nil, fmt.Errorf("IRQNoFlags: IRQ %d above 15", irq)
		}
		mask |= 1 << irq
	}
	return binary.LittleEndian.AppendUint16(append(dst, 0x22), mask), nil
}

// Memory32Fixed is a fixed 32-bit memory range (large descriptor 0x86):
// ASL Memory32Fixed(ReadWrite|ReadOnly, Base, Length).
type Memory32Fixed struct {
	Writable     bool
	Base, Length uint32
}

// AppendResource implements Descriptor.
func (d Memory32Fixed) AppendResource(dst []byte) ([]byte, error) {
	if d.Length != 0 && uint64(d.Base)+uint64(d.Length) > 1<<32 {
		return nil, fmt.Errorf("Memory32Fixed: %#x bytes at %#x run past 4 GiB", d.Length, d.Base)
	}
	var info byte
	if d.Writable {
		info = 1
	}
	dst = append(dst, 0x86, 0x09, 0x00, info)
	dst = binary.LittleEndian.AppendUint32(dst, d.Base)
	return binary.LittleEndian.AppendUint32(dst, d.Length), nil
}

// ExtendedInterrupt is an Extended Interrupt descriptor (large descriptor
// 0x89) listing GSIs: ASL Interrupt(ResourceConsumer|ResourceProducer,
// Edge|Level, ActiveHigh|ActiveLow, Exclusive|Shared) { GSIs }.
type ExtendedInterrupt struct {
	Consumer    bool // ResourceConsumer (a device using the interrupt)
	Edge        bool // edge-triggered; false is level-triggered
	ActiveLow   bool // active low; false is active high
	Shared      bool // shared; false is exclusive
	WakeCapable bool
	GSIs        []uint32
}

// AppendResource implements Descriptor.
func (d ExtendedInterrupt) AppendResource(dst []byte) ([]byte, error) {
	if len(d.GSIs) == 0 || len(d.GSIs) > 255 {
		return nil, fmt.Errorf("ExtendedInterrupt: %d interrupts, want 1-255", len(d.GSIs))
	}
	var flags byte
	for bit, set := range []bool{d.Consumer, d.Edge, d.ActiveLow, d.Shared, d.WakeCapable} {
		if set {
			flags |= 1 << bit
		}
	}
	dst = append(dst, 0x89)
	dst = binary.LittleEndian.AppendUint16(dst, uint16(2+4*len(d.GSIs)))
	dst = append(dst, flags, byte(len(d.GSIs)))
	for _, g := range d.GSIs {
		dst = binary.LittleEndian.AppendUint32(dst, g)
	}
	return dst, nil
}
