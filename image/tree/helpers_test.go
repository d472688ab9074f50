package tree

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/opencontainers/go-digest"

	"github.com/kilnvm/kiln/rofs"
)

// tarFile is one entry of a test layer's tar stream.
type tarFile struct {
	name     string
	typ      byte // tar.Type*
	mode     int64
	uid, gid int
	data     string
	link     string
	major    int64
	minor    int64
	xattrs   map[string]string
	mtime    time.Time
}

func writeTar(t testing.TB, files []tarFile) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		h := &tar.Header{
			Name:     f.name,
			Typeflag: f.typ,
			Mode:     f.mode,
			Uid:      f.uid,
			Gid:      f.gid,
			Linkname: f.link,
			Devmajor: f.major,
			Devminor: f.minor,
			ModTime:  f.mtime,
			Format:   tar.FormatPAX,
		}
		if f.typ == tar.TypeReg {
			h.Size = int64(len(f.data))
		}
		for k, v := range f.xattrs {
			if h.PAXRecords == nil {
				h.PAXRecords = map[string]string{}
			}
			h.PAXRecords["SCHILY.xattr."+k] = v
		}
		if err := tw.WriteHeader(h); err != nil {
			t.Fatalf("tar header %s: %v", f.name, err)
		}
		if f.typ == tar.TypeReg {
			if _, err := io.WriteString(tw, f.data); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// estargzLayer builds a real estargz blob from files and returns the layer
// (its TOC as the blob holds it, parsed from the footer's offset, and an
// in-memory ChunkReader over the blob).
func estargzLayer(t testing.TB, files []tarFile, chunkSize, minChunkSize int) (Layer, *memChunks) {
	t.Helper()
	tb := writeTar(t, files)
	blob, err := estargz.Build(io.NewSectionReader(bytes.NewReader(tb), 0, int64(len(tb))),
		estargz.WithChunkSize(chunkSize), estargz.WithMinChunkSize(minChunkSize),
		estargz.WithParallelism(1), estargz.WithCompressionLevel(gzip.BestSpeed))
	if err != nil {
		t.Fatalf("estargz.Build: %v", err)
	}
	defer blob.Close()
	b, err := io.ReadAll(blob)
	if err != nil {
		t.Fatal(err)
	}
	sr := io.NewSectionReader(bytes.NewReader(b), 0, int64(len(b)))
	tocOff, footerSize, err := estargz.OpenFooter(sr)
	if err != nil {
		t.Fatalf("OpenFooter: %v", err)
	}
	toc, tocDigest, err := new(estargz.GzipDecompressor).ParseTOC(bytes.NewReader(b[tocOff : int64(len(b))-footerSize]))
	if err != nil {
		t.Fatalf("ParseTOC: %v", err)
	}
	if tocDigest != blob.TOCDigest() {
		t.Fatalf("TOC digest %s, blob says %s", tocDigest, blob.TOCDigest())
	}
	mc := newMemChunks(t, b, toc)
	return Layer{TOC: toc, Chunks: mc}, mc
}

// memChunks is a ChunkReader over an estargz blob in memory: it inflates
// the chunk's gzip member, skips InnerOffset, takes the chunk's bytes and
// checks them against ChunkDigest, every time.
type memChunks struct {
	blob []byte
	size map[*estargz.TOCEntry]int64 // each data chunk's length

	mu       sync.Mutex
	fetches  [][]*estargz.TOCEntry
	reads    int
	corrupt  map[*estargz.TOCEntry]bool // flip a byte of these chunks before checking
	truncate bool                       // return one byte short, with no error
}

func newMemChunks(t testing.TB, blob []byte, toc *estargz.JTOC) *memChunks {
	m := &memChunks{blob: blob, size: map[*estargz.TOCEntry]int64{}, corrupt: map[*estargz.TOCEntry]bool{}}
	var file *estargz.TOCEntry
	var prev *estargz.TOCEntry
	end := func() {
		if prev != nil {
			m.size[prev] = file.Size - prev.ChunkOffset
		}
		prev = nil
	}
	for _, e := range toc.Entries {
		switch e.Type {
		case "reg":
			end()
			if e.Size > 0 {
				file, prev = e, e
			}
		case "chunk":
			if prev == nil {
				t.Fatalf("chunk %q with no file", e.Name)
			}
			m.size[prev] = e.ChunkOffset - prev.ChunkOffset
			prev = e
		default:
			end()
		}
	}
	end()
	return m
}

func (m *memChunks) Fetch(ctx context.Context, ces []*estargz.TOCEntry) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fetches = append(m.fetches, slices.Clone(ces))
	return nil
}

