package vmm

import (
	"fmt"
	"io"
	"log/slog"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/memory"
	"github.com/kilnvm/kiln/seccomp"
	"github.com/kilnvm/kiln/virtio"
)

// RestoreConfig says what a VM restored from a State is connected to. The
// machine itself (vCPUs, memory, devices) comes from the state.
type RestoreConfig struct {
	// Devices override the state's devices of the same IDs and kinds: a
	// new tap, a new vsock socket, another path for a disk. The state's
	// other devices are opened from their saved specs.
	Devices []virtio.DeviceSpec

	Console io.Writer       // serial console output; discarded when nil
	KVMPath string          // /dev/kvm when empty
	Logger  *slog.Logger    // slog.Default() when nil
	OpenFS  virtio.FSOpener // as Config.OpenFS
	// VsockDial is as Config.VsockDial.
	VsockDial virtio.VsockDialer
	// HoldProcs is as Config.HoldProcs.
	HoldProcs bool
	// VCPUSeccomp is as Config.VCPUSeccomp.
	VCPUSeccomp seccomp.Mode
}

// Check reports whether a VM can be restored from the state with cfg, and
// returns the device specs it would open: the state is whole (Validate)
// and cfg's overrides each replace one of its devices (State.Resolve).
// Its errors name what is wrong.
func (s *State) Check(cfg *RestoreConfig) ([]virtio.DeviceSpec, error) {
	if err := s.Validate(); err != nil {
		return nil, fmt.Errorf("snapshot state: %w", err)
	}
	specs, err := s.Resolve(cfg.Devices)
	if err != nil {
		return nil, fmt.Errorf("snapshot devices: %w", err)
	}
	return specs, nil
}

// Restore builds a VM from a saved State over mem, guest RAM that holds
// the snapshot's memory (package snapshot maps the memory file
// copy-on-write, so that restores share the pages none of them wrote).
// It builds the machine as New does, without a kernel or boot setup: the
// KVM VM with mem as its memory slots, irqchip, PIT, COM1, the state's
// virtio devices (each opened from its saved spec or from cfg's override
// of it) behind transports at the addresses the guest knows, and vCPUs
// with the CPUID New computes; then it writes the saved state into all of
// them. The guest continues with Run.
//
// Everything in st is checked against cfg and mem before KVM is touched;
// a mismatch is an error that names it. Restore owns mem from the call
// on: the VM closes it (Close), and Restore closes it when it fails.
func Restore(cfg RestoreConfig, st *State, mem *memory.Memory) (_ *VM, err error) {
	specs, err := st.Check(&cfg)
	if err != nil {
		closeMemory(mem)
		return nil, fmt.Errorf("restore: %w", &ConfigError{Err: err})
	}
	if err := st.checkMemory(mem); err != nil {
		closeMemory(mem)
		return nil, fmt.Errorf("restore: %w", err)
	}
	if cfg.KVMPath == "" {
		cfg.KVMPath = kvm.DevicePath
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	v := newVM(Config{
		Spec:    Spec{CPUs: st.CPUs, MemoryMiB: st.MemoryMiB, Devices: specs},
		Console: cfg.Console, KVMPath: cfg.KVMPath, Logger: cfg.Logger, OpenFS: cfg.OpenFS, VsockDial: cfg.VsockDial,
		HoldProcs: cfg.HoldProcs, VCPUSeccomp: cfg.VCPUSeccomp,
	})
	v.mem = mem
	defer func() {
		if err != nil {
			v.Close()
		}
	}()
	if err = v.openDevices(); err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	if err = v.setupMachine(); err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	if err = v.createVCPUs(); err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	xsaveSize := v.xsaveSize()
	for i, c := range v.vcpus {
		vs := &st.VCPUs[i]
		if err = v.restoreVCPU(c.kv, vs, xsaveSize); err != nil {
			return nil, fmt.Errorf("restore: vCPU %d: %w", i, err)
		}
		// Compared after the state is in: KVM derives some CPUID bits
		// (OSXSAVE, OSPKE, the XSAVE sizes) from CR4, XCR0 and MSRs.
		if cur, err := c.kv.CPUID(); err == nil && len(vs.CPUID) > 0 {
			if d := cpuidDiff(vs.CPUID, cur); d != "" {
				v.log.Warn("restored vCPU's CPUID differs from the snapshot's: the guest may use features this host lacks", "vcpu", i, "difference", d)
			}
		}
	}
	if err = v.restoreMachine(&st.Machine); err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	restoreSerial(v.uart, st.Serial)
	for i, d := range v.devices {
		if err = d.mmio.RestoreState(st.Devices[i].Transport); err != nil {
			return nil, fmt.Errorf("restore: virtio device %s: %w", d.spec.ID, err)
		}
	}
	for _, c := range v.vcpus {
		// Tell kvmclock the guest was stopped, so that its watchdogs do not
		// count the time as a lockup. EINVAL without kvmclock: harmless.
		if err := c.kv.KVMClockCtrl(); err != nil {
			v.log.Debug("KVM_KVMCLOCK_CTRL", "vcpu", c.kv.ID(), "err", err)
		}
	}
	// Every restored VM is a new generation: the guest reseeds its RNG
	// (through its vmgenid driver) before it hands out another number
	// that a sibling restored from the same snapshot would also give.
	if err = v.NewGeneration(); err != nil {
		return nil, fmt.Errorf("restore: %w", err)
	}
	v.log.Debug("vm restored", "cpus", st.CPUs, "memory_mib", st.MemoryMiB, "devices", len(st.Devices))
	return v, nil
}

func closeMemory(mem *memory.Memory) {
	if mem != nil {
		mem.Close()
	}
}
