package vmm

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
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

// validateDevices checks a VM's device specs (virtio.ValidateSpecs) and
// that they fit.
func validateDevices(devs []virtio.DeviceSpec) error {
	if len(devs) > MaxVirtioDevices {
		return fmt.Errorf("%d virtio devices: a VM takes at most %d", len(devs), MaxVirtioDevices)
	}
	if err := virtio.ValidateSpecs(devs); err != nil {
		return err
	}
	if end := virtioBase(len(devs)); end > powerBase {
		return fmt.Errorf("%d virtio devices overflow the MMIO window", len(devs))
	}
	return nil
}

// vdev is one of a VM's virtio devices: its spec, the device opened from
// it, and its transport.
type vdev struct {
	spec virtio.DeviceSpec
	dev  virtio.Device
	mmio *virtio.MMIO
	irq  *virtioIRQ
	ioev *ioEvents // nil where KVM refused them
}

// openDevices opens each device of v.specs (virtio.Open), before any KVM
// work: a missing image or tap is the caller's error (a *ConfigError),
// found first. setupVirtio attaches them.
func (v *VM) openDevices() error {
	for i, spec := range v.specs {
		dev, err := virtio.OpenWith(spec, virtio.OpenOptions{Logger: v.log, FS: v.cfg.OpenFS, VsockDial: v.cfg.VsockDial})
		if err != nil {
			return &ConfigError{Err: fmt.Errorf("virtio device %d (%s): %w", i, spec.ID, err)}
		}
		v.opened = append(v.opened, dev)
		if len(dev.QueueSizes()) == 0 {
			return &ConfigError{Err: fmt.Errorf("virtio device %d (%s) has no queues", i, spec.ID)}
		}
	}
	return nil
}

// setupVirtio puts a virtio-mmio transport in front of each opened
// device, on the MMIO bus and, where KVM allows, with ioeventfds for
// queue notifications. The VM, not the transport, wires the device to
// KVM: its irqfd and its ioeventfds.
func (v *VM) setupVirtio() error {
	gsis := virtioGSIs()
	if len(v.opened) != len(v.specs) {
		return fmt.Errorf("%d virtio devices opened of %d", len(v.opened), len(v.specs))
	}
	for i, spec := range v.specs {
		dev := v.opened[i]
		v.opened[i] = nil // the VM's devices own it now
		if err := v.attachVirtio(i, spec, dev, gsis[i]); err != nil {
			return err
		}
	}
	v.opened = nil
	return nil
}

// attachVirtio gives device i its transport, interrupt and notifications.
// The VM owns dev from the call on.
func (v *VM) attachVirtio(i int, spec virtio.DeviceSpec, dev virtio.Device, gsi uint32) error {
	base := virtioBase(i)
	irq := newVirtioIRQ(v.vm, gsi, v.log)
	m := virtio.NewMMIO(dev, v.mem, irq.set)
	m.SetLogger(v.log.With("gsi", gsi, "device_id", spec.ID))
	d := &vdev{spec: spec, dev: dev, mmio: m, irq: irq}
	v.devices = append(v.devices, d)
	if err := v.mmio.Add(base, virtio.MMIOSize, m); err != nil {
		return fmt.Errorf("virtio device %d (%s): %w", i, spec.ID, err)
	}
	ev, err := attachIOEvents(v.vm, m, base)
	if err != nil {
		// Notifications still arrive as MMIO exits, only slower.
		v.log.Warn("virtio notifications without ioeventfd", "device", spec.ID, "err", err)
	}
	d.ioev = ev
	return nil
}

// Device returns the VM's device with the given spec ID, or nil. It is
// the live device (a *virtio.Net, say) for callers that read its
// addresses or counters; the VM keeps owning it.
func (v *VM) Device(id string) virtio.Device {
	for _, d := range v.devices {
		if d.spec.ID == id {
			return d.dev
		}
	}
	return nil
}

// Devices returns the specs the VM's devices were opened from, in order;
// a volume slot that InsertDisk filled has its image's name as its path.
func (v *VM) Devices() []virtio.DeviceSpec {
	v.specMu.Lock()
	defer v.specMu.Unlock()
	out := make([]virtio.DeviceSpec, len(v.devices))
	for i, d := range v.devices {
		out[i] = d.spec
	}
	return out
}

