package vmm

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/virtio"
	"github.com/kilnvm/kiln/vmm/serial"
)

// StateVersion is the version of State's form. A State of another version
// is refused by Restore.
const StateVersion = 2

// Bounds on what a State may hold, so that a damaged or hostile state is
// refused before it sizes an allocation.
const (
	maxXSaveSize   = 1 << 20 // the largest XSAVE area today is about 11 KiB
	maxStateMSRs   = 4096
	maxStateCPUID  = 256 // as many entries as KVM_SET_CPUID2 takes here
	lapicStateSize = 1024
	irqChipSize    = 512
	xsaveMinSize   = 4096
	maxXCRs        = 16
)

// State is a VM in a snapshot: everything but its RAM, whose contents the
// snapshot keeps beside it (see package snapshot). It is plain data and
// encodes as JSON (byte slices as base64). SaveState fills it; Restore
// checks it against the config and the memory it is given and builds a VM
// from it.
type State struct {
	// Version is StateVersion when saved.
	Version int `json:"version"`
	// The config's shape: a restore must ask for the same.
	CPUs      int `json:"cpus"`
	MemoryMiB int `json:"memory_mib"`
	// Memory is the RAM's layout: guest-physical regions, each at its
	// offset in the memory image (the regions follow each other there).
	Memory []MemoryRegion `json:"memory"`
	// VirtioVersion is virtio.StateVersion when saved.
	VirtioVersion int `json:"virtio_version"`
	// Devices holds each virtio device, in the order of its transport's
	// address: its spec (as saved) and its transport's and its own state.
	// A restore finds a device by its spec's ID.
	Devices []DeviceState `json:"devices"`
	// VCPUs holds each vCPU, in order of their IDs.
	VCPUs []VCPUState `json:"vcpus"`
	// Machine is the in-kernel interrupt controllers, PIT and clock.
	Machine MachineState `json:"machine"`
	// Serial is COM1's registers.
	Serial SerialState `json:"serial"`
}

// DeviceState is one virtio device in a State.
type DeviceState struct {
	// Spec is what the device was opened from, less descriptors
	// (virtio.DeviceSpec.Saved). A restore opens it again unless an
	// override of the same ID replaces it.
	Spec virtio.DeviceSpec `json:"spec"`
	// Transport is its virtio-mmio transport's registers and queues, with
	// the device's own state inside.
	Transport virtio.MMIOState `json:"transport"`
}

// MemoryRegion is one region of guest RAM in a State.
type MemoryRegion struct {
	GuestAddr uint64 `json:"guest_addr"`
	Size      uint64 `json:"size"`
	Offset    uint64 `json:"offset"` // where the region starts in the memory image
}

// MachineState is the VM-wide KVM state: the in-kernel PICs and IOAPIC
// (each the 512-byte chip area of struct kvm_irqchip), the PIT and the
// kvmclock.
type MachineState struct {
	PICMaster []byte        `json:"pic_master"`
	PICSlave  []byte        `json:"pic_slave"`
	IOAPIC    []byte        `json:"ioapic"`
	PIT       kvm.PITState2 `json:"pit"`
	Clock     kvm.ClockData `json:"clock"`
}

// SerialState is what a guest's driver programmed into COM1. Bytes of
// console input not yet read by the guest are not kept.
type SerialState struct {
	IER uint8 `json:"ier"`
	LCR uint8 `json:"lcr"`
	MCR uint8 `json:"mcr"`
	SCR uint8 `json:"scr"`
	DLL uint8 `json:"dll"`
	DLM uint8 `json:"dlm"`
}

// memoryState describes mem's regions as a State does.
func memoryState(mem *memory.Memory) []MemoryRegion {
	var out []MemoryRegion
	for _, r := range mem.Regions() {
		out = append(out, MemoryRegion{GuestAddr: r.GuestAddr, Size: r.Size, Offset: r.Offset})
	}
	return out
}

// Layout returns the memory layout the state describes, as memory.MapFile
// takes it.
func (s *State) Layout() memory.Layout {
	var l memory.Layout
	for _, r := range s.Memory {
		l = append(l, struct{ GuestAddr, Size uint64 }{r.GuestAddr, r.Size})
	}
	return l
}

// MemorySize returns the bytes of RAM the state describes.
func (s *State) MemorySize() uint64 {
	var n uint64
	for _, r := range s.Memory {
		n += r.Size
	}
	return n
}

