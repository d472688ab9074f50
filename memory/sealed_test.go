package memory

import (
	"bytes"
	"io"
	"testing"

	"golang.org/x/sys/unix"
)

func TestNewSealed(t *testing.T) {
	const size = 4 << 20
	page := bytes.Repeat([]byte{0xa5}, pageSize)
	fd, err := NewSealed("sealed-test", size, func(w io.WriterAt) error {
		_, err := w.WriteAt(page, 3*pageSize)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := CheckSealed(fd, size); err != nil {
		t.Fatal(err)
	}
	if err := CheckSealed(fd, size+pageSize); err == nil {
		t.Fatal("CheckSealed took the wrong size")
	}
	// Nothing changes it: not a write, a truncation, a growth, new
	// seals removed, or a shared writable mapping.
	if _, err := unix.Pwrite(fd, []byte{1}, 0); err == nil {
		t.Error("wrote to a sealed image")
	}
	if err := unix.Ftruncate(fd, pageSize); err == nil {
		t.Error("shrank a sealed image")
	}
	if err := unix.Ftruncate(fd, 2*size); err == nil {
		t.Error("grew a sealed image")
	}
	if b, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); err == nil {
		unix.Munmap(b)
		t.Error("mapped a sealed image shared and writable")
	}
	// Guest memory maps it copy-on-write: its writes are its own.
	dup, _ := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	m, err := MapFile(dup, Layout{{GuestAddr: 0, Size: size}}, true)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if !bytes.Equal(m.Host(0)[3*pageSize:4*pageSize], page) || m.Host(0)[0] != 0 {
		t.Fatal("the mapping does not hold what was filled in")
	}
	m.Host(0)[3*pageSize] = 0
	b := make([]byte, 1)
	if _, err := unix.Pread(fd, b, 3*pageSize); err != nil || b[0] != 0xa5 {
		t.Fatalf("a write to the mapping reached the image: %v %#x", err, b[0])
	}
	unix.Close(fd)

	// Unsealed memfds and bad sizes are refused.
	raw, _ := unix.MemfdCreate("raw", unix.MFD_CLOEXEC)
	defer unix.Close(raw)
	if err := CheckSealed(raw, 0); err == nil {
		t.Error("an unsealed memfd passed CheckSealed")
	}
	if _, err := NewSealed("bad", 100, func(io.WriterAt) error { return nil }); err == nil {
		t.Error("a sealed image of 100 bytes")
	}
	if _, err := NewSealed("bad", size, func(w io.WriterAt) error { _, err := w.WriteAt(page, size-10); return err }); err == nil {
		t.Error("a write past the end was taken")
	}
}
