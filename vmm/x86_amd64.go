package vmm

import (
	"encoding/binary"
	"fmt"
	"math/bits"

	"github.com/kilnvm/kiln/kvm"
	"github.com/kilnvm/kiln/memory"
)

// cpuidFor adapts KVM's supported CPUID to vCPU id of n: APIC IDs, topology
// (one socket, n cores, one thread each) and the hypervisor bit.
func cpuidFor(supported []kvm.CPUIDEntry, id, n int) []kvm.CPUIDEntry {
	out := append([]kvm.CPUIDEntry(nil), supported...)
	shift := uint32(bits.Len(uint(n - 1)))
	for i := range out {
		e := &out[i]
		switch e.Function {
		case 1:
			e.EBX = e.EBX&0x0000ffff | uint32(id)<<24 | uint32(n)<<16
			e.ECX |= 1 << 31 // running under a hypervisor
			if n > 1 {
				e.EDX |= 1 << 28 // HTT: EBX[23:16] is valid
			}
		case 4:
			// Intel cache topology: cores per package - 1 in EAX[31:26].
			e.EAX = e.EAX&0x03ffffff | uint32(n-1)<<26
		case 0xb, 0x1f:
			// Extended topology: level 0 SMT (1 thread), level 1 core (n).
			e.EDX = uint32(id)
			switch e.Index {
			case 0:
				e.EAX, e.EBX, e.ECX = 0, 1, 1<<8
			case 1:
				e.EAX, e.EBX, e.ECX = shift, uint32(n), 2<<8|1
			default:
				e.EAX, e.EBX, e.ECX = 0, 0, e.Index
			}
		case 0x80000008:
			// AMD: NC = cores - 1; ApicIdSize = 0 means derive from NC.
			e.ECX = e.ECX&^0xf0ff | uint32(n-1)
		case 0x8000001e:
			e.EAX = uint32(id)
			e.EBX = e.EBX&^0xffff | uint32(id)&0xff // one thread per compute unit
			e.ECX = 0
		}
	}
	return out
}

// MSR numbers set at boot.
const (
	msrIA32TSC         = 0x10
	msrIA32SysenterCS  = 0x174
	msrIA32SysenterESP = 0x175
	msrIA32SysenterEIP = 0x176
	msrIA32MiscEnable  = 0x1a0
	msrMTRRDefType     = 0x2ff
	msrSTAR            = 0xc0000081
	msrLSTAR           = 0xc0000082
	msrCSTAR           = 0xc0000083
	msrSyscallMask     = 0xc0000084
	msrKernelGSBase    = 0xc0000102
	miscEnableFastStr  = 1
	mtrrEnable         = 1 << 11
	mtrrTypeWriteBack  = 6
)

func bootMSRs() []kvm.MSREntry {
	return []kvm.MSREntry{
		{Index: msrIA32SysenterCS}, {Index: msrIA32SysenterESP}, {Index: msrIA32SysenterEIP},
		{Index: msrSTAR}, {Index: msrCSTAR}, {Index: msrKernelGSBase}, {Index: msrSyscallMask}, {Index: msrLSTAR},
		{Index: msrIA32TSC},
		{Index: msrIA32MiscEnable, Data: miscEnableFastStr},
		{Index: msrMTRRDefType, Data: mtrrEnable | mtrrTypeWriteBack},
	}
}

// GDT entries: the boot protocol wants __BOOT_CS = 0x10 and __BOOT_DS = 0x18.
var bootGDT = []uint64{
	0,                            // null
	0,                            // unused
	gdtEntry(0xa09b, 0, 0xfffff), // 0x10: 64-bit code
	gdtEntry(0xc093, 0, 0xfffff), // 0x18: data
	gdtEntry(0x808b, 0, 0xfffff), // 0x20: TSS
	gdtEntry(0xc09b, 0, 0xfffff), // 0x28: 32-bit code (PVH entry)
}

const (
	selCode64 = 0x10
	selData   = 0x18
	selTSS    = 0x20
	selCode32 = 0x28
)

func gdtEntry(flags uint16, base, limit uint32) uint64 {
	return uint64(base&0xff000000)<<32 | uint64(flags&0xf0ff)<<40 | uint64(limit&0x000f0000)<<32 |
		uint64(base&0x00ffffff)<<16 | uint64(limit&0x0000ffff)
}

// segmentFromGDT decodes a GDT entry into the form KVM_SET_SREGS takes.
func segmentFromGDT(entry uint64, sel uint16) kvm.Segment {
	base := uint64(entry>>16&0xffffff | entry>>56<<24)
	limit := uint32(entry&0xffff | entry>>48&0xf<<16)
	g := uint8(entry >> 55 & 1)
	if g == 1 {
		limit = limit<<12 | 0xfff
	}
	return kvm.Segment{
		Base: base, Limit: limit, Selector: sel,
		Type: uint8(entry >> 40 & 0xf), S: uint8(entry >> 44 & 1), DPL: uint8(entry >> 45 & 3),
		Present: uint8(entry >> 47 & 1), AVL: uint8(entry >> 52 & 1), L: uint8(entry >> 53 & 1),
		DB: uint8(entry >> 54 & 1), G: g, Unusable: uint8(1 - entry>>47&1),
	}
}