// Validate checks that the state is whole and self-consistent: its
// version, shape, memory layout, and the size of every field KVM takes as
// a fixed-size area. It needs no KVM.
func (s *State) Validate() error {
	if s == nil {
		return errors.New("no state")
	}
	if s.Version != StateVersion {
		return fmt.Errorf("state version %d, this kiln restores version %d", s.Version, StateVersion)
	}
	if s.VirtioVersion != virtio.StateVersion {
		return fmt.Errorf("virtio state version %d, this kiln restores version %d", s.VirtioVersion, virtio.StateVersion)
	}
	if s.CPUs < 1 || s.CPUs > MaxCPUs {
		return fmt.Errorf("state has %d vCPUs: want 1 to %d", s.CPUs, MaxCPUs)
	}
	if s.MemoryMiB < MinMemoryMiB || s.MemoryMiB > MaxMemoryMiB {
		return fmt.Errorf("state has %d MiB of memory: want %d to %d", s.MemoryMiB, MinMemoryMiB, MaxMemoryMiB)
	}
	if err := checkLayout(s.Memory, s.MemoryMiB); err != nil {
		return err
	}
	if len(s.Devices) > MaxVirtioDevices {
		return fmt.Errorf("state has %d virtio devices: a VM takes at most %d", len(s.Devices), MaxVirtioDevices)
	}
	ids := map[string]bool{}
	for i, d := range s.Devices {
		// A saved spec may lack what only an override can give (the
		// path of a disk that was passed as a descriptor): Resolve
		// checks the specs whole, after the overrides.
		if ids[d.Spec.ID] {
			return fmt.Errorf("virtio device %d: ID %q used twice", i, d.Spec.ID)
		}
		ids[d.Spec.ID] = true
		if want := d.Spec.DeviceID(); want == 0 || want != d.Transport.DeviceID {
			return fmt.Errorf("virtio device %d (%q): a %q spec over a transport of a %s", i, d.Spec.ID, d.Spec.Kind, deviceName(d.Transport.DeviceID))
		}
	}
	if len(s.VCPUs) != s.CPUs {
		return fmt.Errorf("state has %d vCPUs but the state of %d", s.CPUs, len(s.VCPUs))
	}
	for i := range s.VCPUs {
		if err := s.VCPUs[i].validate(i); err != nil {
			return fmt.Errorf("vCPU %d: %w", i, err)
		}
	}
	m := &s.Machine
	for _, c := range []struct {
		name string
		b    []byte
	}{{"PIC master", m.PICMaster}, {"PIC slave", m.PICSlave}, {"IOAPIC", m.IOAPIC}} {
		if len(c.b) != irqChipSize {
			return fmt.Errorf("%s state is %d bytes, want %d", c.name, len(c.b), irqChipSize)
		}
	}
	return nil
}

// checkLayout checks a state's memory regions against the layout a VM of
// memMiB has.
func checkLayout(regions []MemoryRegion, memMiB int) error {
	want := memoryLayout(memMiB)
	if len(regions) != len(want) {
		return fmt.Errorf("state has %d memory regions, a VM of %d MiB has %d", len(regions), memMiB, len(want))
	}
	var off uint64
	for i, r := range regions {
		if r.GuestAddr != want[i].GuestAddr || r.Size != want[i].Size || r.Offset != off {
			return fmt.Errorf("memory region %d is %#x+%#x at offset %#x, a VM of %d MiB has %#x+%#x at offset %#x",
				i, r.GuestAddr, r.Size, r.Offset, memMiB, want[i].GuestAddr, want[i].Size, off)
		}
		off += r.Size
	}
	return nil
}

// Specs returns the specs of the state's devices, in order.
func (s *State) Specs() []virtio.DeviceSpec {
	out := make([]virtio.DeviceSpec, len(s.Devices))
	for i, d := range s.Devices {
		out[i] = d.Spec
	}
	return out
}

