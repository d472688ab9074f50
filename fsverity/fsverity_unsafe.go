package fsverity

import (
	"encoding/binary"
	"unsafe"

	"golang.org/x/sys/unix"
)

// enable is FS_IOC_ENABLE_VERITY with Kiln's parameters.
func enable(fd int) error {
	arg := unix.FsverityEnableArg{Version: 1, Hash_algorithm: hashSHA256, Block_size: blockSize}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.FS_IOC_ENABLE_VERITY, uintptr(unsafe.Pointer(&arg)))
	if errno != 0 {
		return errno
	}
	return nil
}

// measure is FS_IOC_MEASURE_VERITY: struct fsverity_digest (le16
// algorithm, le16 size, then the digest), asked for up to 64 bytes.
func measure(fd int) (Digest, uint16, error) {
	var d Digest
	var buf [4 + 64]byte
	binary.NativeEndian.PutUint16(buf[2:], 64)
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.FS_IOC_MEASURE_VERITY, uintptr(unsafe.Pointer(&buf[0])))
	if errno != 0 {
		return d, 0, errno
	}
	alg := binary.NativeEndian.Uint16(buf[0:])
	if size := binary.NativeEndian.Uint16(buf[2:]); int(size) != len(d) {
		return d, alg, unix.EINVAL
	}
	copy(d[:], buf[4:])
	return d, alg, nil
}
