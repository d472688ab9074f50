package vmm

import (
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"

	"github.com/kilnvm/kiln/vmm/acpi"
)

// The Generic Event Device and the VM Generation ID (see acpi.GED and
// acpi.VMGenID): the host's way to tell a guest that it was restored or
// cloned, so that it reseeds its RNG, and to press its power button.
const (
	gedBase = powerBase + powerSize // the event selector register
	gedSize = 4
	gedGSI  = 3 // COM2's ISA line: Kiln has no COM2
	// vmgenidAddr holds the 16-byte generation ID, in the reserved BIOS
	// area above the ACPI tables.
	vmgenidAddr = acpiEnd - 0x1000
	vmgenidSize = 16
)

// gedDevice is the GED's event selector: a guest read returns the pending
// event bits and clears them.
type gedDevice struct {
	pulse func() // raises an edge on gedGSI

	mu      sync.Mutex
	pending uint32
}

func (g *gedDevice) Read(offset uint64, data []byte) {
	clear(data)
	if offset != 0 || len(data) != 4 {
		return
	}
	g.mu.Lock()
	binary.LittleEndian.PutUint32(data, g.pending)
	g.pending = 0
	g.mu.Unlock()
}

func (g *gedDevice) Write(offset uint64, data []byte) {}

// raise sets event bits and interrupts the guest.
func (g *gedDevice) raise(bits uint32) {
	g.mu.Lock()
	g.pending |= bits
	g.mu.Unlock()
	g.pulse()
}

// writeGenerationID puts a new random generation ID in guest memory.
func (v *VM) writeGenerationID() error {
	var id [vmgenidSize]byte
	if _, err := rand.Read(id[:]); err != nil {
		return fmt.Errorf("VM generation ID: %w", err)
	}
	if err := v.mem.WriteAt(id[:], vmgenidAddr); err != nil {
		return fmt.Errorf("VM generation ID: %w", err)
	}
	return nil
}

// NewGeneration gives the guest a new VM generation ID and tells it so: a
// Linux guest's vmgenid driver then reseeds its RNG at once, so that clones
// of one snapshot do not draw the same random numbers. Call it on a
// restored VM, before or while it runs.
func (v *VM) NewGeneration() error {
	if err := v.writeGenerationID(); err != nil {
		return err
	}
	v.ged.raise(acpi.GEDEventVMGenID)
	return nil
}

// PressPowerButton asks the guest to shut down gracefully (an ACPI power
// button event): its init powers the VM off when it is done.
func (v *VM) PressPowerButton() {
	v.ged.raise(acpi.GEDEventPowerButton)
}