// Resolve returns the device specs a VM restored from the state opens:
// the state's own, each replaced by the override of the same ID. An
// override must name a device the state has, of the same kind, once; the
// result is validated as a VM's devices are.
func (s *State) Resolve(overrides []virtio.DeviceSpec) ([]virtio.DeviceSpec, error) {
	specs := s.Specs()
	used := map[string]bool{}
	for _, o := range overrides {
		if used[o.ID] {
			return nil, fmt.Errorf("override of device %q given twice", o.ID)
		}
		used[o.ID] = true
		i := slices.IndexFunc(specs, func(d virtio.DeviceSpec) bool { return d.ID == o.ID })
		if i < 0 {
			return nil, fmt.Errorf("override of device %q: the snapshot has no such device (it has %s)", o.ID, specIDs(specs))
		}
		if o.Kind != specs[i].Kind {
			return nil, fmt.Errorf("override of device %q: the snapshot's is a %s device, the override a %s one", o.ID, specs[i].Kind, o.Kind)
		}
		specs[i] = o
	}
	if err := validateDevices(specs); err != nil {
		return nil, err
	}
	return specs, nil
}

func specIDs(specs []virtio.DeviceSpec) string {
	if len(specs) == 0 {
		return "none"
	}
	ids := make([]string, len(specs))
	for i, d := range specs {
		ids[i] = fmt.Sprintf("%q", d.ID)
	}
	return strings.Join(ids, ", ")
}

// checkMemory checks that mem has the state's layout.
func (s *State) checkMemory(mem *memory.Memory) error {
	if mem == nil {
		return errors.New("no memory given")
	}
	got := mem.Regions()
	if len(got) != len(s.Memory) {
		return fmt.Errorf("memory has %d regions, the snapshot %d", len(got), len(s.Memory))
	}
	for i, r := range got {
		w := s.Memory[i]
		if r.GuestAddr != w.GuestAddr || r.Size != w.Size || r.Offset != w.Offset {
			return fmt.Errorf("memory region %d is %#x+%#x at offset %#x, the snapshot's is %#x+%#x at offset %#x",
				i, r.GuestAddr, r.Size, r.Offset, w.GuestAddr, w.Size, w.Offset)
		}
	}
	return nil
}

// deviceName names a virtio device ID for an error message.
func deviceName(id uint32) string {
	switch id {
	case virtio.IDNet:
		return "net device (ID 1)"
	case virtio.IDBlock:
		return "block device (ID 2)"
	case virtio.IDRNG:
		return "rng device (ID 4)"
	case virtio.IDVsock:
		return "vsock device (ID 19)"
	}
	return fmt.Sprintf("device of ID %d", id)
}

// SaveState returns the VM's state: every vCPU, the in-kernel irqchip, PIT
// and clock, COM1, and each virtio transport with its device. The VM must
// be paused (Pause). SaveState first pauses every virtio transport (their
// devices finish what they hold and take nothing new), so that the state
// and guest memory agree; it leaves them paused, and Resume resumes them
// with the vCPUs. Guest memory is not part of the State: copy it
// (Memory) before Resume, or use Checkpoint, which holds the VM paused
// until the copy is done.
//
// The VM is in the saving state meanwhile: a Resume, Pause, Fork or other
// save waits for SaveState to finish. A VM that is not paused when its
// turn comes is refused with a *StateError (ErrState).
func (v *VM) SaveState(ctx context.Context) (st *State, err error) {
	err = v.lc.save(ctx, "save state", false, func() error {
		st, err = v.saveState(ctx)
		return err
	})
	if err != nil {
		return nil, err
	}
	return st, nil
}

// saveState is SaveState's work, done in the saving state (the caller
// holds the lifecycle's turn, the vCPUs parked).
func (v *VM) saveState(ctx context.Context) (*State, error) {
	v.mu.Lock()
	v.devicesPaused = true
	v.mu.Unlock()

	for _, d := range v.devices {
		if err := d.mmio.Pause(ctx); err != nil {
			return nil, fmt.Errorf("save state: pause virtio device %s: %w", d.spec.ID, err)
		}
	}
	st := &State{
		Version:       StateVersion,
		CPUs:          v.cfg.CPUs,
		MemoryMiB:     v.cfg.MemoryMiB,
		Memory:        memoryState(v.mem),
		VirtioVersion: virtio.StateVersion,
	}
	for _, d := range v.devices {
		ms, err := d.mmio.SaveState()
		if err != nil {
			return nil, fmt.Errorf("save state: virtio device %s: %w", d.spec.ID, err)
		}
		st.Devices = append(st.Devices, DeviceState{Spec: d.spec.Saved(), Transport: ms})
	}
	msrs, err := v.stateMSRs()
	if err != nil {
		return nil, fmt.Errorf("save state: %w", err)
	}
	xsaveSize := v.xsaveSize()
	for _, c := range v.vcpus {
		vs, err := v.saveVCPU(c.kv, msrs, xsaveSize)
		if err != nil {
			return nil, fmt.Errorf("save state: %w", err)
		}
		st.VCPUs = append(st.VCPUs, vs)
	}
	if st.Machine, err = v.saveMachine(); err != nil {
		return nil, fmt.Errorf("save state: %w", err)
	}
	st.Serial = saveSerial(v.uart)
	v.log.Debug("vm state saved", "cpus", st.CPUs, "msrs", len(msrs), "devices", len(st.Devices))
	return st, nil
}

