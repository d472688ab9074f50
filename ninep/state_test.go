package ninep

import (
	"encoding/binary"
	"encoding/json"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

type lockedWriter struct {
	w  io.Writer
	mu *sync.Mutex
}

func (l lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

func newTestLogger(w io.Writer, mu *sync.Mutex) *slog.Logger {
	return slog.New(slog.NewTextHandler(lockedWriter{w, mu}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

// TestStateRoundTrip saves a session with open files, a directory being
// listed, a deep directory and an xattr fid, restores it into a new server
// over a tree built again, and carries on with the old fids.
func TestStateRoundTrip(t *testing.T) {
	r := newRaw(t, testTree(), Options{})
	big := r.walkOpen("big")
	many := r.walkOpen("many")
	deep := r.walkTo("deep/a/b/c")
	link := r.walkTo("etc/link")
	xf := uint32(900)
	if resp := r.do(tmsg(txattrwalk, 1, r.walkTo("bin/ping"), xf, "security.capability")); resp.typ != txattrwalk+1 {
		t.Fatal(resp)
	}
	resp := r.do(tmsg(treaddir, 1, many, uint64(0), uint32(200)))
	if resp.typ != treaddir+1 {
		t.Fatal(resp)
	}
	st, err := r.s.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	var decoded State
	if err := json.Unmarshal(st, &decoded); err != nil || decoded.Version != StateVersion || decoded.Msize != 64<<10 || len(decoded.Fids) != r.s.Fids() {
		t.Fatalf("state %s: %v", st, err)
	}

	tree2 := testTree()
	s2 := NewServer(tree2, Options{})
	if err := s2.RestoreState(st); err != nil {
		t.Fatalf("RestoreState: %v", err)
	}
	r2 := &raw{t: t, s: s2, root: r.root, nextFid: r.nextFid}
	if s2.Msize() != 64<<10 || s2.Fids() != r.s.Fids() {
		t.Fatalf("restored msize %d, %d fids", s2.Msize(), s2.Fids())
	}
	// The same requests give the same replies.
	for _, req := range [][]byte{
		tmsg(tread, 1, big, uint64(100000), uint32(5000)),
		tmsg(treaddir, 1, many, uint64(17), uint32(300)),
		tmsg(tgetattr, 1, deep, uint64(getattrBasic)),
		tmsg(twalk, 1, deep, uint32(901), uint16(4), "..", "..", "..", ".."),
		tmsg(treadlink, 1, link),
		tmsg(tread, 1, xf, uint64(0), uint32(100)),
	} {
		a, b := r.do(req), r2.do(req)
		if a.typ != b.typ || string(a.body) != string(b.body) || a.errno() != 0 {
			t.Errorf("request type %d: %s before, %s after restore", req[4], a, b)
		}
	}
	// The state restores again into the same server, replacing its table.
	r2.do(tmsg(tclunk, 1, big))
	if err := s2.RestoreState(st); err != nil {
		t.Fatal(err)
	}
	if resp := r2.do(tmsg(tread, 1, big, uint64(0), uint32(1))); resp.typ != tread+1 {
		t.Errorf("read after restoring over a clunk: %s", resp)
	}
}

func TestRestoreStateRefuses(t *testing.T) {
	tree := testTree()
	ino := tree.paths
	good := func(f func(*State)) json.RawMessage {
		st := State{Version: StateVersion, Msize: 8192, Fids: []FidState{{Fid: 1, Path: []uint64{tree.root}}}}
		f(&st)
		b, _ := json.Marshal(st)
		return b
	}
	tests := []struct {
		name  string
		state json.RawMessage
		want  string
	}{
		{"not JSON", json.RawMessage("{"), "9P server state"},
		{"unknown field", json.RawMessage(`{"version":1,"msize":8192,"fids":[],"extra":1}`), "unknown field"},
		{"another version", good(func(s *State) { s.Version = 2 }), "version 2"},
		{"msize too large", good(func(s *State) { s.Msize = DefaultMsize + 1 }), "msize 512001"},
		{"msize too small", good(func(s *State) { s.Msize = 100 }), "msize 100"},
		{"fids without msize", good(func(s *State) { s.Msize = 0 }), "no msize"},
		{"duplicate fid", good(func(s *State) { s.Fids = append(s.Fids, s.Fids[0]) }), "fid 1 appears twice"},
		{"empty path", good(func(s *State) { s.Fids[0].Path = nil }), "empty path"},
		{"not from the root", good(func(s *State) { s.Fids[0].Path = []uint64{ino["/etc"]} }), "root is"},
		{"missing inode", good(func(s *State) { s.Fids[0].Path = []uint64{tree.root, 99999} }), "inode 99999 is not in the tree"},
		{"file on the path", good(func(s *State) { s.Fids[0].Path = []uint64{tree.root, ino["/big"], ino["/etc"]} }), "not a directory"},
		{"missing xattr", good(func(s *State) { s.Fids[0].Xattr = &XattrState{Name: "user.gone"} }), "user.gone"},
		{"open for writing", good(func(s *State) { s.Fids[0].Open, s.Fids[0].Flags = true, unix.O_RDWR }), "ask to write"},
		{"open symlink", good(func(s *State) {
			s.Fids[0].Path, s.Fids[0].Open = []uint64{tree.root, ino["/etc"], ino["/etc/link"]}, true
		}), "neither"},
		{"open xattr fid", good(func(s *State) { s.Fids[0].Open, s.Fids[0].Xattr = true, &XattrState{} }), "cannot be open"},
		{"NOFID", good(func(s *State) { s.Fids[0].Fid = NoFid }), "NOFID"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := NewServer(tree, Options{})
			r := newRaw(t, tree, Options{})
			s = r.s
			before := s.Fids()
			err := s.RestoreState(tt.state)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("RestoreState: %v, want an error containing %q", err, tt.want)
			}
			if s.Fids() != before || s.Msize() != 64<<10 {
				t.Errorf("a refused state changed the server: %d fids, msize %d", s.Fids(), s.Msize())
			}
		})
	}
	s := NewServer(tree, Options{MaxFids: 1})
	if err := s.RestoreState(good(func(s *State) { s.Fids = append(s.Fids, FidState{Fid: 2, Path: []uint64{tree.root}}) })); err == nil || !strings.Contains(err.Error(), "at most 1") {
		t.Errorf("too many fids: %v", err)
	}
}

// TestStateNamedRoot checks that a fid under a named tree's root is saved
// and restored, and refused by a server whose FS no longer serves it.
func TestStateNamedRoot(t *testing.T) {
	tree := testTree()
	named := namedTree{tree, map[string]uint64{"deep": tree.paths["/deep/a"]}}
	r := &raw{t: t, s: NewServer(named, Options{}), root: 1, nextFid: 100}
	r.do(tmsg(tversion, NoTag, uint32(64<<10), "9P2000.L"))
	if resp := r.do(tmsg(tattach, 1, uint32(1), uint32(NoFid), "", "deep", uint32(0))); resp.typ != tattach+1 {
		t.Fatalf("attach: %s", resp)
	}
	f := r.walkTo("b/c")
	st, err := r.s.SaveState()
	if err != nil {
		t.Fatal(err)
	}
	s2 := NewServer(namedTree{testTree(), named.names}, Options{})
	if err := s2.RestoreState(st); err != nil {
		t.Fatalf("RestoreState: %v", err)
	}
	r2 := &raw{t: t, s: s2}
	resp := r2.do(tmsg(twalk, 1, f, uint32(3), uint16(3), "..", "..", ".."))
	if resp.typ != twalk+1 || binary.LittleEndian.Uint64(resp.body[2+2*13+5:]) != tree.paths["/deep/a"] {
		t.Errorf("../../.. from b/c of tree deep: %s", resp)
	}
	for _, fs := range []rofs.FS{testTree(), namedTree{testTree(), map[string]uint64{"other": tree.paths["/etc"]}}} {
		if err := NewServer(fs, Options{}).RestoreState(st); err == nil || !strings.Contains(err.Error(), "no named tree's root") {
			t.Errorf("RestoreState without the named tree: %v", err)
		}
	}
}

// TestStateSharesAncestors checks that restored fids under one directory
// share its node, and that ".." still walks up from a restored fid.
func TestStateSharesAncestors(t *testing.T) {
	tree := testTree()
	st := State{Version: StateVersion, Msize: 8192, Fids: []FidState{
		{Fid: 1, Path: []uint64{tree.root, tree.paths["/deep"], tree.paths["/deep/a"]}},
		{Fid: 2, Path: []uint64{tree.root, tree.paths["/deep"], tree.paths["/deep/a"], tree.paths["/deep/a/b"]}},
	}}
	b, _ := json.Marshal(st)
	s := NewServer(tree, Options{})
	if err := s.RestoreState(b); err != nil {
		t.Fatal(err)
	}
	if s.fids[2].node.parent != s.fids[1].node {
		t.Error("fid 2's parent node is not fid 1's node")
	}
	r := &raw{t: t, s: s}
	resp := r.do(tmsg(twalk, 1, uint32(2), uint32(3), uint16(2), "..", ".."))
	if got := binary.LittleEndian.Uint64(resp.body[2+13+5:]); got != tree.paths["/deep"] {
		t.Errorf("../.. from /deep/a/b is inode %d, want %d", got, tree.paths["/deep"])
	}
}
