package erofs

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io/fs"
	"math/rand/v2"
	"slices"
	"strings"
	"syscall"
	"testing"

	goerofs "github.com/erofs/go-erofs"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// TestBuildErrors feeds Build trees the format cannot hold, as a hostile
// image's table of contents could: each must be an error naming the path
// and the fault, never a panic.
func TestBuildErrors(t *testing.T) {
	root := func(m *memFS) *memNode { return m.nodes[1] }
	tests := []struct {
		name  string
		setup func(m *memFS)
		opts  Options
		want  []string // substrings of the error
		errno error    // an errno the error must wrap, if any
	}{
		{name: "empty name", setup: func(m *memFS) { m.entry(m.mkdir("d", 0o755), "", m.newIno(syscall.S_IFREG)) }, want: []string{"/d", "empty name"}},
		{name: "dot", setup: func(m *memFS) { m.entry(root(m), ".", m.newIno(syscall.S_IFREG)) }, want: []string{`"."`}},
		{name: "dotdot", setup: func(m *memFS) { m.entry(root(m), "..", m.newIno(syscall.S_IFREG)) }, want: []string{`".."`}},
		{name: "slash", setup: func(m *memFS) { m.entry(root(m), "a/b", m.newIno(syscall.S_IFREG)) }, want: []string{`"a/b"`, "'/'"}},
		{name: "NUL in name", setup: func(m *memFS) { m.entry(root(m), "a\x00b", m.newIno(syscall.S_IFREG)) }, want: []string{"NUL"}},
		{name: "name of 256 bytes", setup: func(m *memFS) { m.entry(root(m), strings.Repeat("n", 256), m.newIno(syscall.S_IFREG)) }, want: []string{"256 bytes, over 255"}},
		{name: "two entries of one name", setup: func(m *memFS) { m.file("x/dup", 0o644, nil); m.file("x/dup", 0o644, nil) }, want: []string{"/x", `two entries named "dup"`}},
		{name: "empty symlink", setup: func(m *memFS) { m.symlink("l/empty", "") }, want: []string{"/l/empty", "empty symlink target"}},
		{name: "symlink of 4096 bytes", setup: func(m *memFS) { m.symlink("long", strings.Repeat("t", 4096)) }, want: []string{"/long", "4096 bytes, over 4095"}},
		{name: "NUL in symlink", setup: func(m *memFS) { m.symlink("nul", "a\x00b") }, want: []string{"/nul", "NUL"}},
		{name: "hardlinked directory", setup: func(m *memFS) { m.entry(m.mkdir("b", 0o755), "again", m.mkdir("a", 0o755)) }, want: []string{"/b/again", "reached twice", "/a"}},
		{name: "cycle to the root", setup: func(m *memFS) { m.entry(m.mkdir("a/b", 0o755), "up", root(m)) }, want: []string{"/a/b/up", "reached twice"}},
		{name: "directory in itself", setup: func(m *memFS) { d := m.mkdir("d", 0o755); m.entry(d, "self", d) }, want: []string{"/d/self", "reached twice"}},
		{name: "xattr value of 65536 bytes", setup: func(m *memFS) { m.file("f", 0o644, nil).setxattr("user.big", make([]byte, 65536)) }, want: []string{"/f", `"user.big"`, "65536 bytes, over 65535"}},
		{name: "xattrs too big for an inode", setup: func(m *memFS) {
			f := m.file("f", 0o644, nil)
			for _, n := range []string{"user.1", "user.2", "user.3", "user.4", "user.5"} {
				f.setxattr(n, make([]byte, 65535))
			}
		}, want: []string{"/f", "xattrs take"}},
		{name: "xattr listed twice", setup: func(m *memFS) {
			f := m.file("f", 0o644, nil).setxattr("user.a", nil)
			f.xorder = append(f.xorder, "user.a")
		}, want: []string{"/f", "listed twice"}},
		{name: "xattr listed but absent", setup: func(m *memFS) { f := m.file("f", 0o644, nil); f.xorder = []string{"user.gone"} }, want: []string{"/f", "getxattr"}, errno: syscall.ENODATA},
		{name: "major of 13 bits", setup: func(m *memFS) { m.special("dev", syscall.S_IFCHR|0o600, unix.Mkdev(4096, 0)) }, want: []string{"/dev", "4096:0"}},
		{name: "minor of 21 bits", setup: func(m *memFS) { m.special("dev", syscall.S_IFBLK|0o600, unix.Mkdev(1, 1<<20)) }, want: []string{"/dev", "1:1048576"}},
		{name: "no file type", setup: func(m *memFS) { m.special("weird", 0o644, 0) }, want: []string{"/weird", "unsupported file type"}},
		{name: "unknown file type", setup: func(m *memFS) { m.special("weird", 0o170644, 0) }, want: []string{"/weird", "unsupported file type"}},
		{name: "mode beyond 16 bits", setup: func(m *memFS) { m.special("weird", 1<<20|syscall.S_IFREG|0o644, 0) }, want: []string{"/weird", "bits beyond"}},
		{name: "negative size", setup: func(m *memFS) { m.file("neg", 0o644, nil).attr.Size = -1 }, want: []string{"/neg", "negative size"}},
		{name: "size past 32-bit blocks", setup: func(m *memFS) { m.file("huge", 0o644, nil).attr.Size = 1 << 62 }, want: []string{"/huge", "32-bit"}},
		{name: "image past 32-bit blocks", setup: func(m *memFS) {
			m.file("a", 0o644, nil).attr.Size = 3 << 42 // 3/4 of 2^32 blocks
			m.file("b", 0o644, nil).attr.Size = 3 << 42
		}, want: []string{"/b", "image over 4294967295 blocks"}},
		{name: "dangling inode", setup: func(m *memFS) { m.entry(root(m), "ghost", &memNode{attr: rofs.Attr{Ino: 999, Mode: syscall.S_IFREG}}) }, want: []string{"/ghost", "inode 999"}, errno: syscall.ENOENT},
		{name: "root not a directory", setup: func(m *memFS) { root(m).attr.Mode = syscall.S_IFREG | 0o644 }, want: []string{"root", "not a directory"}},
		{name: "volume name of 16 bytes", opts: Options{VolumeName: "0123456789abcdef"}, want: []string{"16 bytes, over 15"}},
		{name: "NUL in volume name", opts: Options{VolumeName: "a\x00"}, want: []string{"volume name", "NUL"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := newMemFS()
			if tc.setup != nil {
				tc.setup(m)
			}
			im, err := Build(context.Background(), m, tc.opts)
			if err == nil {
				t.Fatalf("Build succeeded (%d inodes), want an error", im.Inodes())
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q lacks %q", err, w)
				}
			}
			if tc.errno != nil && !errors.Is(err, tc.errno) {
				t.Errorf("error %q does not wrap %v", err, tc.errno)
			}
		})
	}
}

