package ninep

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// tmsg builds a T-message from fields written in order: uint8, uint16,
// uint32, uint64, string (len[2] then bytes) and []byte (raw bytes).
// It is written apart from the server's encoder, from the protocol's
// layouts.
func tmsg(typ uint8, tag uint16, fields ...any) []byte {
	b := make([]byte, 7)
	b[4] = typ
	binary.LittleEndian.PutUint16(b[5:], tag)
	for _, f := range fields {
		switch v := f.(type) {
		case uint8:
			b = append(b, v)
		case uint16:
			b = binary.LittleEndian.AppendUint16(b, v)
		case uint32:
			b = binary.LittleEndian.AppendUint32(b, v)
		case int:
			b = binary.LittleEndian.AppendUint32(b, uint32(v))
		case uint64:
			b = binary.LittleEndian.AppendUint64(b, v)
		case string:
			b = binary.LittleEndian.AppendUint16(b, uint16(len(v)))
			b = append(b, v...)
		case []byte:
			b = append(b, v...)
		default:
			panic(fmt.Sprintf("tmsg: field of type %T", f))
		}
	}
	binary.LittleEndian.PutUint32(b, uint32(len(b)))
	return b
}

// rmsg is a parsed R-message.
type rmsg struct {
	size uint32
	typ  uint8
	tag  uint16
	body []byte
}

func parseR(t testing.TB, b []byte) rmsg {
	t.Helper()
	if len(b) < 7 {
		t.Fatalf("reply of %d bytes", len(b))
	}
	r := rmsg{size: binary.LittleEndian.Uint32(b), typ: b[4], tag: binary.LittleEndian.Uint16(b[5:]), body: b[7:]}
	if int(r.size) != len(b) {
		t.Fatalf("reply size field %d, length %d", r.size, len(b))
	}
	return r
}

func (r rmsg) String() string {
	if r.typ == rlerror && len(r.body) == 4 {
		return fmt.Sprintf("Rlerror(%v) tag %d", unix.Errno(binary.LittleEndian.Uint32(r.body)), r.tag)
	}
	return fmt.Sprintf("R type %d tag %d, %d bytes", r.typ, r.tag, len(r.body))
}

// errno returns the reply's errno, or 0 if it is not an Rlerror.
func (r rmsg) errno() unix.Errno {
	if r.typ != rlerror || len(r.body) != 4 {
		return 0
	}
	return unix.Errno(binary.LittleEndian.Uint32(r.body))
}

// raw drives a server message by message.
type raw struct {
	t       *testing.T
	s       *Server
	root    uint32
	nextFid uint32
}

// newRaw returns a raw client on a new server over tree, after Tversion
// (msize 64 KiB) and Tattach (fid 1).
func newRaw(t *testing.T, tree *memFS, opts Options) *raw {
	t.Helper()
	r := &raw{t: t, s: NewServer(tree, opts), root: 1, nextFid: 100}
	if resp := r.do(tmsg(tversion, NoTag, uint32(64<<10), "9P2000.L")); resp.typ != tversion+1 {
		t.Fatalf("Tversion: %s", resp)
	}
	if resp := r.do(tmsg(tattach, 1, uint32(1), uint32(NoFid), "root", "", uint32(0))); resp.typ != tattach+1 {
		t.Fatalf("Tattach: %s", resp)
	}
	return r
}

// rawOn returns a raw client on a server another client has set up; it
// attaches a root of its own at fid 10000.
func rawOn(t *testing.T, s *Server) *raw {
	t.Helper()
	r := &raw{t: t, s: s, root: 10000, nextFid: 10001}
	if resp := r.do(tmsg(tattach, 1, r.root, uint32(NoFid), "root", "", uint32(0))); resp.typ != tattach+1 {
		t.Fatalf("Tattach: %s", resp)
	}
	return r
}

func (r *raw) do(req []byte) rmsg {
	r.t.Helper()
	return r.doCtx(context.Background(), req)
}

func (r *raw) doCtx(ctx context.Context, req []byte) rmsg {
	r.t.Helper()
	resp := parseR(r.t, r.s.Handle(ctx, req))
	if resp.tag != binary.LittleEndian.Uint16(req[5:]) {
		r.t.Fatalf("reply tag %d for request tag %d", resp.tag, binary.LittleEndian.Uint16(req[5:]))
	}
	if m := r.s.Msize(); m != 0 && resp.size > m {
		r.t.Fatalf("reply of %d bytes over msize %d", resp.size, m)
	}
	return resp
}

