package kvm

import (
	"encoding/binary"
	"testing"
)

func TestWordBytes(t *testing.T) {
	w := []uint32{0x04030201, 0x08070605}
	b := wordBytes(w)
	if len(b) != 8 || binary.LittleEndian.Uint32(b) != w[0] || binary.LittleEndian.Uint32(b[4:]) != w[1] {
		t.Errorf("wordBytes(%#x) = %x", w, b)
	}
	b[0] = 0xff // shares w's memory
	if w[0] != 0x040302ff {
		t.Errorf("a write through the view left %#x", w[0])
	}
	if len(wordBytes(nil)) != 0 {
		t.Error("wordBytes(nil) is not empty")
	}
}