// InsertDisk puts the image f into the VM's empty volume slot id (a disk
// of virtio.BlockSpec.Slot) and tells the guest the disk's config changed
// (a config-change interrupt): its driver reads the new capacity.
// readOnly makes the volume read-only (f may then be open O_RDONLY): the
// device answers the guest's writes with an I/O error. f.Name() names the
// image in the VM's specs (Devices) and snapshots, which then need it
// named to restore (as any disk). On success the VM owns f; on failure
// the caller keeps it. It waits for a lifecycle operation in progress (a
// save) and refuses a VM that has stopped.
func (v *VM) InsertDisk(id string, f *os.File, readOnly bool) error {
	if f == nil {
		return fmt.Errorf("insert disk %q: no image file given", id)
	}
	if err := v.lc.acquire(nil, "insert disk"); err != nil {
		return err
	}
	defer v.lc.release()
	if _, err := v.lc.check("insert disk", StateCreated, StateRunning, StatePaused); err != nil {
		return err
	}
	i := slices.IndexFunc(v.devices, func(d *vdev) bool { return d.spec.ID == id })
	if i < 0 {
		return fmt.Errorf("insert disk %q: the VM has no such device (it has %s)", id, specIDs(v.Devices()))
	}
	d := v.devices[i]
	b, ok := d.dev.(*virtio.Block)
	if !ok || d.spec.Kind != virtio.KindBlock || d.spec.Block == nil || !d.spec.Block.Slot {
		return fmt.Errorf("insert disk %q: the device is not a volume slot", id)
	}
	if err := b.Insert(f, readOnly, f.Name()); err != nil {
		return fmt.Errorf("insert disk %q: %w", id, err)
	}
	blk := *d.spec.Block
	blk.Path, blk.FD, blk.ReadOnly = f.Name(), 0, readOnly
	v.specMu.Lock()
	d.spec.Block = &blk
	v.specMu.Unlock()
	d.mmio.ConfigChanged()
	v.log.Debug("disk inserted", "device", id, "image", f.Name(), "read_only", readOnly)
	return nil
}

func closeDevice(d virtio.Device) error {
	if c, ok := d.(io.Closer); ok {
		return c.Close()
	}
	return nil
}

// virtioACPI describes the transports in the DSDT.
func (v *VM) virtioACPI() []acpi.MMIODevice {
	gsis := virtioGSIs()
	var out []acpi.MMIODevice
	for i := range v.specs {
		edge := i < len(v.devices) && v.devices[i].irq.edge
		out = append(out, acpi.MMIODevice{Base: virtioBase(i), Size: virtio.MMIOSize, GSI: gsis[i], Edge: edge})
	}
	return out
}

// closeVirtio stops the transports, releases their ioeventfds and irqfds
// and closes the devices; it runs before the KVM VM is closed.
func (v *VM) closeVirtio() error {
	var errs []error
	for _, d := range v.devices {
		errs = append(errs, d.ioev.close(), d.mmio.Close())
	}
	for _, d := range v.devices {
		errs = append(errs, d.irq.close(), closeDevice(d.dev))
	}
	v.devices = nil
	for _, d := range v.opened { // opened, never attached
		if d != nil {
			errs = append(errs, closeDevice(d))
		}
	}
	v.opened = nil
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
		for _, d := range v.devices {
			if d.irq.edge && d.mmio.InterruptPending(before) {
				v.irqResends.Add(1)
				d.irq.set(true)
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
	state := v.State()
	v.mu.Lock()
	fmt.Fprintf(&b, "vm: %s, %d of %d vCPUs parked, interrupts resent=%d, console bytes dropped=%d", state, v.parked, len(v.vcpus), v.irqResends.Load(), v.ConsoleDropped())
	devices := v.devices
	v.mu.Unlock()
	for i, c := range v.vcpus {
		fmt.Fprintf(&b, "\nvCPU %d: %d exits, running=%t", i, c.exits.Load(), c.tid.Load() != 0)
	}
	for i, d := range devices {
		fmt.Fprintf(&b, "\ntransport %d (%s) at %#x: %v", i, d.spec.ID, virtioBase(i), d.mmio.Diagnose())
	}
	return b.String()
}
