package virtio

import (
	"bytes"
	"testing"
)

func TestRNG(t *testing.T) {
	rng := NewRNG()
	if rng.ID() != IDRNG || len(rng.QueueSizes()) != 1 || rng.Features() != 0 {
		t.Fatal("bad device identity")
	}
	r := newVQRing(t, 8, FeatureVersion1)
	if err := rng.Activate(r.mem, FeatureVersion1, []*Queue{r.q}); err != nil {
		t.Fatal(err)
	}
	const big = vqData + 0x10000
	tests := []struct {
		name  string
		head  uint16
		setup func()
		want  uint32
	}{
		{"one buffer", 0, func() { r.desc(vqDesc, 0, vqData, 64, descFWrite, 0) }, 64},
		{"two buffers", 1, func() {
			r.desc(vqDesc, 1, vqData+0x100, 16, descFWrite|descFNext, 2)
			r.desc(vqDesc, 2, vqData+0x200, 48, descFWrite, 0)
		}, 64},
		{"more than the bound", 3, func() {
			r.desc(vqDesc, 3, big, 0x8000, descFWrite|descFNext, 4)
			r.desc(vqDesc, 4, big+0x8000, 0x10000, descFWrite, 0)
		}, RNGMaxChunk},
		{"readable only", 5, func() { r.desc(vqDesc, 5, vqData+0x300, 64, 0, 0) }, 0},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.setup()
			r.publish(tc.head)
			rng.QueueNotify(0)
			if r.usedIdx() != uint16(i+1) {
				t.Fatalf("used idx %d, want %d", r.usedIdx(), i+1)
			}
			id, n := r.usedElem(uint16(i))
			if id != uint32(tc.head) || n != tc.want {
				t.Fatalf("used (%d, %d), want (%d, %d)", id, n, tc.head, tc.want)
			}
			if r.interrupts != i+1 {
				t.Fatalf("%d interrupts", r.interrupts)
			}
		})
	}
	buf := make([]byte, 64)
	r.mem.ReadAt(buf, vqData)
	if bytes.Equal(buf, make([]byte, 64)) {
		t.Fatal("buffer still zero")
	}
	// Bytes past the bound stay untouched.
	tail := make([]byte, 0x8000)
	r.mem.ReadAt(tail, big+RNGMaxChunk)
	if !bytes.Equal(tail, make([]byte, len(tail))) {
		t.Fatal("wrote past RNGMaxChunk")
	}
	// A notification for another queue, and after reset, does nothing.
	rng.QueueNotify(1)
	rng.Reset()
	r.desc(vqDesc, 6, vqData, 8, descFWrite, 0)
	r.publish(6)
	rng.QueueNotify(0)
	if r.usedIdx() != uint16(len(tests)) {
		t.Fatal("served after reset")
	}
}

func TestRNGMalformed(t *testing.T) {
	rng := NewRNG()
	r := newVQRing(t, 8, FeatureVersion1)
	rng.Activate(r.mem, FeatureVersion1, []*Queue{r.q})
	r.desc(vqDesc, 0, vqRAM-8, 64, descFWrite, 0)
	r.publish(0)
	rng.QueueNotify(0)
	if len(r.errs) != 1 || r.usedIdx() != 0 {
		t.Fatalf("errors %v, used idx %d", r.errs, r.usedIdx())
	}
}