func (m *memChunks) ReadChunk(ctx context.Context, ce *estargz.TOCEntry, p []byte, off int64) (int, error) {
	m.mu.Lock()
	m.reads++
	corrupt, truncate := m.corrupt[ce], m.truncate
	m.mu.Unlock()
	size, ok := m.size[ce]
	if !ok {
		return 0, fmt.Errorf("memChunks: %p (%s at %d) is not a chunk of this layer", ce, ce.Name, ce.ChunkOffset)
	}
	if off < 0 || off > size {
		return 0, fmt.Errorf("memChunks: offset %d in a %d-byte chunk", off, size)
	}
	zr, err := gzip.NewReader(bytes.NewReader(m.blob[ce.Offset:]))
	if err != nil {
		return 0, err
	}
	zr.Multistream(false)
	if _, err := io.CopyN(io.Discard, zr, ce.InnerOffset); err != nil {
		return 0, err
	}
	chunk := make([]byte, size)
	if _, err := io.ReadFull(zr, chunk); err != nil {
		return 0, err
	}
	if corrupt && len(chunk) > 0 {
		chunk[0] ^= 1
	}
	if got := digest.FromBytes(chunk); got.String() != ce.ChunkDigest {
		return 0, fmt.Errorf("memChunks: chunk %s at %d: digest %s, want %s: %w", ce.Name, ce.ChunkOffset, got, ce.ChunkDigest, syscall.EIO)
	}
	n := copy(p, chunk[off:])
	if truncate && n > 0 {
		n--
	}
	return n, nil
}

func (m *memChunks) stats() (fetches [][]*estargz.TOCEntry, reads int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return slices.Clone(m.fetches), m.reads
}

func (m *memChunks) reset() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.fetches, m.reads = nil, 0
}

// patternChunks serves hand-made TOCs: byte i of a file is pattern(i).
type patternChunks struct{}

func pattern(i int64) byte { return byte(i*7 + i/251) }

func (patternChunks) Fetch(ctx context.Context, ces []*estargz.TOCEntry) error { return nil }

func (patternChunks) ReadChunk(ctx context.Context, ce *estargz.TOCEntry, p []byte, off int64) (int, error) {
	for i := range p {
		p[i] = pattern(ce.ChunkOffset + off + int64(i))
	}
	return len(p), nil
}

// A fake but well-formed chunk digest, for hand-made TOCs.
var fakeDigest = digest.FromString("kiln").String()

// TOC entry constructors for hand-made TOCs.
func dirE(name string, mode int64) *estargz.TOCEntry {
	return &estargz.TOCEntry{Name: name, Type: "dir", Mode: mode}
}

func regE(name string, mode, size int64) *estargz.TOCEntry {
	e := &estargz.TOCEntry{Name: name, Type: "reg", Mode: mode, Size: size}
	if size > 0 {
		e.ChunkDigest = fakeDigest
	}
	return e
}

func chunkE(name string, off, size int64) *estargz.TOCEntry {
	return &estargz.TOCEntry{Name: name, Type: "chunk", ChunkOffset: off, ChunkSize: size, ChunkDigest: fakeDigest}
}

func linkE(name, target string) *estargz.TOCEntry {
	return &estargz.TOCEntry{Name: name, Type: "hardlink", LinkName: target}
}

func symE(name, target string) *estargz.TOCEntry {
	return &estargz.TOCEntry{Name: name, Type: "symlink", LinkName: target, Mode: 0o777}
}

func layerOf(es ...*estargz.TOCEntry) Layer {
	return Layer{TOC: &estargz.JTOC{Version: 1, Entries: es}, Chunks: patternChunks{}}
}

// describe is a compact form of a file's type, mode and what matters for
// its type, for table tests.
func describe(a attrLike) string {
	perm := a.Mode &^ syscall.S_IFMT
	switch a.Mode & syscall.S_IFMT {
	case syscall.S_IFDIR:
		return fmt.Sprintf("dir %o", perm)
	case syscall.S_IFREG:
		return fmt.Sprintf("reg %o %d", perm, a.Size)
	case syscall.S_IFLNK:
		return "lnk " + a.link
	case syscall.S_IFCHR:
		return fmt.Sprintf("chr %o %d", perm, a.Rdev)
	case syscall.S_IFBLK:
		return fmt.Sprintf("blk %o %d", perm, a.Rdev)
	case syscall.S_IFIFO:
		return fmt.Sprintf("fifo %o", perm)
	}
	return fmt.Sprintf("mode %o", a.Mode)
}

