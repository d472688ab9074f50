//go:build linux

package agent

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// addEntropyIoctl issues RNDADDENTROPY on fd (an open /dev/urandom) with
// info, a struct rand_pool_info laid out by randPoolInfo.
func addEntropyIoctl(fd int, info []byte) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0])))
	if errno != 0 {
		return errno
	}
	return nil
}