// walkTo walks from the root to path (slash-separated) into a new fid.
func (r *raw) walkTo(path string) uint32 {
	r.t.Helper()
	f := r.nextFid
	r.nextFid++
	names := []any{r.root, f, uint16(0)}
	if path != "" {
		parts := strings.Split(path, "/")
		names[2] = uint16(len(parts))
		for _, p := range parts {
			names = append(names, p)
		}
	}
	resp := r.do(tmsg(twalk, 2, names...))
	if resp.typ != twalk+1 || int(binary.LittleEndian.Uint16(resp.body)) != int(names[2].(uint16)) {
		r.t.Fatalf("walk to %q: %s", path, resp)
	}
	return f
}

func (r *raw) walkOpen(path string) uint32 {
	r.t.Helper()
	f := r.walkTo(path)
	if resp := r.do(tmsg(tlopen, 3, f, uint32(0))); resp.typ != tlopen+1 {
		r.t.Fatalf("open %q: %s", path, resp)
	}
	return f
}

func (r *raw) wantErr(what string, req []byte, want unix.Errno) {
	r.t.Helper()
	if resp := r.do(req); resp.errno() != want {
		r.t.Errorf("%s: %s, want Rlerror %v", what, resp, want)
	}
}

func TestVersionRaw(t *testing.T) {
	s := NewServer(testTree(), Options{})
	r := &raw{t: t, s: s}
	r.wantErr("Tattach before Tversion", tmsg(tattach, 1, uint32(1), uint32(NoFid), "", "", uint32(0)), unix.EPROTO)
	r.wantErr("msize under the minimum", tmsg(tversion, NoTag, uint32(MinMsize-1), "9P2000.L"), unix.EINVAL)
	resp := r.do(tmsg(tversion, NoTag, uint32(8192), "9P2000"))
	if resp.typ != tversion+1 || !bytes.Equal(resp.body[4:], []byte("\x07\x00unknown")) || s.Msize() != 0 {
		t.Errorf("Tversion 9P2000: %s % x, msize %d", resp, resp.body, s.Msize())
	}
	resp = r.do(tmsg(tversion, NoTag, uint32(8192), "9P2000.L.Google.3"))
	if resp.typ != tversion+1 || binary.LittleEndian.Uint32(resp.body) != 8192 || string(resp.body[6:]) != Version {
		t.Errorf("Tversion 9P2000.L.Google.3: %s %q", resp, resp.body)
	}
	// A new Tversion ends the session: its fids are gone.
	r.do(tmsg(tattach, 1, uint32(1), uint32(NoFid), "", "", uint32(0)))
	if s.Fids() != 1 {
		t.Fatalf("%d fids after attach", s.Fids())
	}
	r.do(tmsg(tversion, NoTag, uint32(1<<30), "9P2000.L"))
	if s.Fids() != 0 || s.Msize() != DefaultMsize {
		t.Errorf("after a second Tversion: %d fids, msize %d", s.Fids(), s.Msize())
	}
}

func TestAttachRaw(t *testing.T) {
	tree := testTree()
	r := newRaw(t, tree, Options{})
	r.wantErr("fid in use", tmsg(tattach, 1, uint32(1), uint32(NoFid), "", "", uint32(0)), unix.EBADF)
	r.wantErr("afid set", tmsg(tattach, 1, uint32(2), uint32(5), "", "", uint32(0)), unix.EINVAL)
	r.wantErr("another tree", tmsg(tattach, 1, uint32(2), uint32(NoFid), "", "/other", uint32(0)), unix.ENOENT)
	r.wantErr("fid NOFID", tmsg(tattach, 1, uint32(NoFid), uint32(NoFid), "", "", uint32(0)), unix.EBADF)
	r.wantErr("Tauth", tmsg(tauth, 1, uint32(3), "root", "", uint32(0)), unix.EOPNOTSUPP)
	resp := r.do(tmsg(tattach, 1, uint32(2), uint32(NoFid), "", "", uint32(0)))
	if resp.typ != tattach+1 || resp.body[0] != qtDir || binary.LittleEndian.Uint64(resp.body[5:]) != tree.root {
		t.Errorf("second attach: %s % x", resp, resp.body)
	}
}

// namedTree is a memFS that serves some of its directories as named trees.
type namedTree struct {
	*memFS
	names map[string]uint64 // aname → the tree's root
}

func (n namedTree) AttachRoot(aname string) (uint64, error) {
	ino, ok := n.names[aname]
	if !ok {
		return 0, fmt.Errorf("memfs: no tree %q: %w", aname, unix.ENOENT)
	}
	return ino, nil
}

