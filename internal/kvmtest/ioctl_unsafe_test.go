package kvmtest

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// ioctlBuf issues an ioctl whose argument points at buf.
func ioctlBuf(fd int, req uintptr, buf []byte) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(unsafe.Pointer(&buf[0])))
	if errno != 0 {
		return errno
	}
	return nil
}

// addrOf is the host virtual address of b's first byte; b must be memory
// that the Go runtime does not move (an mmap).
func addrOf(b []byte) uint64 {
	return uint64(uintptr(unsafe.Pointer(&b[0])))
}
