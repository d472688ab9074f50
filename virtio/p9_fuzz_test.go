package virtio

import (
	"encoding/binary"
	"testing"
)

// FuzzP9Chain sends arbitrary bytes through the queue as one chain, split
// over two readable buffers, with a writable area of fuzzed size in one or
// two buffers, to a device after Tversion and Tattach. The chain must come
// back with a used length within its writable bytes, holding a reply whose
// size field is that length and at most msize, and the device must serve
// the next request.
func FuzzP9Chain(f *testing.F) {
	f.Add(p9Msg(p9Twalk, 1, uint32(1), uint32(2), uint16(1), "big"), uint16(3), uint16(200), uint16(0))
	f.Add(p9Msg(p9Tread, 1, uint32(1), uint64(0), uint32(100)), uint16(7), uint16(11), uint16(100))
	f.Add(p9Msg(p9Tgetattr, 1, uint32(1), uint64(0x7ff)), uint16(0), uint16(100), uint16(100))
	f.Add(p9Msg(p9Tversion, 0xffff, uint32(8192), "9P2000.L"), uint16(20), uint16(5), uint16(5))
	f.Add([]byte{}, uint16(0), uint16(0), uint16(0))
	f.Fuzz(func(t *testing.T, req []byte, split, w1, w2 uint16) {
		if len(req) > 70000 {
			return
		}
		dev := newP9Device(t, newP9TestFS(), "k")
		d := newP9Driver(t, dev)
		k := 0
		if len(req) > 0 {
			k = int(split) % (len(req) + 1)
		}
		writes := []int{int(w1)}
		if w2 != 0 {
			writes = append(writes, int(w2))
		}
		d.submitBufs(1, [][]byte{req[:k], req[k:]}, writes)
		slot, n := d.wait()
		if slot != 1 {
			t.Fatalf("reply in slot %d", slot)
		}
		r := d.reply(1, n) // fails when n is over the writable bytes
		if n > 0 {
			if n < 7 || binary.LittleEndian.Uint32(r) != n {
				t.Fatalf("used length %d, reply % x", n, r[:min(len(r), 16)])
			}
			if m := dev.Server().Msize(); m != 0 && n > m {
				t.Fatalf("reply of %d bytes over msize %d", n, m)
			}
		}
		if r := d.rpc(p9Msg(p9Tversion, 0xffff, uint32(8192), "9P2000.L")); r[4] != p9Tversion+1 {
			t.Fatalf("Tversion after the fuzzed chain: % x", r)
		}
	})
}
