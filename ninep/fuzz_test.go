package ninep

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"io"
	"log/slog"
	"testing"
)

// fuzzSeeds are well-formed T-messages of every kind, for the fids that
// fuzzServer sets up.
func fuzzSeeds() [][]byte {
	return [][]byte{
		tmsg(tversion, NoTag, uint32(8192), "9P2000.L"),
		tmsg(tattach, 1, uint32(9), uint32(NoFid), "root", "", uint32(0)),
		tmsg(tauth, 1, uint32(9), "root", "", uint32(0)),
		tmsg(twalk, 1, uint32(1), uint32(9), uint16(2), "etc", "hello"),
		tmsg(twalk, 1, uint32(1), uint32(9), uint16(3), "deep", "..", "bin"),
		tmsg(tgetattr, 1, uint32(2), uint64(getattrBasic)),
		tmsg(tlopen, 1, uint32(5), uint32(0)),
		tmsg(tread, 1, uint32(2), uint64(3), uint32(100)),
		tmsg(tread, 1, uint32(6), uint64(0), uint32(1<<20)),
		tmsg(tread, 1, uint32(4), uint64(1), uint32(5)),
		tmsg(treaddir, 1, uint32(3), uint64(5), uint32(300)),
		tmsg(treadlink, 1, uint32(7), uint32(0)),
		tmsg(tstatfs, 1, uint32(1)),
		tmsg(txattrwalk, 1, uint32(2), uint32(9), ""),
		tmsg(txattrwalk, 1, uint32(2), uint32(9), "user.note"),
		tmsg(tclunk, 1, uint32(2)),
		tmsg(tremove, 1, uint32(3)),
		tmsg(tflush, 2, uint16(1)),
		tmsg(tfsync, 1, uint32(2), uint32(0)),
		tmsg(tlock, 1, uint32(2), uint8(1), uint32(0), uint64(0), uint64(0), uint32(1), "c"),
		tmsg(tgetlock, 1, uint32(2), uint8(1), uint64(0), uint64(0), uint32(1), "c"),
		tmsg(tmkdir, 1, uint32(1), "d", uint32(0o755), uint32(0)),
		tmsg(twrite, 1, uint32(2), uint64(0), uint32(1), []byte("x")),
		tmsg(tsetattr, 1, uint32(2), uint32(1), uint32(0), uint32(0), uint32(0), uint64(0), uint64(0), uint64(0), uint64(0), uint64(0)),
	}
}