func (n namedTree) IsRoot(ino uint64) bool {
	for _, r := range n.names {
		if r == ino {
			return true
		}
	}
	return false
}

var _ NamedRoots = namedTree{}

func TestAttachNamedRaw(t *testing.T) {
	tree := testTree()
	named := namedTree{tree, map[string]uint64{
		"deep":  tree.paths["/deep/a"],
		"etc":   tree.paths["/etc"],
		"file":  tree.paths["/big"],
		"stale": 99999,
	}}
	tests := []struct {
		name  string
		fs    rofs.FS
		aname string
		want  uint64     // the root's qid path
		errno unix.Errno // or the Rlerror
	}{
		{"root", named, "", tree.root, 0},
		{"slash", named, "/", tree.root, 0},
		{"named", named, "deep", tree.paths["/deep/a"], 0},
		{"another named", named, "etc", tree.paths["/etc"], 0},
		{"unknown name", named, "nothere", 0, unix.ENOENT},
		{"a file", named, "file", 0, unix.ENOTDIR},
		{"stale root", named, "stale", 0, unix.ENOENT},
		{"no named trees", tree, "deep", 0, unix.ENOENT},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := &raw{t: t, s: NewServer(tt.fs, Options{}), root: 1, nextFid: 100}
			r.do(tmsg(tversion, NoTag, uint32(64<<10), "9P2000.L"))
			resp := r.do(tmsg(tattach, 1, uint32(1), uint32(NoFid), "", tt.aname, uint32(0)))
			if tt.errno != 0 {
				if resp.errno() != tt.errno || r.s.Fids() != 0 {
					t.Fatalf("attach %q: %s, %d fids; want Rlerror %v", tt.aname, resp, r.s.Fids(), tt.errno)
				}
				return
			}
			if resp.typ != tattach+1 || resp.body[0] != qtDir || binary.LittleEndian.Uint64(resp.body[5:]) != tt.want {
				t.Fatalf("attach %q: %s % x, want root %d", tt.aname, resp, resp.body, tt.want)
			}
			// ".." at a named tree's root stays there: the tree above it is
			// not reached.
			resp = r.do(tmsg(twalk, 2, uint32(1), uint32(2), uint16(2), "..", ".."))
			if resp.typ != twalk+1 || binary.LittleEndian.Uint64(resp.body[2+13+5:]) != tt.want {
				t.Errorf("../.. from %q: %s", tt.aname, resp)
			}
		})
	}
}

