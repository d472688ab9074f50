package vmm

import (
	"fmt"
	"log/slog"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/memory"
)

// Check reports whether a VM can be restored from the state with cfg: the
// state is whole (Validate), the config is valid without a kernel, and both
// describe the same machine: vCPUs, memory, and virtio devices of the same
// types in the same order. Its errors name the difference ("snapshot has 2
// vCPUs, config asks for 1").
func (s *State) Check(cfg *Config) error {
	if err := s.Validate(); err != nil {
		return fmt.Errorf("snapshot state: %w", err)
	}
	if err := cfg.validateShape(); err != nil {
		return fmt.Errorf("vm config: %w", err)
	}
	return s.checkConfig(cfg)
}

// Restore builds a VM from a saved State over mem, guest RAM that holds
// the snapshot's memory (package snapshot maps the memory file
// copy-on-write, so that restores share the pages none of them wrote).
// It builds the machine as New does, without a kernel or boot setup: the
// KVM VM with mem as its memory slots, irqchip, PIT, COM1, a virtio
// transport for each of cfg.Devices (fresh devices of the types the
// snapshot had, in the same order), and vCPUs with the CPUID New computes;
// then it writes the saved state into all of them. cfg's Kernel, Initrd
// and Cmdline are not used. The guest continues with Run.
//
// Everything in st is checked against cfg and mem before KVM is touched;
// a mismatch is an error that names it. Restore owns mem from the call
// on: the VM closes it (Close), and Restore closes it when it fails.
func Restore(cfg Config, st *State, mem *memory.Memory) (_ *VM, err error) {
	if err := st.Check(&cfg); err != nil {
		closeMemory(mem)
		return nil, fmt.Errorf("restore: %w", err)
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
	v := newVM(cfg)
	v.mem = mem
	defer func() {
		if err != nil {
			v.Close()
		}
	}()
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
	for i, m := range v.virtio {
		if err = m.RestoreState(st.Devices[i]); err != nil {
			return nil, fmt.Errorf("restore: virtio device %d: %w", i, err)
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
