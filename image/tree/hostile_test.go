package tree

import (
	"errors"
	"strings"
	"testing"

	"github.com/containerd/stargz-snapshotter/estargz"
)

// TestBuildHostile feeds Build TOCs no honest layer has: each must give a
// *BuildError naming the layer and entry and saying what is wrong.
func TestBuildHostile(t *testing.T) {
	long := strings.Repeat("x", MaxNameLen+1)
	deep := strings.Repeat("d/", MaxPathLen/2) + "f"
	with := func(e *estargz.TOCEntry, f func(*estargz.TOCEntry)) *estargz.TOCEntry { f(e); return e }
	tests := []struct {
		name   string
		layers []Layer
		layer  int
		entry  int // -1: the layer
		want   string
	}{
		{"nil TOC", []Layer{layerOf(), {}}, 1, -1, "no TOC"},
		{"null entry", []Layer{layerOf(regE("a", 0o644, 0), nil)}, 0, 1, "null entry"},
		{"dotdot", []Layer{layerOf(regE("../etc/passwd", 0o644, 0))}, 0, 0, `".." path element`},
		{"dotdot inside", []Layer{layerOf(regE("ok", 0, 0)), layerOf(regE("a/../../b", 0o644, 0))}, 1, 0, `".." path element`},
		{"dot inside", []Layer{layerOf(regE("a/./b", 0o644, 0))}, 0, 0, `"." path element`},
		{"empty element", []Layer{layerOf(regE("a//b", 0o644, 0))}, 0, 0, "empty path element"},
		{"NUL", []Layer{layerOf(regE("a\x00b", 0o644, 0))}, 0, 0, "NUL in name"},
		{"long name", []Layer{layerOf(regE("d/"+long, 0o644, 0))}, 0, 0, "over 255"},
		{"long path", []Layer{layerOf(regE(deep, 0o644, 0))}, 0, 0, "over 4096"},
		{"unknown type", []Layer{layerOf(&estargz.TOCEntry{Name: "s", Type: "socket"})}, 0, 0, `unknown entry type "socket"`},
		{"root not a dir", []Layer{layerOf(regE("./", 0o644, 0))}, 0, 0, "root is a reg entry"},
		{"hardlink to nowhere", []Layer{layerOf(linkE("a", "b"))}, 0, 0, `hardlink to "b": no such file`},
		{"hardlink to a whited out file", []Layer{layerOf(regE("a", 0o644, 0)), layerOf(regE(".wh.a", 0, 0), linkE("b", "a"))}, 1, 1, "no such file"},
		{"hardlink to a directory", []Layer{layerOf(dirE("d", 0o755), linkE("a", "d"))}, 0, 1, `hardlink to directory "d"`},
		{"hardlink to the root", []Layer{layerOf(linkE("a", "/"))}, 0, 0, "hardlink to the root"},
		{"hardlink bad target", []Layer{layerOf(linkE("a", "../x"))}, 0, 0, "bad hardlink target"},
		{"hardlink loop", []Layer{layerOf(linkE("a", "b"), linkE("b", "a"))}, 0, 0, "hardlink cycle"},
		{"hardlink loop of three over lower files", []Layer{layerOf(regE("a", 0, 0), regE("b", 0, 0), regE("c", 0, 0)), layerOf(linkE("a", "b"), linkE("b", "c"), linkE("c", "a"))}, 1, 0, "hardlink cycle"},
		{"chunk first", []Layer{layerOf(chunkE("a", 0, 1))}, 0, 0, "chunk entry with no reg entry before it"},
		{"chunk after a dir", []Layer{layerOf(dirE("d", 0o755), chunkE("d", 0, 1))}, 0, 1, "chunk entry after a dir entry"},
		{"chunk of another file", []Layer{layerOf(with(regE("a", 0o644, 4), func(e *estargz.TOCEntry) { e.ChunkSize = 2 }), chunkE("b", 2, 2))}, 0, 0, `chunk 1 is named "b"`},
		{"empty file with chunks", []Layer{layerOf(regE("a", 0o644, 0), chunkE("a", 0, 0))}, 0, 0, "empty file with 1 chunk entries"},
		{"first chunk not at 0", []Layer{layerOf(with(regE("a", 0o644, 4), func(e *estargz.TOCEntry) { e.ChunkOffset = 1 }))}, 0, 0, "chunk 0 at 1, want 0"},
		{"overlapping chunks", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkSize = 6 }), chunkE("a", 4, 6))}, 0, 0, "chunk 1 at 4, want 6"},
		{"gap between chunks", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkSize = 4 }), chunkE("a", 6, 4))}, 0, 0, "chunk 1 at 6, want 4"},
		{"chunks out of order", []Layer{layerOf(with(regE("a", 0o644, 9), func(e *estargz.TOCEntry) { e.ChunkSize = 3 }), chunkE("a", 6, 3), chunkE("a", 3, 3))}, 0, 0, "chunk 1 at 6, want 3"},
		{"chunk past the end", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkSize = 6 }), chunkE("a", 6, 6))}, 0, 0, "runs past the end"},
		{"chunk after the end", []Layer{layerOf(regE("a", 0o644, 10), chunkE("a", 10, 0))}, 0, 0, "past the end of the 10-byte file"},
		{"chunks short of the end", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkSize = 4 }), chunkE("a", 4, 4))}, 0, 0, "chunks cover 8 of the file's 10 bytes"},
		{"negative chunk size", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkSize = -1 }))}, 0, 0, "negative size or offset"},
		{"negative compressed offset", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.Offset = -5 }))}, 0, 0, "negative size or offset"},
		{"negative size", []Layer{layerOf(regE("a", 0o644, -1))}, 0, 0, "size -1 out of range"},
		{"giant size", []Layer{layerOf(regE("a", 0o644, 1<<62))}, 0, 0, "out of range"},
		{"giant chunk size", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkSize = 1<<63 - 1 }))}, 0, 0, "runs past the end"},
		{"no chunk digest", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkDigest = "" }))}, 0, 0, "bad chunk digest"},
		{"bad chunk digest", []Layer{layerOf(with(regE("a", 0o644, 10), func(e *estargz.TOCEntry) { e.ChunkDigest = "sha256:zz" }))}, 0, 0, "bad chunk digest"},
		{"data and no reader", []Layer{{TOC: &estargz.JTOC{Entries: []*estargz.TOCEntry{regE("a", 0o644, 1)}}}}, 0, 0, "no chunk reader"},
		{"negative mode", []Layer{layerOf(regE("a", -1, 0))}, 0, 0, "negative mode"},
		{"negative uid", []Layer{layerOf(with(regE("a", 0o644, 0), func(e *estargz.TOCEntry) { e.UID = -1 }))}, 0, 0, "owner -1:0 out of range"},
		{"huge gid", []Layer{layerOf(with(regE("a", 0o644, 0), func(e *estargz.TOCEntry) { e.GID = 1 << 40 }))}, 0, 0, "out of range"},
		{"bad device", []Layer{layerOf(&estargz.TOCEntry{Name: "c", Type: "char", DevMajor: -1})}, 0, 0, "device -1:0 out of range"},
		{"bad modtime", []Layer{layerOf(with(regE("a", 0o644, 0), func(e *estargz.TOCEntry) { e.ModTime3339 = "yesterday" }))}, 0, 0, `bad modtime "yesterday"`},
		{"empty xattr name", []Layer{layerOf(with(regE("a", 0o644, 0), func(e *estargz.TOCEntry) { e.Xattrs = map[string][]byte{"": nil} }))}, 0, 0, "empty name"},
		{"NUL in xattr name", []Layer{layerOf(with(regE("a", 0o644, 0), func(e *estargz.TOCEntry) { e.Xattrs = map[string][]byte{"user.\x00": nil} }))}, 0, 0, "NUL in xattr name"},
		{"huge xattr", []Layer{layerOf(with(regE("a", 0o644, 0), func(e *estargz.TOCEntry) { e.Xattrs = map[string][]byte{"user.x": make([]byte, 65537)} }))}, 0, 0, "over 65536"},
		{"symlink without target", []Layer{layerOf(symE("s", ""))}, 0, 0, "symlink with no target"},
		{"symlink with NUL", []Layer{layerOf(symE("s", "a\x00"))}, 0, 0, "NUL in symlink target"},
		{"symlink target too long", []Layer{layerOf(symE("s", strings.Repeat("a", MaxPathLen+1)))}, 0, 0, "over 4096"},
		{"whiteout of nothing", []Layer{layerOf(regE("d/.wh.", 0, 0))}, 0, 0, "empty path element"},
		{"whiteout of dotdot", []Layer{layerOf(regE("d/.wh...", 0, 0))}, 0, 0, `".." path element`},
		{"whiteout as a directory", []Layer{layerOf(regE("d/.wh.x/y", 0o644, 0))}, 0, 0, `whiteout ".wh.x" as a directory`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tr, err := Build(tc.layers, Options{})
			if err == nil {
				t.Fatalf("Build succeeded, with %d inodes", tr.Len())
			}
			var be *BuildError
			if !errors.As(err, &be) {
				t.Fatalf("Build: %v (%T), want a *BuildError", err, err)
			}
			if be.Layer != tc.layer || be.Entry != tc.entry {
				t.Errorf("Build: %v: at layer %d entry %d, want layer %d entry %d", err, be.Layer, be.Entry, tc.layer, tc.entry)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Build: %v, want it to say %q", err, tc.want)
			}
		})
	}
}