// writeBootTables writes the GDT, an empty IDT and identity-mapping page
// tables for the first 4 GiB (2 MiB pages).
func writeBootTables(mem *memory.Memory) error {
	le := binary.LittleEndian
	gdt := make([]byte, 8*len(bootGDT))
	for i, e := range bootGDT {
		le.PutUint64(gdt[8*i:], e)
	}
	if err := mem.WriteAt(gdt, gdtAddr); err != nil {
		return fmt.Errorf("write GDT: %w", err)
	}
	if err := mem.WriteAt(make([]byte, 8), idtAddr); err != nil {
		return fmt.Errorf("write IDT: %w", err)
	}
	pt := make([]byte, 0x6000) // PML4, PDPT, 4 PDs
	le.PutUint64(pt[0:], pdptAddr|0x3)
	for i := 0; i < 4; i++ {
		le.PutUint64(pt[0x1000+8*i:], uint64(pdAddr+0x1000*i)|0x3)
		for j := 0; j < 512; j++ {
			addr := uint64(i)<<30 | uint64(j)<<21
			le.PutUint64(pt[0x2000+0x1000*i+8*j:], addr|0x83) // present, writable, 2 MiB
		}
	}
	if err := mem.WriteAt(pt, pml4Addr); err != nil {
		return fmt.Errorf("write page tables: %w", err)
	}
	return nil
}

const (
	cr0PE   = 1 << 0
	cr0ET   = 1 << 4
	cr0PG   = 1 << 31
	cr4PAE  = 1 << 5
	eferLME = 1 << 8
	eferLMA = 1 << 10
)

// loadBootSegments points the segment registers, GDTR and IDTR at the boot
// GDT, with CS = the code selector given.
func loadBootSegments(s *kvm.Sregs, codeSel uint16) {
	data := segmentFromGDT(bootGDT[selData/8], selData)
	s.CS = segmentFromGDT(bootGDT[codeSel/8], codeSel)
	s.DS, s.ES, s.FS, s.GS, s.SS = data, data, data, data, data
	s.TR = segmentFromGDT(bootGDT[selTSS/8], selTSS)
	s.GDT = kvm.DTable{Base: gdtAddr, Limit: uint16(8*len(bootGDT) - 1)}
	s.IDT = kvm.DTable{Base: idtAddr, Limit: 7}
}

// setupLongMode puts a vCPU in 64-bit mode at entry with RSI = zero page.
func setupLongMode(v *kvm.VCPU, entry uint64) error {
	s, err := v.Sregs()
	if err != nil {
		return err
	}
	loadBootSegments(&s, selCode64)
	s.CR3 = pml4Addr
	s.CR4 |= cr4PAE
	// The reset CR0 has CD and NW set: caching off. A guest that starts past
	// firmware expects caches on (AMD's nested paging honours CD: with it set
	// the kernel's decompressor crawls at a few MB/s).
	s.CR0 = cr0PE | cr0PG | cr0ET
	s.EFER |= eferLME | eferLMA
	if err := v.SetSregs(&s); err != nil {
		return err
	}
	return v.SetRegs(&kvm.Regs{RIP: entry, RSI: zeroPageAddr, RSP: bootStack, RBP: bootStack, RFLAGS: 2})
}

// setupPVH puts a vCPU in 32-bit protected mode, paging off, at the PVH entry
// with EBX = the hvm_start_info address.
func setupPVH(v *kvm.VCPU, entry uint64) error {
	s, err := v.Sregs()
	if err != nil {
		return err
	}
	loadBootSegments(&s, selCode32)
	s.CR0 = cr0PE | cr0ET
	s.CR4 = 0
	s.EFER = 0
	if err := v.SetSregs(&s); err != nil {
		return err
	}
	return v.SetRegs(&kvm.Regs{RIP: entry, RBX: pvhInfoAddr, RFLAGS: 2})
}

// setupFPU gives the vCPU the x87/SSE reset state.
func setupFPU(v *kvm.VCPU) error {
	return v.SetFPU(&kvm.FPU{FCW: 0x37f, MXCSR: 0x1f80})
}

// LAPIC local vector table registers and delivery modes.
const (
	apicLVT0     = 0x350
	apicLVT1     = 0x360
	apicModeNMI  = 4
	apicModeExtI = 7
)

// setupLAPIC routes LINT0 to ExtINT (the PIC) and LINT1 to NMI, as firmware does.
func setupLAPIC(v *kvm.VCPU) error {
	l, err := v.LAPIC()
	if err != nil {
		return err
	}
	set := func(reg int, mode uint32) {
		val := binary.LittleEndian.Uint32(l.Regs[reg:])
		val = val&^0x700 | mode<<8
		binary.LittleEndian.PutUint32(l.Regs[reg:], val)
	}
	set(apicLVT0, apicModeExtI)
	set(apicLVT1, apicModeNMI)
	return v.SetLAPIC(&l)
}