// fuzzServer returns a server after Tversion (msize 8192) and Tattach,
// with fids 1 (root), 2 (/etc/hello, open), 3 (/many, open), 4 (an xattr
// fid), 5 (/etc), 6 (/big, open), 7 (/etc/link).
func fuzzServer(t testing.TB, tree *memFS) *Server {
	t.Helper()
	s := NewServer(tree, Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	ctx := context.Background()
	for _, m := range [][]byte{
		tmsg(tversion, NoTag, uint32(8192), "9P2000.L"),
		tmsg(tattach, 1, uint32(1), uint32(NoFid), "", "", uint32(0)),
		tmsg(twalk, 1, uint32(1), uint32(2), uint16(2), "etc", "hello"),
		tmsg(tlopen, 1, uint32(2), uint32(0)),
		tmsg(twalk, 1, uint32(1), uint32(3), uint16(1), "many"),
		tmsg(tlopen, 1, uint32(3), uint32(0)),
		tmsg(txattrwalk, 1, uint32(2), uint32(4), "user.note"),
		tmsg(twalk, 1, uint32(1), uint32(5), uint16(1), "etc"),
		tmsg(twalk, 1, uint32(1), uint32(6), uint16(1), "big"),
		tmsg(tlopen, 1, uint32(6), uint32(0)),
		tmsg(twalk, 1, uint32(1), uint32(7), uint16(2), "etc", "link"),
	} {
		if r := s.Handle(ctx, m); r[4] == rlerror {
			t.Fatalf("fuzz setup: message type %d failed", m[4])
		}
	}
	return s
}

// checkReply fails unless resp is a well-formed reply to req within msize.
func checkReply(t *testing.T, s *Server, req, resp []byte) {
	t.Helper()
	if len(resp) < headerSize {
		t.Fatalf("reply of %d bytes", len(resp))
	}
	size := binary.LittleEndian.Uint32(resp)
	if int(size) != len(resp) {
		t.Fatalf("reply size field %d, length %d", size, len(resp))
	}
	limit := s.Msize()
	if limit == 0 {
		limit = s.MaxMsize()
	}
	if size > limit {
		t.Fatalf("reply of %d bytes over msize %d", size, limit)
	}
	typ := resp[4]
	if len(req) >= headerSize {
		if typ != rlerror && typ != req[4]+1 {
			t.Fatalf("reply type %d to request type %d", typ, req[4])
		}
		if tag := binary.LittleEndian.Uint16(resp[5:]); tag != binary.LittleEndian.Uint16(req[5:]) {
			t.Fatalf("reply tag %d to request tag %d", tag, binary.LittleEndian.Uint16(req[5:]))
		}
	} else if typ != rlerror {
		t.Fatalf("reply type %d to a %d-byte message", typ, len(req))
	}
	if typ == rlerror && (size != rlerrorSize || binary.LittleEndian.Uint32(resp[7:]) == 0) {
		t.Fatalf("Rlerror of %d bytes, errno %d", size, binary.LittleEndian.Uint32(resp[7:]))
	}
}

// FuzzHandle feeds the server arbitrary bytes, as one message or as a
// sequence split by size[4], after a valid Tversion and Tattach. The
// server must never panic, and each reply must be a well-formed R-message
// within msize.
func FuzzHandle(f *testing.F) {
	for _, m := range fuzzSeeds() {
		f.Add(m)
	}
	seq := append(tmsg(twalk, 1, uint32(5), uint32(20), uint16(0)), tmsg(tlopen, 2, uint32(20), uint32(0))...)
	seq = append(seq, tmsg(treaddir, 3, uint32(20), uint64(0), uint32(100))...)
	f.Add(seq)
	f.Add([]byte{0xff, 0xff, 0xff, 0xff, tread, 0, 0})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()           // nothing may block: a read of /slow ends at once
	tree := testTree() // read-only: shared by every run
	f.Fuzz(func(t *testing.T, data []byte) {
		s := fuzzServer(t, tree)
		for len(data) > 0 {
			msg := data
			if len(data) >= 4 {
				if n := binary.LittleEndian.Uint32(data); n >= 4 && uint64(n) <= uint64(len(data)) {
					msg = data[:n]
				}
			}
			data = data[len(msg):]
			checkReply(t, s, msg, s.Handle(ctx, msg))
		}
		// Into a small buffer too.
		resp := make([]byte, 40)
		for _, m := range fuzzSeeds() {
			if n := s.HandleTo(ctx, m, resp); n != 0 {
				checkReply(t, s, m, resp[:n])
			}
		}
		if st := s.Stats(); st.Panics != 0 {
			t.Fatalf("%d handler panics", st.Panics)
		}
	})
}

// FuzzRestoreState: a 9p device's state comes from a snapshot file, which
// may be anything. RestoreState never panics; a state it takes serves
// messages (walk, getattr, read on every restored fid) without panicking,
// and saves again.
func FuzzRestoreState(f *testing.F) {
	for _, s := range []string{
		`{"version":1,"msize":65536,"fids":[{"fid":1,"path":[1]}]}`,
		`{"version":1,"msize":65536,"fids":[{"fid":1,"path":[1]},{"fid":7,"path":[1,2,3],"open":true}]}`,
		`{"version":1,"msize":4096,"fids":[{"fid":9,"path":[1],"xattr":{"name":"user.note"}}]}`,
		`{"version":1,"msize":0,"fids":[]}`,
		`{"version":2}`,
		`{"fids":[{"fid":4294967295,"path":[]}]}`,
		`null`,
	} {
		f.Add([]byte(s))
	}
	tree := testTree()
	f.Fuzz(func(t *testing.T, data []byte) {
		s := NewServer(tree, Options{})
		if err := s.RestoreState(data); err != nil {
			return
		}
		var st State
		if err := json.Unmarshal(data, &st); err != nil {
			t.Fatalf("RestoreState took %q, which is not a State: %v", data, err)
		}
		ctx := context.Background()
		for _, fs := range st.Fids {
			s.Handle(ctx, tmsg(tgetattr, 1, fs.Fid, uint64(0x3fff)))
			s.Handle(ctx, tmsg(treaddir, 1, fs.Fid, uint64(0), uint32(4096)))
			s.Handle(ctx, tmsg(tread, 1, fs.Fid, uint64(0), uint32(4096)))
			s.Handle(ctx, tmsg(twalk, 1, fs.Fid, fs.Fid+1, uint16(1), ".."))
		}
		if _, err := s.SaveState(); err != nil {
			t.Fatalf("a restored state does not save: %v", err)
		}
	})
}
