package bench

import "unsafe"

// sliceAddr is the address of b's first byte in this process.
func sliceAddr(b []byte) uintptr { return uintptr(unsafe.Pointer(unsafe.SliceData(b))) }
