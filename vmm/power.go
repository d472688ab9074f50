package vmm

import (
	"github.com/kilnvm/kiln/vmm/acpi"
)

// Registers of the power device at powerBase, named in the FADT as the
// hardware-reduced ACPI sleep control/status and reset registers.
const (
	powerSleepControl = 0x0
	powerSleepStatus  = 0x1
	powerReset        = 0x2
	resetValue        = 0x42
)

// powerDevice turns guest writes to the ACPI power registers into a stop.
type powerDevice struct {
	stop func(Reason, string)
}

func (p *powerDevice) Read(offset uint64, data []byte) {
	for i := range data {
		data[i] = 0
	}
}

func (p *powerDevice) Write(offset uint64, data []byte) {
	if len(data) == 0 {
		return
	}
	v := data[0]
	switch offset {
	case powerSleepControl:
		// SLP_TYP in bits 4:2, SLP_EN in bit 5. S5 is soft-off.
		if v&acpi.SleepEnable != 0 && (v>>2)&7 == acpi.S5SleepType {
			p.stop(ReasonPowerOff, "guest powered off (ACPI S5)")
		}
	case powerReset:
		if v == resetValue {
			p.stop(ReasonReboot, "guest rebooted (ACPI reset register)")
		}
	}
}

// i8042 is the part of the PS/2 controller a kernel uses to reset the
// machine (reboot=k): a write of 0xfe to the command port.
type i8042 struct {
	stop func(Reason, string)
}

func (k *i8042) Read(offset uint64, data []byte) {
	for i := range data {
		data[i] = 0 // status: no data, input buffer empty
	}
}

func (k *i8042) Write(offset uint64, data []byte) {
	if offset == 4 && len(data) > 0 && data[0] == 0xfe {
		k.stop(ReasonReboot, "guest rebooted (i8042 reset)")
	}
}