// resumeDevices undoes SaveState's pause of the virtio transports.
func (v *VM) resumeDevices() {
	for _, d := range v.devices {
		d.mmio.Resume()
	}
}

// saveMachine reads the in-kernel PICs, IOAPIC, PIT and kvmclock.
func (v *VM) saveMachine() (MachineState, error) {
	var m MachineState
	for _, c := range []struct {
		id  uint32
		dst *[]byte
	}{{kvm.IRQChipPICMaster, &m.PICMaster}, {kvm.IRQChipPICSlave, &m.PICSlave}, {kvm.IRQChipIOAPIC, &m.IOAPIC}} {
		chip, err := v.vm.IRQChip(c.id)
		if err != nil {
			return m, err
		}
		*c.dst = append([]byte(nil), chip.Chip[:]...)
	}
	var err error
	if m.PIT, err = v.vm.PIT2(); err != nil {
		return m, err
	}
	if m.Clock, err = v.vm.Clock(); err != nil {
		return m, err
	}
	return m, nil
}

// restoreMachine writes the in-kernel PICs, IOAPIC, PIT and kvmclock. The
// clock goes last, after the vCPUs' MSRs (kvmclock's pages among them).
func (v *VM) restoreMachine(m *MachineState) error {
	for _, c := range []struct {
		id  uint32
		src []byte
	}{{kvm.IRQChipPICMaster, m.PICMaster}, {kvm.IRQChipPICSlave, m.PICSlave}, {kvm.IRQChipIOAPIC, m.IOAPIC}} {
		chip := kvm.IRQChip{ChipID: c.id}
		copy(chip.Chip[:], c.src)
		if err := v.vm.SetIRQChip(&chip); err != nil {
			return err
		}
	}
	pit := m.PIT
	if err := v.vm.SetPIT2(&pit); err != nil {
		return err
	}
	// KVM_SET_CLOCK takes the clock's value alone: with KVM_CLOCK_REALTIME
	// it would add the wall time since the save, and kernels before 5.16
	// refuse any flag. The guest's clock continues where it stopped.
	clock := kvm.ClockData{Clock: m.Clock.Clock}
	return v.vm.SetClock(&clock)
}

// UART registers, as offsets from the base port.
const (
	uartData = 0
	uartIER  = 1
	uartLCR  = 3
	uartMCR  = 4
	uartSCR  = 7
	uartDLAB = 0x80
)

// saveSerial reads COM1's registers through its port interface, as the
// guest would: none of these reads has a side effect. The divisor latch is
// read with DLAB set and LCR put back after.
func saveSerial(u *serial.UART) SerialState {
	read := func(off uint64) uint8 {
		b := []byte{0}
		u.Read(off, b)
		return b[0]
	}
	var s SerialState
	s.LCR = read(uartLCR)
	u.Write(uartLCR, []byte{s.LCR | uartDLAB})
	s.DLL, s.DLM = read(uartData), read(uartIER)
	u.Write(uartLCR, []byte{s.LCR &^ uartDLAB})
	s.IER = read(uartIER)
	u.Write(uartLCR, []byte{s.LCR})
	s.MCR, s.SCR = read(uartMCR), read(uartSCR)
	return s
}

// restoreSerial programs a fresh COM1 as the state says. Enabling the
// transmit interrupt raises one, as on a real 16550: a driver that was
// waiting for it when the state was saved goes on sending.
func restoreSerial(u *serial.UART, s SerialState) {
	u.Write(uartLCR, []byte{uartDLAB})
	u.Write(uartData, []byte{s.DLL})
	u.Write(uartIER, []byte{s.DLM})
	u.Write(uartLCR, []byte{s.LCR &^ uartDLAB})
	u.Write(uartMCR, []byte{s.MCR})
	u.Write(uartSCR, []byte{s.SCR})
	u.Write(uartIER, []byte{s.IER})
	u.Write(uartLCR, []byte{s.LCR})
}
