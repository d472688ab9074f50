package vmm

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"testing"
)

// elfKernel writes a minimal ELF64 "kernel" whose only segment holds code at
// 1 MiB, entered in 64-bit mode. It lets tests drive the vCPU loop, devices
// and stop reasons without booting Linux.
func elfKernel(t testing.TB, code []byte) string {
	t.Helper()
	const (
		ehdrSize = 64
		phdrSize = 56
		load     = 0x100000
	)
	le := binary.LittleEndian
	b := make([]byte, ehdrSize+phdrSize, ehdrSize+phdrSize+len(code))
	copy(b, "\x7fELF\x02\x01\x01")
	le.PutUint16(b[16:], 2)    // ET_EXEC
	le.PutUint16(b[18:], 0x3e) // EM_X86_64
	le.PutUint32(b[20:], 1)
	le.PutUint64(b[24:], load) // e_entry
	le.PutUint64(b[32:], ehdrSize)
	le.PutUint16(b[52:], ehdrSize)
	le.PutUint16(b[54:], phdrSize)
	le.PutUint16(b[56:], 1)
	p := b[ehdrSize:]
	le.PutUint32(p[0:], 1) // PT_LOAD
	le.PutUint32(p[4:], 7)
	le.PutUint64(p[8:], ehdrSize+phdrSize) // p_offset
	le.PutUint64(p[16:], load)
	le.PutUint64(p[24:], load)
	le.PutUint64(p[32:], uint64(len(code)))
	le.PutUint64(p[40:], uint64(len(code)))
	b = append(b, code...)
	path := filepath.Join(t.TempDir(), "kernel.elf")
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// Guest programs for elfKernel.
var (
	// Prints "ok\n" on COM1, then writes S5|SLP_EN to the ACPI sleep register.
	codeHelloPowerOff = []byte{
		0x66, 0xba, 0xf8, 0x03, // mov dx, 0x3f8
		0xb0, 'o', 0xee, // mov al, 'o'; out dx, al
		0xb0, 'k', 0xee,
		0xb0, '\n', 0xee,
		0xb8, 0x00, 0x00, 0xb0, 0xfe, // mov eax, 0xfeb00000
		0xc6, 0x00, 0x34, // mov byte [rax], 0x34
		0xeb, 0xfe, // jmp $
	}
	// Spins forever.
	codeSpin = []byte{0xeb, 0xfe}
	// int3 with an empty IDT: #GP, #DF, then a triple fault.
	codeTripleFault = []byte{0xcc}
	// Resets through the i8042 command port.
	codeI8042Reset = []byte{0xb0, 0xfe, 0xe6, 0x64, 0xeb, 0xfe}
	// Counts in rbx forever, writing each value to COM1's scratch register.
	codeCount = []byte{
		0x66, 0xba, 0xff, 0x03, // mov dx, 0x3ff
		0x48, 0xff, 0xc3, // inc rbx
		0x88, 0xd8, // mov al, bl
		0xee,       // out dx, al
		0xeb, 0xf8, // jmp back to inc
	}
)
