package kvm

import "unsafe"

// wordBytes returns the bytes of w, in memory order, as a slice that
// shares w's memory (the XSAVE areas are uint32 buffers for alignment;
// snapshots carry them as bytes).
func wordBytes(w []uint32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(w))), len(w)*4)
}
