package kvm

import (
	"errors"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ioctl numbers are built like the kernel's _IO/_IOR/_IOW/_IOWR macros.
const (
	kvmio        = 0xAE
	iocNone      = 0
	iocWrite     = 1
	iocRead      = 2
	iocNRShift   = 0
	iocTypeShift = 8
	iocSizeShift = 16
	iocDirShift  = 30
)

func ioc(dir, nr, size uintptr) uintptr {
	return dir<<iocDirShift | kvmio<<iocTypeShift | nr<<iocNRShift | size<<iocSizeShift
}
func io(nr uintptr) uintptr         { return ioc(iocNone, nr, 0) }
func ior(nr, size uintptr) uintptr  { return ioc(iocRead, nr, size) }
func iow(nr, size uintptr) uintptr  { return ioc(iocWrite, nr, size) }
func iowr(nr, size uintptr) uintptr { return ioc(iocRead|iocWrite, nr, size) }

// ioctl issues an ioctl with an integer argument, retrying on EINTR.
func ioctl(fd int, req, arg uintptr) (uintptr, error) {
	for {
		r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, arg)
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return r, errno
		}
		return r, nil
	}
}

// ioctlPtr issues an ioctl whose argument is a pointer to p, retrying on EINTR.
func ioctlPtr(fd int, req uintptr, p unsafe.Pointer) (uintptr, error) {
	for {
		r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(p))
		if errno == unix.EINTR {
			continue
		}
		if errno != 0 {
			return r, errno
		}
		return r, nil
	}
}

// ioctlPtrOnce issues an ioctl once and reports EINTR to the caller (KVM_RUN).
func ioctlPtrOnce(fd int, req uintptr, arg uintptr) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, arg)
	if errno != 0 {
		return errno
	}
	return nil
}

// ioctlRawOnce is ioctlPtrOnce as a raw system call, which the Go
// scheduler does not see (VCPU.SetHoldP).
func ioctlRawOnce(fd int, req uintptr, arg uintptr) error {
	_, _, errno := unix.RawSyscall(unix.SYS_IOCTL, uintptr(fd), req, arg)
	if errno != 0 {
		return errno
	}
	return nil
}

// isEINTR reports whether err is EINTR.
func isEINTR(err error) bool { return errors.Is(err, unix.EINTR) }

// ioctlRef issues an ioctl whose argument is the address of *p (a struct
// laid out like the kernel's, or the first element of a buffer), retrying
// on EINTR. It is how the typed wrappers pass their arguments without
// unsafe of their own.
func ioctlRef[T any](fd int, req uintptr, p *T) (uintptr, error) {
	return ioctlPtr(fd, req, unsafe.Pointer(p))
}
