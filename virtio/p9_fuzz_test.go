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

// FuzzP9Session is a whole 9p session through the queue: after Tversion
// and Tattach, data is a sequence of T-messages (split by their size
// fields, as ninep's FuzzHandle splits), sent in batches of up to p9Slots
// chains in flight at once (the first byte sets the batch size), so that
// the device's workers serve them concurrently and Tflush meets requests in
// flight. Every chain comes back exactly once, with a reply within its
// writable bytes and msize whose size field is its used length, whose tag
// is its request's and whose type answers it (or is Rlerror); the server
// never panics; and afterwards the device still mounts again.
func FuzzP9Session(f *testing.F) {
	walk := p9Msg(p9Twalk, 1, uint32(1), uint32(2), uint16(1), "big")
	open := p9Msg(p9Tlopen, 2, uint32(2), uint32(0))
	read := p9Msg(p9Tread, 3, uint32(2), uint64(0), uint32(4096))
	flush := p9Msg(p9Tflush, 4, uint16(3))
	clunk := p9Msg(p9Tclunk, 5, uint32(2))
	cat := func(ms ...[]byte) []byte {
		b := []byte{}
		for _, m := range ms {
			b = append(b, m...)
		}
		return b
	}
	f.Add(append([]byte{1}, cat(walk, open, read, clunk)...))
	f.Add(append([]byte{4}, cat(walk, open, read, flush, read, clunk, read)...))
	f.Add(append([]byte{7}, cat(p9Msg(p9Tversion, 0xffff, uint32(4096), "9P2000.L"), read, walk)...))
	f.Add([]byte{3, 0xff, 0xff, 0xff, 0xff, p9Tread, 0, 0, 7, 0, 0, 0, 1})
	tree := newP9TestFS()
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) == 0 || len(data) > 1<<16 {
			return
		}
		batch := int(data[0])%p9Slots + 1
		data = data[1:]
		var msgs [][]byte
		for len(data) > 0 {
			msg := data
			if len(data) >= 4 {
				if n := binary.LittleEndian.Uint32(data); n >= 4 && uint64(n) <= uint64(len(data)) {
					msg = data[:n]
				}
			}
			data = data[len(msg):]
			msgs = append(msgs, msg)
		}
		dev := newP9Device(t, tree, "k")
		d := newP9Driver(t, dev)
		for i := 0; i < len(msgs); i += batch {
			group := msgs[i:min(i+batch, len(msgs))]
			for slot, m := range group {
				resp := 65536
				if (i+slot)%5 == 4 {
					resp = 24 // too small for most replies
				}
				d.submitBufs(slot, [][]byte{m}, []int{resp})
			}
			seen := make([]bool, len(group))
			for range group {
				slot, n := d.wait()
				if slot < 0 || slot >= len(group) || seen[slot] {
					t.Fatalf("reply in slot %d of a batch of %d (seen %v)", slot, len(group), seen)
				}
				seen[slot] = true
				r := d.reply(slot, n) // fails when n is over the writable bytes
				if n == 0 {
					continue
				}
				m := group[slot]
				if n < 7 || binary.LittleEndian.Uint32(r) != n {
					t.Fatalf("used length %d, reply % x", n, r[:min(len(r), 16)])
				}
				if ms := dev.Server().Msize(); ms != 0 && n > ms {
					t.Fatalf("reply of %d bytes over msize %d", n, ms)
				}
				if len(m) >= 7 {
					if r[4] != m[4]+1 && r[4] != p9Rlerror {
						t.Fatalf("reply type %d to a request of type %d", r[4], m[4])
					}
					if binary.LittleEndian.Uint16(r[5:]) != binary.LittleEndian.Uint16(m[5:]) {
						t.Fatalf("reply tag %d to a request tagged %d", binary.LittleEndian.Uint16(r[5:]), binary.LittleEndian.Uint16(m[5:]))
					}
				}
			}
		}
		if st := dev.Server().Stats(); st.Panics != 0 {
			t.Fatalf("%d handler panics", st.Panics)
		}
		if r := d.rpc(p9Msg(p9Tversion, 0xffff, uint32(8192), "9P2000.L")); r[4] != p9Tversion+1 {
			t.Fatalf("Tversion after the session: % x", r)
		}
		if r := d.rpc(p9Msg(p9Tattach, 1, uint32(1), uint32(p9NoFid), "root", "", uint32(0))); r[4] != p9Tattach+1 {
			t.Fatalf("Tattach after the session: % x", r)
		}
	})
}