// TestBuildCanceled: Build stops when its context is done.
func TestBuildCanceled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := Build(ctx, richFS(), Options{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("Build = %v, want context.Canceled", err)
	}
}

// limitsFS is a tree of the largest of everything the format holds.
func limitsFS() *memFS {
	m := newMemFS()
	m.file(strings.Repeat("n", 255), 0o644, []byte("x"))
	m.symlink("link", strings.Repeat("t", 4095))
	m.special("dev", syscall.S_IFCHR|0o600, unix.Mkdev(4095, 1<<20-1))
	f := m.file("xattrs", 0o644, nil)
	f.setxattr("user.max", make([]byte, 65535))
	f.setxattr("user."+strings.Repeat("k", 250), []byte("longest name"))
	f.setxattr("security.x", make([]byte, 65535))
	// A directory, a symlink and a file whose xattrs take more than a
	// block: they start on a block, their xattrs cross into the next.
	m.mkdir("bigx", 0o755).setxattr("user.v", make([]byte, 5000))
	m.symlink("bigx/l", strings.Repeat("u", 3000)).setxattr("user.v", make([]byte, 5000))
	m.file("bigx/f", 0o644, []byte("data")).setxattr("trusted.v", make([]byte, 9000))
	return m
}

// TestLimits: the largest of everything the format holds builds and
// reads back, and so does a 1 TiB file (not read back).
func TestLimits(t *testing.T) {
	buildOK(t, limitsFS(), Options{VolumeName: "0123456789abcde"})
	m := limitsFS()
	m.file("hugefile", 0o644, nil).attr.Size = 1 << 40
	im, err := Build(context.Background(), m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if im.Size() < 1<<40 {
		t.Fatalf("Size %d", im.Size())
	}
}

// TestDeterministic: the same tree gives the same image, whatever order
// the tree lists directories and xattrs in.
func TestDeterministic(t *testing.T) {
	a, err := Build(context.Background(), richFS(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	m := richFS()
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range m.nodes {
		rng.Shuffle(len(n.kids), func(i, j int) { n.kids[i], n.kids[j] = n.kids[j], n.kids[i] })
		rng.Shuffle(len(n.xorder), func(i, j int) { n.xorder[i], n.xorder[j] = n.xorder[j], n.xorder[i] })
	}
	before := slices.Clone(m.nodes[1].kids)
	b, err := Build(context.Background(), m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(before, m.nodes[1].kids) {
		t.Error("Build reordered the slice ReadDir returned")
	}
	if a.Digest() != b.Digest() || a.Size() != b.Size() {
		t.Fatalf("digests %s and %s, sizes %d and %d", a.Digest(), b.Digest(), a.Size(), b.Size())
	}
	if !bytes.Equal(materialize(t, a), materialize(t, b)) {
		t.Fatal("same tree, different images")
	}
	m.nodes[1].attr.UID = 7
	c, err := Build(context.Background(), m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if c.Digest() == a.Digest() {
		t.Error("a changed owner left the digest as it was")
	}
}

// rawInodeAt decodes the fields of the inode at nid that the order tests
// need: i_u (the first block) and size.
func rawInodeAt(t *testing.T, im *Image, nid int64) (blk uint32, size uint64) {
	t.Helper()
	var b [inodeSize]byte
	if _, err := im.ReadAt(context.Background(), b[:], nid*slotSize); err != nil {
		t.Fatal(err)
	}
	return binary.LittleEndian.Uint32(b[16:]), binary.LittleEndian.Uint64(b[8:])
}

// TestLayoutOrder: inodes are placed breadth-first from the root (first,
// its nid within 16 bits), each directory's children together in name
// order; files' data in the same order.
func TestLayoutOrder(t *testing.T) {
	m := newMemFS()
	m.file("c/x", 0o644, []byte("cx"))
	m.file("b/y", 0o644, []byte("by"))
	m.file("a", 0o644, []byte("a"))
	m.file("b/z", 0o644, []byte("bz"))
	m.file("d", 0o644, []byte("d"))
	im, _ := buildOK(t, m, Options{})
	img, err := goerofs.Open(readerAt{im})
	if err != nil {
		t.Fatal(err)
	}
	order := []string{".", "a", "b", "c", "d", "b/y", "b/z", "c/x"}
	var prevNid int64 = -1
	var prevBlk uint32
	for _, p := range order {
		fi, err := img.(fs.ReadLinkFS).Lstat(p)
		if err != nil {
			t.Fatal(err)
		}
		nid := fi.Sys().(*goerofs.Stat).Ino
		if nid <= prevNid {
			t.Errorf("%s: nid %d after %d", p, nid, prevNid)
		}
		if p == "." && nid != (superOffset+superSize)/slotSize {
			t.Errorf("root nid %d, want the first slot after the superblock", nid)
		}
		prevNid = nid
		if fi.Mode().IsRegular() {
			blk, _ := rawInodeAt(t, im, nid)
			if int64(blk)*BlockSize < im.MetadataSize() || blk <= prevBlk {
				t.Errorf("%s: data at block %d (after %d; metadata %d blocks)", p, blk, prevBlk, im.MetadataSize()/BlockSize)
			}
			prevBlk = blk
		}
	}
}

// TestLazy: Build reads no file data, nor does reading the metadata; a
// block of a file reads that block only.
func TestLazy(t *testing.T) {
	m := richFS()
	im, err := Build(context.Background(), m, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if n := m.readCalls.Load(); n != 0 {
		t.Fatalf("Build made %d ReadAt calls", n)
	}
	meta := make([]byte, im.MetadataSize())
	if _, err := im.ReadAt(context.Background(), meta, 0); err != nil {
		t.Fatal(err)
	}
	if n := m.readCalls.Load(); n != 0 {
		t.Fatalf("reading the metadata made %d ReadAt calls", n)
	}
	img, err := goerofs.Open(readerAt{im})
	if err != nil {
		t.Fatal(err)
	}
	// Listing the whole tree and stat-ing every file reads no data.
	err = fs.WalkDir(img, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		_, err = img.(fs.ReadLinkFS).Lstat(p)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := m.readCalls.Load(); n != 0 {
		t.Fatalf("walking the tree made %d ReadAt calls", n)
	}
	fi, err := img.(fs.ReadLinkFS).Lstat("big/ten-mib")
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := rawInodeAt(t, im, fi.Sys().(*goerofs.Stat).Ino)
	buf := make([]byte, BlockSize)
	off := (int64(blk) + 100) * BlockSize
	if _, err := im.ReadAt(context.Background(), buf, off); err != nil {
		t.Fatal(err)
	}
	want := make([]byte, BlockSize)
	patternAt(100*BlockSize, want)
	if !bytes.Equal(buf, want) {
		t.Error("block 100 of the big file differs")
	}
	if n := m.dataReads.Load(); n != BlockSize {
		t.Errorf("reading one block read %d bytes of file data", n)
	}
}
