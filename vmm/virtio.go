package vmm

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/kvm"
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
		irq := newVirtioIRQ(kv, gsi, v.log)
		v.virtioIRQs = append(v.virtioIRQs, irq)
		m := virtio.NewMMIO(d, v.mem, irq.set)
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
		edge := i < len(v.virtioIRQs) && v.virtioIRQs[i].edge
		out = append(out, acpi.MMIODevice{Base: virtioBase(i), Size: virtio.MMIOSize, GSI: gsis[i], Edge: edge})
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
	for _, irq := range v.virtioIRQs {
		errs = append(errs, irq.close())
	}
	v.virtioIRQs = nil
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

// virtioIRQ is one transport's interrupt. Normally an irqfd: the transport's
// rising edge (InterruptStatus going non-zero) becomes one eventfd write, which
// KVM injects as an edge on the GSI without a trip through the VMM; the DSDT
// then says edge-triggered. Where KVM refuses the irqfd, the VMM drives the
// line level-triggered with KVM_IRQ_LINE instead.
type virtioIRQ struct {
	vm   *kvm.VM
	gsi  uint32
	efd  int // -1 without irqfd
	edge bool
	log  *slog.Logger
}

func newVirtioIRQ(vm *kvm.VM, gsi uint32, log *slog.Logger) *virtioIRQ {
	q := &virtioIRQ{vm: vm, gsi: gsi, efd: -1, log: log}
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err == nil {
		if err = vm.IRQFD(&kvm.IRQFD{FD: uint32(efd), GSI: gsi}); err != nil {
			unix.Close(efd)
		}
	}
	if err != nil {
		log.Warn("virtio interrupt without irqfd, level-triggered through KVM_IRQ_LINE", "gsi", gsi, "err", err)
		return q
	}
	q.efd, q.edge = efd, true
	return q
}

var eventfdOne = []byte{1, 0, 0, 0, 0, 0, 0, 0}

// irqResendAfter is how long an edge-triggered virtio interrupt may stay
// unacknowledged before the VMM sends the edge again.
const irqResendAfter = 200 * time.Millisecond

// resendLostInterrupts sends an edge-triggered virtio interrupt again when
// the guest has not acknowledged it for irqResendAfter, until stop is
// closed. A device raises its edge only when InterruptStatus goes from zero
// to non-zero, so one edge lost on the way (seen under nested
// virtualization) would leave the driver waiting for ever while the device
// waits for the driver. A resent edge that was not lost costs the guest one
// interrupt that finds InterruptStatus set, as a shared line would.
func (v *VM) resendLostInterrupts(stop <-chan struct{}) {
	tick := time.NewTicker(irqResendAfter)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		v.mu.Lock()
		paused := v.paused // a snapshot reads the irqchip: leave it be
		v.mu.Unlock()
		if paused {
			continue
		}
		before := time.Now().Add(-irqResendAfter)
		for i, m := range v.virtio {
			if irq := v.virtioIRQs[i]; irq.edge && m.InterruptPending(before) {
				v.irqResends.Add(1)
				irq.set(true)
			}
		}
	}
}

// set follows the transport's interrupt level.
func (q *virtioIRQ) set(level bool) {
	if !q.edge {
		if err := q.vm.IRQLine(q.gsi, level); err != nil {
			q.log.Warn("virtio interrupt", "gsi", q.gsi, "err", err)
		}
		return
	}
	if !level {
		return // an edge needs no deassertion
	}
	// EAGAIN means the counter is already non-zero: an edge is pending.
	if _, err := unix.Write(q.efd, eventfdOne); err != nil && !errors.Is(err, unix.EAGAIN) {
		q.log.Warn("virtio interrupt", "gsi", q.gsi, "err", err)
	}
}

func (q *virtioIRQ) close() error {
	if q.efd < 0 {
		return nil
	}
	err := q.vm.IRQFD(&kvm.IRQFD{FD: uint32(q.efd), GSI: q.gsi, Flags: kvm.IRQFDFlagDeassign})
	if cerr := unix.Close(q.efd); err == nil {
		err = cerr
	}
	q.efd = -1
	return err
}

// Diagnose describes the VM's moving parts for a diagnosis when a guest
// seems stuck: each vCPU's exit count and each virtio transport's
// registers and queue indices. It does not pause the VM.
func (v *VM) Diagnose() string {
	var b strings.Builder
	v.mu.Lock()
	fmt.Fprintf(&b, "vm: paused=%t parked=%d stopping=%t interrupts resent=%d", v.paused, v.parked, v.stopping, v.irqResends.Load())
	transports := v.virtio
	v.mu.Unlock()
	for i, c := range v.vcpus {
		fmt.Fprintf(&b, "\nvCPU %d: %d exits, running=%t", i, c.exits.Load(), c.tid.Load() != 0)
	}
	for i, m := range transports {
		fmt.Fprintf(&b, "\ntransport %d at %#x: %v", i, virtioBase(i), m.Diagnose())
	}
	return b.String()
}
