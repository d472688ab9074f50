//go:build amd64

package kvmtest

import (
	"encoding/binary"
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

// Raw KVM ioctl numbers and layouts (linux/kvm.h, x86), so this smoke test of
// the harness depends on nothing else in Kiln.
const (
	kvmCreateVM              = 0xAE01
	kvmSetUserMemoryRegion   = 0x4020AE46
	kvmCreateVCPU            = 0xAE41
	kvmGetVCPUMmapSize       = 0xAE04
	kvmGetSregs              = 0x8138AE83
	kvmSetSregs              = 0x4138AE84
	kvmSetRegs               = 0x4090AE82
	kvmRun                   = 0xAE80
	kvmExitIO                = 2
	kvmExitHLT               = 5
	kvmExitIOOut             = 1
	sregsSize, regsSize      = 312, 144
	runExitReason, runIO     = 8, 32
	regsRIP, regsRFLAGS      = 128, 136
	segBase, segSelector     = 0, 12
	guestMemSize, guestEntry = 0x10000, 0x1000
)

// smokeCode is real-mode code: mov dx,0x3f8; mov al,'K'; out dx,al; hlt.
var smokeCode = [...]byte{0xBA, 0xF8, 0x03, 0xB0, 'K', 0xEE, 0xF4}

// TestKVMSmoke runs a few bytes of real-mode code in a raw KVM VM: one
// memory slot, one vCPU, an OUT to the serial port, then HLT.
func TestKVMSmoke(t *testing.T) {
	Require(t)
	le := binary.LittleEndian

	kvm, err := unix.Open("/dev/kvm", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(kvm)
	vm, err := unix.IoctlRetInt(kvm, kvmCreateVM)
	if err != nil {
		t.Fatalf("KVM_CREATE_VM: %v", err)
	}
	defer unix.Close(vm)

	mem, err := unix.Mmap(-1, 0, guestMemSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	copy(mem[guestEntry:], smokeCode[:])
	region := make([]byte, 32) // slot, flags, guest_phys_addr, memory_size, userspace_addr
	le.PutUint64(region[16:], guestMemSize)
	le.PutUint64(region[24:], addrOf(mem))
	if err := ioctlBuf(vm, kvmSetUserMemoryRegion, region); err != nil {
		t.Fatalf("KVM_SET_USER_MEMORY_REGION: %v", err)
	}

	vcpu, err := unix.IoctlRetInt(vm, kvmCreateVCPU)
	if err != nil {
		t.Fatalf("KVM_CREATE_VCPU: %v", err)
	}
	defer unix.Close(vcpu)
	runSize, err := unix.IoctlRetInt(kvm, kvmGetVCPUMmapSize)
	if err != nil {
		t.Fatalf("KVM_GET_VCPU_MMAP_SIZE: %v", err)
	}
	run, err := unix.Mmap(vcpu, 0, runSize, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(run)

	sregs := make([]byte, sregsSize)
	if err := ioctlBuf(vcpu, kvmGetSregs, sregs); err != nil {
		t.Fatalf("KVM_GET_SREGS: %v", err)
	}
	le.PutUint64(sregs[segBase:], 0) // cs is the first segment
	le.PutUint16(sregs[segSelector:], 0)
	if err := ioctlBuf(vcpu, kvmSetSregs, sregs); err != nil {
		t.Fatalf("KVM_SET_SREGS: %v", err)
	}
	regs := make([]byte, regsSize)
	le.PutUint64(regs[regsRIP:], guestEntry)
	le.PutUint64(regs[regsRFLAGS:], 0x2)
	if err := ioctlBuf(vcpu, kvmSetRegs, regs); err != nil {
		t.Fatalf("KVM_SET_REGS: %v", err)
	}

	runOnce := func() uint32 {
		t.Helper()
		for {
			_, err := unix.IoctlRetInt(vcpu, kvmRun)
			if errors.Is(err, unix.EINTR) {
				continue
			}
			if err != nil {
				t.Fatalf("KVM_RUN: %v", err)
			}
			return le.Uint32(run[runExitReason:])
		}
	}

	if reason := runOnce(); reason != kvmExitIO {
		t.Fatalf("first exit reason %d, want KVM_EXIT_IO (%d)", reason, kvmExitIO)
	}
	io := run[runIO:]
	dir, size, port, count, off := io[0], io[1], le.Uint16(io[2:]), le.Uint32(io[4:]), le.Uint64(io[8:])
	if dir != kvmExitIOOut || size != 1 || port != 0x3f8 || count != 1 {
		t.Fatalf("io exit: direction %d size %d port %#x count %d, want out, 1 byte, 0x3f8, 1", dir, size, port, count)
	}
	if off >= uint64(len(run)) {
		t.Fatalf("io data offset %d outside the %d-byte kvm_run", off, len(run))
	}
	if got := run[off]; got != 'K' {
		t.Fatalf("guest wrote %q to the serial port, want 'K'", got)
	}
	if reason := runOnce(); reason != kvmExitHLT {
		t.Fatalf("second exit reason %d, want KVM_EXIT_HLT (%d)", reason, kvmExitHLT)
	}
}