type attrLike struct {
	Mode uint32
	Size int64
	Rdev uint64
	link string
}

// walk visits every path of the tree through the rofs.FS methods (Lookup,
// ReadDir, Getattr, Readlink), root first, depth first, and checks on the way
// what must always hold: ReadDir sorted, Lookup agreeing with ReadDir,
// Dirent.Mode agreeing with Getattr, Path and Resolve inverse. It returns
// path -> ino.
func walk(t testing.TB, tr *Tree) map[string]uint64 {
	t.Helper()
	seen := map[string]uint64{"/": tr.Root()}
	var visit func(dir uint64, prefix string, depth int)
	visit = func(dir uint64, prefix string, depth int) {
		if depth > MaxPathLen {
			t.Fatalf("walk: deeper than %d at %s", MaxPathLen, prefix)
		}
		ents, err := tr.ReadDir(dir)
		if err != nil {
			t.Fatalf("ReadDir(%s): %v", prefix, err)
		}
		if !slices.IsSortedFunc(ents, func(a, b rofs.Dirent) int { return strings.Compare(a.Name, b.Name) }) {
			t.Fatalf("ReadDir(%s) not sorted", prefix)
		}
		for _, e := range ents {
			p := prefix + "/" + e.Name
			if prefix == "/" {
				p = "/" + e.Name
			}
			ino, err := tr.Lookup(dir, e.Name)
			if err != nil || ino != e.Ino {
				t.Fatalf("Lookup(%s) = %d, %v; ReadDir says %d", p, ino, err, e.Ino)
			}
			a, err := tr.Getattr(ino)
			if err != nil {
				t.Fatalf("Getattr(%s): %v", p, err)
			}
			if a.Mode&syscall.S_IFMT != e.Mode {
				t.Fatalf("%s: dirent mode %o, attr mode %o", p, e.Mode, a.Mode)
			}
			if r, err := tr.Resolve(p); err != nil || r != ino {
				t.Fatalf("Resolve(%s) = %d, %v; want %d", p, r, err, ino)
			}
			seen[p] = ino
			if a.Mode&syscall.S_IFMT == syscall.S_IFDIR {
				visit(ino, p, depth+1)
			}
		}
	}
	visit(tr.Root(), "/", 0)
	for ino := uint64(1); ino <= uint64(tr.Len()); ino++ {
		p, err := tr.Path(ino)
		if err != nil {
			t.Fatalf("Path(%d): %v", ino, err)
		}
		if seen[p] != ino {
			t.Fatalf("Path(%d) = %s, which is inode %d", ino, p, seen[p])
		}
	}
	return seen
}

// dump describes every path of the tree, for comparisons.
func dump(t testing.TB, tr *Tree) map[string]string {
	t.Helper()
	out := map[string]string{}
	for p, ino := range walk(t, tr) {
		a, err := tr.Getattr(ino)
		if err != nil {
			t.Fatal(err)
		}
		al := attrLike{Mode: a.Mode, Size: a.Size, Rdev: a.Rdev}
		if a.Mode&syscall.S_IFMT == syscall.S_IFLNK {
			if al.link, err = tr.Readlink(ino); err != nil {
				t.Fatal(err)
			}
		}
		out[p] = describe(al)
	}
	return out
}

// fullDump is dump with inode numbers, owners, link counts, mtimes and
// xattrs: everything the guest sees.
func fullDump(t testing.TB, tr *Tree) []string {
	t.Helper()
	var lines []string
	d := dump(t, tr)
	for p, ino := range walk(t, tr) {
		a, _ := tr.Getattr(ino)
		names, err := tr.Listxattr(ino)
		if err != nil {
			t.Fatal(err)
		}
		var xs []string
		for _, n := range names {
			v, err := tr.Getxattr(ino, n)
			if err != nil {
				t.Fatal(err)
			}
			xs = append(xs, fmt.Sprintf("%s=%q", n, v))
		}
		lines = append(lines, fmt.Sprintf("%s ino=%d %s uid=%d gid=%d nlink=%d mtime=%s xattrs=%v",
			p, ino, d[p], a.UID, a.GID, a.Nlink, a.Mtime.Format(time.RFC3339Nano), xs))
	}
	slices.Sort(lines)
	return lines
}