func TestWalkRaw(t *testing.T) {
	tree := testTree()
	r := newRaw(t, tree, Options{})
	qidPaths := func(resp rmsg) []uint64 {
		n := int(binary.LittleEndian.Uint16(resp.body))
		var p []uint64
		for i := range n {
			p = append(p, binary.LittleEndian.Uint64(resp.body[2+13*i+5:]))
		}
		return p
	}
	// Partial walk: the qids that succeeded, and no new fid.
	resp := r.do(tmsg(twalk, 1, uint32(1), uint32(50), uint16(3), "etc", "nothere", "x"))
	if resp.typ != twalk+1 || fmt.Sprint(qidPaths(resp)) != fmt.Sprint([]uint64{tree.paths["/etc"]}) {
		t.Fatalf("partial walk: %s %v", resp, qidPaths(resp))
	}
	r.wantErr("the fid of a partial walk", tmsg(tclunk, 1, uint32(50)), unix.EBADF)
	resp = r.do(tmsg(twalk, 1, uint32(1), uint32(50), uint16(3), "etc", "hello", "x"))
	if len(qidPaths(resp)) != 2 {
		t.Errorf("walk through a file: %s", resp)
	}
	// newfid == fid moves the fid.
	f := r.walkTo("deep")
	resp = r.do(tmsg(twalk, 1, f, f, uint16(2), "a", "b"))
	if resp.typ != twalk+1 {
		t.Fatalf("walk in place: %s", resp)
	}
	resp = r.do(tmsg(tgetattr, 1, f, uint64(getattrBasic)))
	if binary.LittleEndian.Uint64(resp.body[8+5:]) != tree.paths["/deep/a/b"] {
		t.Errorf("fid after walking in place: %s", resp)
	}
	resp = r.do(tmsg(twalk, 1, f, f, uint16(1), ".."))
	if qidPaths(resp)[0] != tree.paths["/deep/a"] {
		t.Errorf(".. from /deep/a/b: %v", qidPaths(resp))
	}

	// A clone onto itself keeps the fid as it is, open.
	o := r.walkOpen("etc/hello")
	if resp := r.do(tmsg(twalk, 1, o, o, uint16(0))); resp.typ != twalk+1 {
		t.Fatalf("clone onto itself: %s", resp)
	}
	if resp := r.do(tmsg(tread, 1, o, uint64(0), uint32(5))); resp.typ != tread+1 {
		t.Errorf("read after a clone onto itself: %s", resp)
	}

	names16 := []any{uint32(1), uint32(60), uint16(16)}
	names17 := []any{uint32(1), uint32(60), uint16(17)}
	for range 16 {
		names16 = append(names16, "..")
		names17 = append(names17, "..")
	}
	names17 = append(names17, "..")
	if resp := r.do(tmsg(twalk, 1, names16...)); len(qidPaths(resp)) != 16 {
		t.Errorf("16 names: %s", resp)
	}
	r.wantErr("17 names", tmsg(twalk, 1, names17...), unix.EINVAL)
	tests := []struct {
		name string
		req  []byte
		want unix.Errno
	}{
		{"first name missing", tmsg(twalk, 1, uint32(1), uint32(70), uint16(1), "nothere"), unix.ENOENT},
		{"unknown fid", tmsg(twalk, 1, uint32(999), uint32(70), uint16(0)), unix.EBADF},
		{"newfid in use", tmsg(twalk, 1, uint32(1), uint32(60), uint16(0)), unix.EBADF},
		{"from a file", tmsg(twalk, 1, r.walkTo("etc/hello"), uint32(70), uint16(1), "x"), unix.ENOTDIR},
		{"empty name", tmsg(twalk, 1, uint32(1), uint32(70), uint16(1), ""), unix.EINVAL},
		{"slash in a name", tmsg(twalk, 1, uint32(1), uint32(70), uint16(1), "etc/hello"), unix.EINVAL},
		{"NUL in a name", tmsg(twalk, 1, uint32(1), uint32(70), uint16(1), "etc\x00"), unix.EINVAL},
		{"long name", tmsg(twalk, 1, uint32(1), uint32(70), uint16(1), strings.Repeat("a", 256)), unix.ENAMETOOLONG},
		{"names missing", tmsg(twalk, 1, uint32(1), uint32(70), uint16(2), "etc"), unix.EINVAL},
		{"name length past the end", tmsg(twalk, 1, uint32(1), uint32(70), uint16(1), uint16(100), []byte("etc")), unix.EINVAL},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r.t = t
			r.wantErr(tt.name, tt.req, tt.want)
		})
	}
}

func TestXattrRaw(t *testing.T) {
	tree := testTree()
	r := newRaw(t, tree, Options{})
	ping := r.walkTo("bin/ping")
	hello := r.walkTo("etc/hello")
	readAll := func(fid uint32, size int, chunk uint32) []byte {
		var got []byte
		for off := 0; ; {
			resp := r.do(tmsg(tread, 1, fid, uint64(off), chunk))
			if resp.typ != tread+1 {
				t.Fatalf("read of xattr fid: %s", resp)
			}
			n := int(binary.LittleEndian.Uint32(resp.body))
			if n == 0 {
				break
			}
			got = append(got, resp.body[4:4+n]...)
			off += n
			if len(got) > size {
				t.Fatalf("read %d bytes of a %d-byte value", len(got), size)
			}
		}
		return got
	}
	tests := []struct {
		name  string
		fid   uint32
		attr  string
		want  string
		errno unix.Errno
	}{
		{"capability", ping, "security.capability", capability, 0},
		{"user xattr", hello, "user.note", "a note", 0},
		{"list", hello, "", "user.note\x00", 0},
		{"list of one without", r.walkTo("etc"), "", "", 0},
		{"missing", hello, "trusted.overlay.opaque", "", unix.ENODATA},
		{"long name", hello, strings.Repeat("n", 256), "", unix.ERANGE},
		{"xattr of an xattr fid", 0, "user.note", "", unix.EINVAL},
	}
	xf := uint32(500)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r.t = t
			from := tt.fid
			if from == 0 { // an xattr fid made just now
				r.do(tmsg(txattrwalk, 1, hello, uint32(499), "user.note"))
				from = 499
			}
			xf++
			resp := r.do(tmsg(txattrwalk, 1, from, xf, tt.attr))
			if tt.errno != 0 {
				if resp.errno() != tt.errno {
					t.Fatalf("%s, want %v", resp, tt.errno)
				}
				r.wantErr("clunk of the fid of a failed xattrwalk", tmsg(tclunk, 1, xf), unix.EBADF)
				return
			}
			if resp.typ != txattrwalk+1 || binary.LittleEndian.Uint64(resp.body) != uint64(len(tt.want)) {
				t.Fatalf("%s % x, want size %d", resp, resp.body, len(tt.want))
			}
			if got := readAll(xf, len(tt.want), 3); string(got) != tt.want {
				t.Errorf("value %q, want %q", got, tt.want)
			}
			if got := readAll(xf, len(tt.want), 1000); string(got) != tt.want {
				t.Errorf("value in one read %q, want %q", got, tt.want)
			}
			r.wantErr("getattr of an xattr fid", tmsg(tgetattr, 1, xf, uint64(getattrBasic)), unix.EINVAL)
			r.wantErr("open of an xattr fid", tmsg(tlopen, 1, xf, uint32(0)), unix.EINVAL)
			if resp := r.do(tmsg(tclunk, 1, xf)); resp.typ != tclunk+1 {
				t.Errorf("clunk: %s", resp)
			}
		})
	}
	r.t = t
	r.wantErr("xattrcreate", tmsg(txattrcreate, 1, hello, "user.x", uint64(3), uint32(0)), unix.EROFS)
}

