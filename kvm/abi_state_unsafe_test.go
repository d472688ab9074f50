package kvm

import (
	"errors"
	"slices"
	"testing"
	"unsafe"
)

// TestDebugRegsABI checks struct kvm_debugregs and its ioctls against
// <linux/kvm.h> for x86-64.
func TestDebugRegsABI(t *testing.T) {
	if got := unsafe.Sizeof(DebugRegs{}); got != 128 {
		t.Errorf("sizeof(kvm_debugregs) = %d, kernel ABI says 128", got)
	}
	if got := unsafe.Offsetof(DebugRegs{}.Flags); got != 48 {
		t.Errorf("offsetof(kvm_debugregs.flags) = %d, kernel ABI says 48", got)
	}
	for _, tt := range []struct {
		name      string
		got, want uintptr
	}{
		{"KVM_GET_DEBUGREGS", reqGetDebugRegs, 0x8080aea1},
		{"KVM_SET_DEBUGREGS", reqSetDebugRegs, 0x4080aea2},
	} {
		if tt.got != tt.want {
			t.Errorf("%s = %#x, <linux/kvm.h> says %#x", tt.name, tt.got, tt.want)
		}
		if size := (tt.got >> iocSizeShift) & 0x3fff; size != unsafe.Sizeof(DebugRegs{}) {
			t.Errorf("%s encodes a %d-byte argument, DebugRegs has %d", tt.name, size, unsafe.Sizeof(DebugRegs{}))
		}
	}
}

// fakeMSRs answers KVM_GET_MSRS like KVM: it stops at the first MSR it
// does not know and reports how many it read.
type fakeMSRs struct {
	known map[uint32]uint64
	calls int
}

func (f *fakeMSRs) get(entries []MSREntry) (int, error) {
	f.calls++
	for i := range entries {
		v, ok := f.known[entries[i].Index]
		if !ok {
			return i, nil
		}
		entries[i].Data = v
	}
	return len(entries), nil
}

func TestReadMSRsSkipsRefused(t *testing.T) {
	known := map[uint32]uint64{0x10: 100, 0x174: 1, 0xc0000080: 0xd01, 0x4b564d01: 7}
	tests := []struct {
		name    string
		indices []uint32
		want    []uint32
	}{
		{"none", nil, nil},
		{"all known", []uint32{0x10, 0x174}, []uint32{0x10, 0x174}},
		{"first refused", []uint32{0x1, 0x10}, []uint32{0x10}},
		{"middle refused", []uint32{0x10, 0x2, 0x3, 0x174}, []uint32{0x10, 0x174}},
		{"last refused", []uint32{0xc0000080, 0x4b564d01, 0x5}, []uint32{0xc0000080, 0x4b564d01}},
		{"all refused", []uint32{1, 2, 3}, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeMSRs{known: known}
			got, err := readMSRs(tt.indices, f.get)
			if err != nil {
				t.Fatal(err)
			}
			var idx []uint32
			for _, e := range got {
				idx = append(idx, e.Index)
				if e.Data != known[e.Index] {
					t.Errorf("MSR %#x = %d, want %d", e.Index, e.Data, known[e.Index])
				}
			}
			if !slices.Equal(idx, tt.want) {
				t.Errorf("read %#x, want %#x", idx, tt.want)
			}
		})
	}
}

func TestReadMSRsBatches(t *testing.T) {
	// More MSRs than one KVM_GET_MSRS takes, with one refused in the
	// second batch.
	known := map[uint32]uint64{}
	var indices []uint32
	for i := uint32(0); i < maxMSRs+100; i++ {
		indices = append(indices, i)
		if i != maxMSRs+7 {
			known[i] = uint64(i) * 3
		}
	}
	f := &fakeMSRs{known: known}
	got, err := readMSRs(indices, f.get)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(indices)-1 {
		t.Fatalf("read %d MSRs, want %d", len(got), len(indices)-1)
	}
	if f.calls != 3 {
		t.Errorf("%d KVM_GET_MSRS calls, want 3", f.calls)
	}
}

func TestReadMSRsError(t *testing.T) {
	boom := errors.New("boom")
	_, err := readMSRs([]uint32{1}, func([]MSREntry) (int, error) { return 0, boom })
	if !errors.Is(err, boom) {
		t.Fatalf("err = %v, want boom", err)
	}
	_, err = readMSRs([]uint32{1}, func([]MSREntry) (int, error) { return 5, nil })
	if err == nil {
		t.Fatal("a count past the batch was taken")
	}
}
