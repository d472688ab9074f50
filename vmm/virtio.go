package vmm

import (
	"errors"
	"fmt"
	"strings"

	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm/acpi"
)

// Virtio-mmio transports: device i has its registers at
// VirtioMMIOBase + i*virtio.MMIOSize and a level-triggered interrupt on the
// i-th GSI of virtioGSIs.
const (
	virtioFirstGSI = 5
	rtcIRQ         = 8 // the CMOS RTC's ISA interrupt, never a virtio one
)

// MaxVirtioDevices is the most virtio devices a VM takes: one per I/O APIC
// pin from virtioFirstGSI (5) to 23, the RTC's (8) excepted.
const MaxVirtioDevices = acpi.IOAPICPins - virtioFirstGSI - 1

// virtioGSIs returns the GSIs virtio devices get, in device order.
func virtioGSIs() []uint32 {
	var gsis []uint32
	for g := uint32(virtioFirstGSI); g < acpi.IOAPICPins; g++ {
		if g != rtcIRQ {
			gsis = append(gsis, g)
		}
	}
	return gsis
}

// virtioBase returns the guest-physical base of device i's registers.
func virtioBase(i int) uint64 { return VirtioMMIOBase + uint64(i)*virtio.MMIOSize }

// validateDevices checks Config.Devices.
func validateDevices(devs []virtio.Device) error {
	if len(devs) > MaxVirtioDevices {
		return fmt.Errorf("%d virtio devices: a VM takes at most %d", len(devs), MaxVirtioDevices)
	}
	for i, d := range devs {
		if d == nil {
			return fmt.Errorf("virtio device %d is nil", i)
		}
		if len(d.QueueSizes()) == 0 {
			return fmt.Errorf("virtio device %d (ID %d) has no queues", i, d.ID())
		}
	}
	if end := virtioBase(len(devs)); end > powerBase {
		return fmt.Errorf("%d virtio devices overflow the MMIO window", len(devs))
	}
	return nil
}

// setupVirtio puts a virtio-mmio transport in front of each configured
// device, on the MMIO bus and, where KVM allows, with ioeventfds for queue
// notifications.
func (v *VM) setupVirtio() error {
	gsis := virtioGSIs()
	kv := v.vm
	for i, d := range v.cfg.Devices {
		gsi, base := gsis[i], virtioBase(i)
		m := virtio.NewMMIO(d, v.mem, func(level bool) {
			if err := kv.IRQLine(gsi, level); err != nil {
				v.log.Warn("virtio interrupt", "gsi", gsi, "err", err)
			}
		})
		m.SetLogger(v.log.With("gsi", gsi))
		if err := v.mmio.Add(base, virtio.MMIOSize, m); err != nil {
			return fmt.Errorf("virtio device %d: %w", i, err)
		}
		v.virtio = append(v.virtio, m)
		if err := m.AttachIOEventFD(kv, base); err != nil {
			// Notifications still arrive as MMIO exits, only slower.
			v.log.Warn("virtio notifications without ioeventfd", "device", i, "err", err)
		}
	}
	return nil
}

// virtioACPI describes the transports in the DSDT.
func (v *VM) virtioACPI() []acpi.MMIODevice {
	gsis := virtioGSIs()
	var out []acpi.MMIODevice
	for i := range v.cfg.Devices {
		out = append(out, acpi.MMIODevice{Base: virtioBase(i), Size: virtio.MMIOSize, GSI: gsis[i]})
	}
	return out
}

// closeVirtio stops the devices and releases their ioeventfds; it runs
// before the KVM VM is closed.
func (v *VM) closeVirtio() error {
	var errs []error
	for _, m := range v.virtio {
		errs = append(errs, m.Close())
	}
	v.virtio = nil
	return errors.Join(errs...)
}

// virtioCmdline returns the virtio_mmio.device= parameters that describe n
// transports to a kernel that reads them from its command line.
func virtioCmdline(n int) string {
	var b strings.Builder
	gsis := virtioGSIs()
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, " virtio_mmio.device=%dK@%#x:%d", virtio.MMIOSize>>10, virtioBase(i), gsis[i])
	}
	return b.String()
}