func TestLockFsyncRaw(t *testing.T) {
	r := newRaw(t, testTree(), Options{})
	f := r.walkOpen("etc/hello")
	resp := r.do(tmsg(tlock, 1, f, uint8(1), uint32(0), uint64(0), uint64(0), uint32(42), "guest"))
	if resp.typ != tlock+1 || !bytes.Equal(resp.body, []byte{lockSuccess}) {
		t.Errorf("Tlock: %s % x", resp, resp.body)
	}
	resp = r.do(tmsg(tgetlock, 1, f, uint8(1), uint64(10), uint64(20), uint32(42), "guest"))
	want := tmsg(tgetlock+1, 1, uint8(lockTypeUnlock), uint64(10), uint64(20), uint32(42), "guest")[7:]
	if resp.typ != tgetlock+1 || !bytes.Equal(resp.body, want) {
		t.Errorf("Tgetlock: %s % x, want % x", resp, resp.body, want)
	}
	r.wantErr("Tlock of an unknown fid", tmsg(tlock, 1, uint32(999), uint8(1), uint32(0), uint64(0), uint64(0), uint32(42), "guest"), unix.EBADF)
	for _, req := range [][]byte{tmsg(tfsync, 1, f), tmsg(tfsync, 1, f, uint32(1))} {
		if resp := r.do(req); resp.typ != tfsync+1 || len(resp.body) != 0 {
			t.Errorf("Tfsync: %s", resp)
		}
	}
	r.wantErr("Tfsync of an unknown fid", tmsg(tfsync, 1, uint32(999), uint32(0)), unix.EBADF)
}

func TestChangesRaw(t *testing.T) {
	r := newRaw(t, testTree(), Options{})
	etc := r.walkTo("etc")
	f := r.walkOpen("etc/hello")
	tests := []struct {
		name string
		req  []byte
		want unix.Errno
	}{
		{"lcreate", tmsg(tlcreate, 1, etc, "x", uint32(2), uint32(0o644), uint32(0)), unix.EROFS},
		{"symlink", tmsg(tsymlink, 1, etc, "x", "y", uint32(0)), unix.EROFS},
		{"mknod", tmsg(tmknod, 1, etc, "x", uint32(0o644), uint32(1), uint32(3), uint32(0)), unix.EROFS},
		{"rename", tmsg(trename, 1, f, etc, "x"), unix.EROFS},
		{"renameat", tmsg(trenameat, 1, etc, "hello", etc, "x"), unix.EROFS},
		{"unlinkat", tmsg(tunlinkat, 1, etc, "hello", uint32(0)), unix.EROFS},
		{"mkdir", tmsg(tmkdir, 1, etc, "x", uint32(0o755), uint32(0)), unix.EROFS},
		{"link", tmsg(tlink, 1, etc, f, "x"), unix.EROFS},
		{"setattr", tmsg(tsetattr, 1, f, uint32(8), uint32(0), uint32(0), uint32(0), uint64(0), uint64(0), uint64(0), uint64(0), uint64(0)), unix.EROFS},
		{"xattrcreate", tmsg(txattrcreate, 1, f, "user.x", uint64(1), uint32(0)), unix.EROFS},
		{"write", tmsg(twrite, 1, f, uint64(0), uint32(3), []byte("abc")), unix.EROFS},
		{"write with a wrong count", tmsg(twrite, 1, f, uint64(0), uint32(4), []byte("abc")), unix.EINVAL},
		{"mkdir, truncated", tmsg(tmkdir, 1, etc, "x", uint32(0o755)), unix.EINVAL},
		{"setattr, truncated", tmsg(tsetattr, 1, f, uint32(8)), unix.EINVAL},
		{"legacy Topen", tmsg(112, 1, f, uint8(0)), unix.EOPNOTSUPP},
		{"legacy Tstat", tmsg(124, 1, f), unix.EOPNOTSUPP},
		{"an R-message", tmsg(rlerror, 1, uint32(5)), unix.EOPNOTSUPP},
		{"Tlerror", tmsg(tlerror, 1), unix.EOPNOTSUPP},
		{"type 0", tmsg(0, 1), unix.EOPNOTSUPP},
		{"type 255", tmsg(255, 1, []byte("junk")), unix.EOPNOTSUPP},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r.t = t
			r.wantErr(tt.name, tt.req, tt.want)
		})
	}
	r.t = t
	r.wantErr("remove", tmsg(tremove, 1, f), unix.EROFS)
	r.wantErr("read after remove", tmsg(tread, 1, f, uint64(0), uint32(10)), unix.EBADF)
	r.wantErr("remove of an unknown fid", tmsg(tremove, 1, f), unix.EBADF)
}

