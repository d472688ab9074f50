package vmm

import (
	"encoding/binary"
	"testing"

	"github.com/kilnvm/kiln/vmm/acpi"
)

func TestGEDDevice(t *testing.T) {
	pulses := 0
	g := &gedDevice{pulse: func() { pulses++ }}
	read := func() uint32 {
		var b [4]byte
		g.Read(0, b[:])
		return binary.LittleEndian.Uint32(b[:])
	}
	if read() != 0 {
		t.Fatal("events pending at start")
	}
	g.raise(acpi.GEDEventVMGenID)
	g.raise(acpi.GEDEventPowerButton)
	if pulses != 2 {
		t.Fatalf("%d interrupts for 2 events", pulses)
	}
	if got := read(); got != acpi.GEDEventVMGenID|acpi.GEDEventPowerButton {
		t.Fatalf("selector %#x", got)
	}
	if read() != 0 {
		t.Fatal("a read did not clear the selector")
	}
	// Other offsets and sizes read zeros and clear nothing.
	g.raise(acpi.GEDEventVMGenID)
	var b [2]byte
	g.Read(0, b[:])
	var w [4]byte
	g.Read(4, w[:])
	if b != [2]byte{} || w != [4]byte{} || read() != acpi.GEDEventVMGenID {
		t.Fatal("a malformed read touched the selector")
	}
	g.Write(0, []byte{0xff, 0xff, 0xff, 0xff})
	if read() != 0 {
		t.Fatal("a guest write set events")
	}
}

func TestVMGenIDLayout(t *testing.T) {
	if vmgenidAddr%8 != 0 || vmgenidAddr < acpiBase || vmgenidAddr+vmgenidSize > acpiEnd {
		t.Fatalf("generation ID at %#x is not 8-byte aligned in the reserved ACPI area", vmgenidAddr)
	}
	if gedBase < powerBase+powerSize || gedBase+gedSize > ioapicAddr {
		t.Fatalf("GED at %#x overlaps another device", gedBase)
	}
	for _, g := range virtioGSIs() {
		if g == gedGSI || g == com1IRQ {
			t.Fatalf("GSI %d is taken twice", g)
		}
	}
}
