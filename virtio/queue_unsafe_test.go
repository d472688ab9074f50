package virtio

import (
	"testing"
	"unsafe"

	"github.com/kilnvm/kiln/memory"
)

// vqCheckInRAM checks that b lies inside one region of guest memory.
func vqCheckInRAM(t *testing.T, mem *memory.Memory, b []byte) {
	t.Helper()
	if !vqInRAM(mem, b) {
		t.Fatalf("buffer of %d bytes at host %p is outside guest memory", len(b), unsafe.SliceData(b))
	}
}

func vqInRAM(mem *memory.Memory, b []byte) bool {
	if len(b) == 0 {
		return true
	}
	p := uintptr(unsafe.Pointer(unsafe.SliceData(b)))
	for i, r := range mem.Regions() {
		base := mem.HostAddr(i)
		if p >= base && p-base <= uintptr(r.Size) && uintptr(len(b)) <= uintptr(r.Size)-(p-base) {
			return true
		}
	}
	return false
}

func TestVQInRAM(t *testing.T) {
	mem := vqMemory(t)
	h0, h1 := mem.Host(0), mem.Host(1)
	for _, tc := range []struct {
		b    []byte
		want bool
	}{
		{h0, true},
		{h0[len(h0)-1:], true},
		{h1[10:20], true},
		{make([]byte, 8), false},
	} {
		if got := vqInRAM(mem, tc.b); got != tc.want {
			t.Errorf("vqInRAM(%d bytes at %p) = %v", len(tc.b), unsafe.SliceData(tc.b), got)
		}
	}
}