func TestMalformedRaw(t *testing.T) {
	r := newRaw(t, testTree(), Options{})
	f := r.walkOpen("etc/hello")
	withSize := func(b []byte, size uint32) []byte {
		binary.LittleEndian.PutUint32(b, size)
		return b
	}
	tests := []struct {
		name string
		req  []byte
		want unix.Errno
	}{
		{"size too small", withSize(tmsg(tread, 1, f, uint64(0), uint32(10)), 10), unix.EINVAL},
		{"size too large", withSize(tmsg(tread, 1, f, uint64(0), uint32(10)), 100), unix.EINVAL},
		{"size zero", withSize(tmsg(tclunk, 1, f), 0), unix.EINVAL},
		{"trailing bytes", tmsg(tclunk, 1, f, uint32(0)), unix.EINVAL},
		{"Tread truncated", tmsg(tread, 1, f, uint64(0)), unix.EINVAL},
		{"Tread offset past int64", tmsg(tread, 1, f, uint64(1<<63), uint32(10)), unix.EINVAL},
		{"Tgetattr truncated", tmsg(tgetattr, 1, f), unix.EINVAL},
		{"Tflush truncated", tmsg(tflush, 1, uint8(1)), unix.EINVAL},
		{"string past the end", tmsg(txattrwalk, 1, f, uint32(77), uint16(9), []byte("abc")), unix.EINVAL},
		{"Tversion truncated", tmsg(tversion, NoTag, uint32(8192)), unix.EINVAL},
		{"over msize", tmsg(tfsync, 1, f, make([]byte, 64<<10)), unix.EINVAL},
		{"unknown fid", tmsg(tgetattr, 1, uint32(12345), uint64(0)), unix.EBADF},
		{"clunk of an unknown fid", tmsg(tclunk, 1, uint32(12345)), unix.EBADF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r.t = t
			r.wantErr(tt.name, tt.req, tt.want)
		})
	}
	r.t = t
	// Shorter than a header: the reply has no tag to give, so NOTAG.
	for _, b := range [][]byte{nil, {1}, {7, 0, 0, 0, 100, 0}} {
		resp := parseR(t, r.s.Handle(context.Background(), b))
		if resp.errno() != unix.EINVAL || resp.tag != NoTag {
			t.Errorf("%d-byte message: %s", len(b), resp)
		}
	}
	// A reply buffer too small for even an Rlerror gets nothing.
	if n := r.s.HandleTo(context.Background(), tmsg(tclunk, 1, f), make([]byte, 10)); n != 0 {
		t.Errorf("HandleTo into 10 bytes wrote %d", n)
	}
	// A reply buffer too small for a getattr reply gets an Rlerror.
	out := make([]byte, 64)
	n := r.s.HandleTo(context.Background(), tmsg(tgetattr, 9, f, uint64(0)), out)
	if resp := parseR(t, out[:n]); resp.errno() != unix.EMSGSIZE || resp.tag != 9 {
		t.Errorf("getattr into 64 bytes: %s", resp)
	}
	// A Tread into a small buffer is cut to fit.
	n = r.s.HandleTo(context.Background(), tmsg(tread, 9, f, uint64(0), uint32(1000)), out[:16])
	if resp := parseR(t, out[:n]); resp.typ != tread+1 || string(resp.body[4:]) != helloText[:5] {
		t.Errorf("read into 16 bytes: %s %q", resp, resp.body)
	}
	if st := r.s.Stats(); st.Panics != 0 || st.Errors == 0 {
		t.Errorf("stats %+v", st)
	}
}

