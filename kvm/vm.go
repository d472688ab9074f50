package kvm

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// VM is a KVM virtual machine file descriptor.
type VM struct {
	fd      int
	runSize int
}

// FD returns the VM's file descriptor.
func (vm *VM) FD() int { return vm.fd }

// Close closes the VM. Its vCPUs must be closed first for the kernel to free it.
func (vm *VM) Close() error { return unix.Close(vm.fd) }

// CheckExtension returns KVM_CHECK_EXTENSION on the VM fd (0: absent).
func (vm *VM) CheckExtension(capability int) int {
	r, err := ioctl(vm.fd, reqCheckExtension, uintptr(capability))
	if err != nil {
		return 0
	}
	return int(r)
}

// SetUserMemoryRegion maps host memory into the guest's physical address space.
func (vm *VM) SetUserMemoryRegion(r *UserspaceMemoryRegion) error {
	if _, err := ioctlRef(vm.fd, reqSetUserMemoryRegion, r); err != nil {
		return fmt.Errorf("KVM_SET_USER_MEMORY_REGION slot %d at %#x (+%#x): %w", r.Slot, r.GuestPhysAddr, r.MemorySize, err)
	}
	return nil
}

// SetTSSAddr places the three-page TSS region (Intel VMX needs it; harmless on AMD).
func (vm *VM) SetTSSAddr(addr uint64) error {
	if _, err := ioctl(vm.fd, reqSetTSSAddr, uintptr(addr)); err != nil {
		return fmt.Errorf("KVM_SET_TSS_ADDR %#x: %w", addr, err)
	}
	return nil
}

// SetIdentityMapAddr places the one-page identity map (Intel VMX real mode).
func (vm *VM) SetIdentityMapAddr(addr uint64) error {
	a := addr
	if _, err := ioctlRef(vm.fd, reqSetIdentityMapAddr, &a); err != nil {
		return fmt.Errorf("KVM_SET_IDENTITY_MAP_ADDR %#x: %w", addr, err)
	}
	return nil
}

// CreateIRQChip creates the in-kernel PIC, IOAPIC and local APICs.
func (vm *VM) CreateIRQChip() error {
	if _, err := ioctl(vm.fd, reqCreateIRQChip, 0); err != nil {
		return fmt.Errorf("KVM_CREATE_IRQCHIP: %w", err)
	}
	return nil
}

// CreatePIT2 creates the in-kernel i8254 PIT.
func (vm *VM) CreatePIT2(cfg *PITConfig) error {
	if _, err := ioctlRef(vm.fd, reqCreatePIT2, cfg); err != nil {
		return fmt.Errorf("KVM_CREATE_PIT2: %w", err)
	}
	return nil
}

// IRQLine sets the level of an interrupt line of the in-kernel irqchip.
func (vm *VM) IRQLine(irq uint32, level bool) error {
	l := IRQLevel{IRQ: irq}
	if level {
		l.Level = 1
	}
	if _, err := ioctlRef(vm.fd, reqIRQLine, &l); err != nil {
		return fmt.Errorf("KVM_IRQ_LINE %d=%d: %w", irq, l.Level, err)
	}
	return nil
}

// IRQFD makes a write to the eventfd raise the given GSI (or removes that
// binding when IRQFDFlagDeassign is set).
func (vm *VM) IRQFD(f *IRQFD) error {
	if _, err := ioctlRef(vm.fd, reqIRQFD, f); err != nil {
		return fmt.Errorf("KVM_IRQFD fd %d gsi %d: %w", f.FD, f.GSI, err)
	}
	return nil
}

// IOEventFD makes a guest write to an MMIO or PIO address signal an eventfd
// without a userspace exit (or removes it with IOEventFDFlagDeassign).
func (vm *VM) IOEventFD(f *IOEventFD) error {
	if _, err := ioctlRef(vm.fd, reqIOEventFD, f); err != nil {
		return fmt.Errorf("KVM_IOEVENTFD addr %#x len %d: %w", f.Addr, f.Len, err)
	}
	return nil
}

// Clock returns the guest's kvmclock.
func (vm *VM) Clock() (ClockData, error) {
	var c ClockData
	if _, err := ioctlRef(vm.fd, reqGetClock, &c); err != nil {
		return c, fmt.Errorf("KVM_GET_CLOCK: %w", err)
	}
	return c, nil
}

// SetClock sets the guest's kvmclock.
func (vm *VM) SetClock(c *ClockData) error {
	if _, err := ioctlRef(vm.fd, reqSetClock, c); err != nil {
		return fmt.Errorf("KVM_SET_CLOCK: %w", err)
	}
	return nil
}

// IRQChip reads the state of one in-kernel interrupt controller (chip id set in c).
func (vm *VM) IRQChip(chipID uint32) (IRQChip, error) {
	c := IRQChip{ChipID: chipID}
	if _, err := ioctlRef(vm.fd, reqGetIRQChip, &c); err != nil {
		return c, fmt.Errorf("KVM_GET_IRQCHIP %d: %w", chipID, err)
	}
	return c, nil
}

// SetIRQChip writes the state of one in-kernel interrupt controller.
func (vm *VM) SetIRQChip(c *IRQChip) error {
	if _, err := ioctlRef(vm.fd, reqSetIRQChip, c); err != nil {
		return fmt.Errorf("KVM_SET_IRQCHIP %d: %w", c.ChipID, err)
	}
	return nil
}

// PIT2 reads the in-kernel PIT's state.
func (vm *VM) PIT2() (PITState2, error) {
	var p PITState2
	if _, err := ioctlRef(vm.fd, reqGetPIT2, &p); err != nil {
		return p, fmt.Errorf("KVM_GET_PIT2: %w", err)
	}
	return p, nil
}

// SetPIT2 writes the in-kernel PIT's state.
func (vm *VM) SetPIT2(p *PITState2) error {
	if _, err := ioctlRef(vm.fd, reqSetPIT2, p); err != nil {
		return fmt.Errorf("KVM_SET_PIT2: %w", err)
	}
	return nil
}

// EnableCap enables a VM capability.
func (vm *VM) EnableCap(c *EnableCap) error {
	if _, err := ioctlRef(vm.fd, reqEnableCap, c); err != nil {
		return fmt.Errorf("KVM_ENABLE_CAP %d: %w", c.Cap, err)
	}
	return nil
}

// CreateVCPU creates vCPU id and maps its kvm_run page.
func (vm *VM) CreateVCPU(id int) (*VCPU, error) {
	fd, err := ioctl(vm.fd, reqCreateVCPU, uintptr(id))
	if err != nil {
		return nil, fmt.Errorf("KVM_CREATE_VCPU %d: %w", id, err)
	}
	run, err := unix.Mmap(int(fd), 0, vm.runSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		unix.Close(int(fd))
		return nil, fmt.Errorf("mmap kvm_run of vCPU %d: %w", id, err)
	}
	return &VCPU{id: id, fd: int(fd), run: run}, nil
}