func TestFidLimit(t *testing.T) {
	r := newRaw(t, testTree(), Options{MaxFids: 3})
	r.walkTo("etc")
	r.walkTo("bin")
	r.wantErr("walk past the limit", tmsg(twalk, 1, uint32(1), uint32(200), uint16(0)), unix.EMFILE)
	r.wantErr("attach past the limit", tmsg(tattach, 1, uint32(201), uint32(NoFid), "", "", uint32(0)), unix.EMFILE)
	r.wantErr("xattrwalk past the limit", tmsg(txattrwalk, 1, uint32(1), uint32(202), ""), unix.EMFILE)
	// Walking a fid in place needs no new entry.
	if resp := r.do(tmsg(twalk, 1, uint32(1), uint32(1), uint16(1), "etc")); resp.typ != twalk+1 {
		t.Errorf("walk in place at the limit: %s", resp)
	}
	r.do(tmsg(tclunk, 1, uint32(100)))
	if resp := r.do(tmsg(twalk, 1, uint32(1), uint32(200), uint16(0))); resp.typ != twalk+1 {
		t.Errorf("walk after a clunk: %s", resp)
	}
}

func TestBlockingReadRaw(t *testing.T) {
	tree := testTree()
	r := newRaw(t, tree, Options{})
	slow := r.walkOpen("slow")
	bad := r.walkOpen("bad")

	// The caller's ctx bounds a read blocked on a fetch.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	start := time.Now()
	if resp := r.doCtx(ctx, tmsg(tread, 1, slow, uint64(0), uint32(10))); resp.errno() != unix.EINTR {
		t.Errorf("blocked read after its ctx ended: %s, want EINTR", resp)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("blocked read took %v", d)
	}
	<-tree.blockStarted
	r.wantErr("EIO from the tree", tmsg(tread, 1, bad, uint64(0), uint32(10)), unix.EIO)

	// Tflush of a blocked read: the read is cancelled and answered, and
	// Rflush comes only after the read's reply was delivered.
	var mu sync.Mutex
	var order []string
	readDone := make(chan rmsg, 1)
	go func() {
		resp := make([]byte, 1024)
		r.s.Serve(context.Background(), tmsg(tread, 7, slow, uint64(0), uint32(10)), resp, func(b []byte) {
			time.Sleep(20 * time.Millisecond) // a slow delivery
			mu.Lock()
			order = append(order, "read")
			mu.Unlock()
			readDone <- parseR(t, append([]byte(nil), b...))
		})
	}()
	<-tree.blockStarted
	fresp := make([]byte, 64)
	n := r.s.Serve(context.Background(), tmsg(tflush, 8, uint16(7)), fresp, func([]byte) {
		mu.Lock()
		order = append(order, "flush")
		mu.Unlock()
	})
	if resp := parseR(t, fresp[:n]); resp.typ != tflush+1 || resp.tag != 8 || len(resp.body) != 0 {
		t.Errorf("Rflush: %s", resp)
	}
	if resp := <-readDone; resp.errno() != unix.EINTR || resp.tag != 7 {
		t.Errorf("flushed read: %s", resp)
	}
	if fmt.Sprint(order) != "[read flush]" {
		t.Errorf("delivery order %v, want the read before the flush", order)
	}
	// A flush of a tag not in flight, or of itself, is answered at once.
	if resp := r.do(tmsg(tflush, 9, uint16(1234))); resp.typ != tflush+1 {
		t.Errorf("flush of an idle tag: %s", resp)
	}
	if resp := r.do(tmsg(tflush, 9, uint16(9))); resp.typ != tflush+1 {
		t.Errorf("flush of itself: %s", resp)
	}
}

func TestLogLimiter(t *testing.T) {
	var buf bytes.Buffer
	var mu sync.Mutex
	log := newTestLogger(&buf, &mu)
	l := newLogLimiter(log, 1, 3)
	for range 10 {
		l.logf(-4, "bad message") // slog.LevelDebug
	}
	mu.Lock()
	got := strings.Count(buf.String(), "bad message")
	mu.Unlock()
	if got != 3 {
		t.Errorf("%d records let through of 10 at burst 3", got)
	}
	l.mu.Lock()
	l.last = l.last.Add(-2 * time.Second) // two seconds pass: two tokens
	l.mu.Unlock()
	l.logf(-4, "bad message")
	mu.Lock()
	defer mu.Unlock()
	if !strings.Contains(buf.String(), "suppressed=7") {
		t.Errorf("the record after the limit does not count what was held back:\n%s", buf.String())
	}
}

// TestFlushOfBegunCall flushes a request the device has taken from its
// queue but not yet served: the flush waits for it, and the request, its
// context cancelled, ends at once.
func TestFlushOfBegunCall(t *testing.T) {
	tree := testTree()
	r := newRaw(t, tree, Options{})
	slow := r.walkOpen("slow")
	call := r.s.Begin(context.Background(), 7)
	flushed := make(chan rmsg, 1)
	go func() { flushed <- parseR(t, r.s.Handle(context.Background(), tmsg(tflush, 8, uint16(7)))) }()
	select {
	case resp := <-flushed:
		t.Fatalf("Rflush before the flushed request was served: %s", resp)
	case <-time.After(20 * time.Millisecond):
	}
	out := make([]byte, 64)
	n := call.Serve(tmsg(tread, 7, slow, uint64(0), uint32(10)), out, nil)
	if resp := parseR(t, out[:n]); resp.errno() != unix.EINTR {
		t.Errorf("flushed request: %s, want EINTR", resp)
	}
	if resp := <-flushed; resp.typ != tflush+1 {
		t.Errorf("flush: %s", resp)
	}
}

// TestXattrHeldLimit makes xattr fids on a large value until the server
// refuses to hold more, and checks that clunks give the room back.
func TestXattrHeldLimit(t *testing.T) {
	tree := testTree()
	hello := tree.nodes[tree.paths["/etc/hello"]]
	hello.xattrs["user.big"] = bytes.Repeat([]byte{'x'}, maxXattrSize)
	r := newRaw(t, tree, Options{})
	f := r.walkTo("etc/hello")
	const fits = maxXattrHeld / maxXattrSize
	for i := range fits {
		if resp := r.do(tmsg(txattrwalk, 1, f, uint32(1000+i), "user.big")); resp.typ != txattrwalk+1 {
			t.Fatalf("xattr fid %d: %s", i, resp)
		}
	}
	r.wantErr("one xattr fid too many", tmsg(txattrwalk, 1, f, uint32(5000), "user.big"), unix.ENOMEM)
	if resp := r.do(tmsg(txattrwalk, 1, f, uint32(5000), "user.note")); resp.errno() != unix.ENOMEM {
		t.Errorf("a small value past the limit: %s", resp)
	}
	r.do(tmsg(tclunk, 1, uint32(1000)))
	if resp := r.do(tmsg(txattrwalk, 1, f, uint32(5000), "user.big")); resp.typ != txattrwalk+1 {
		t.Errorf("after a clunk: %s", resp)
	}
	// A saved session holds the same, and restores.
	st, err := r.s.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	s2 := NewServer(tree, Options{})
	if err := s2.RestoreState(st); err != nil {
		t.Fatal(err)
	}
	r2 := &raw{t: t, s: s2}
	r2.wantErr("restored server at the limit", tmsg(txattrwalk, 1, f, uint32(5001), "user.big"), unix.ENOMEM)
}

// TestDirCache checks that fids share a directory's listing and that the
// budget evicts.
func TestDirCache(t *testing.T) {
	tree := testTree()
	c := newDirCache(manyFiles + 4)
	a, err := c.list(tree, tree.paths["/many"])
	if err != nil || len(a) != manyFiles {
		t.Fatalf("list: %d %v", len(a), err)
	}
	b, _ := c.list(tree, tree.paths["/many"])
	if &a[0] != &b[0] {
		t.Error("second listing not from the cache")
	}
	if _, err := c.list(tree, tree.paths["/etc"]); err != nil {
		t.Fatal(err)
	}
	if c.n != manyFiles+3 || len(c.byIno) != 2 {
		t.Errorf("cache holds %d entries in %d listings", c.n, len(c.byIno))
	}
	if _, err := c.list(tree, tree.paths["/dev"]); err != nil {
		t.Fatal(err)
	}
	if _, ok := c.byIno[tree.paths["/many"]]; ok || c.n > c.max {
		t.Errorf("over budget: %d entries, /many still cached: %v", c.n, ok)
	}
	small := newDirCache(10)
	if ents, err := small.list(tree, tree.paths["/many"]); err != nil || len(ents) != manyFiles || small.n != 0 {
		t.Errorf("a listing over the budget: %d entries, %d cached, %v", len(ents), small.n, err)
	}
	if _, err := c.list(tree, tree.paths["/etc/hello"]); err == nil {
		t.Error("listing a file succeeded")
	}
}
