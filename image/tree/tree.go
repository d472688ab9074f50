// Package tree merges an OCI image's layers, each described by an estargz
// table of contents, into one immutable file tree, and serves it as a
// rofs.FS. Whiteouts and opaque directories are applied as the OCI
// image-spec says; inode numbers follow the merged tree's sorted path order,
// so the same layers always give the same numbers; file data is read chunk
// by chunk through each layer's ChunkReader.
package tree

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"

	"github.com/kilnvm/kiln/rofs"
)

// ChunkReader reads one layer's file data chunk by chunk. The image package
// implements it over the host store and lazy registry fetches.
//
// The entries passed are the layer TOC's own (the same pointers as in
// Layer.TOC.Entries); Build does not modify them. A raw TOC may hold
// ChunkSize 0 for a file's last chunk, meaning the rest of the file: the
// reader must know the chunk's length (the next chunk's ChunkOffset, or the
// file's Size). Implementations must not modify the ces slice.
type ChunkReader interface {
	// Fetch makes chunks ces available: consecutive chunks of one file, in
	// file order. Missing ones are fetched (adjacent ones in one request)
	// and verified against their ChunkDigest. Used as a hint before a read
	// spanning several chunks.
	Fetch(ctx context.Context, ces []*estargz.TOCEntry) error
	// ReadChunk copies into p the uncompressed bytes of chunk ce (a "reg"
	// or "chunk" entry of this layer's TOC) starting at off within the
	// chunk, fetching and verifying the chunk first if needed. A chunk that
	// fails its check gives an error wrapping syscall.EIO.
	ReadChunk(ctx context.Context, ce *estargz.TOCEntry, p []byte, off int64) (int, error)
}

// Layer is one layer of an image: its TOC and the reader of its chunks.
// Chunks may be nil for a layer without file data.
type Layer struct {
	TOC    *estargz.JTOC
	Chunks ChunkReader
}

// Options tune Build.
type Options struct {
	// Name names the tree in errors and logs (an image reference or
	// manifest digest). Optional.
	Name string
	// Logger gets a debug line per Build. Nil: no logging.
	Logger *slog.Logger
}

// MaxFileSize is the largest regular file Build accepts (ext4's limit).
const MaxFileSize = 1 << 44

// BlockSize is the block size StatFS reports and counts in.
const BlockSize = 4096

// RootIno is the root directory's inode number.
const RootIno = 1

// Tree is an image's merged layers. It is immutable and safe for concurrent
// use; it implements rofs.FS.
type Tree struct {
	name   string
	inodes []inode // inodes[ino-1]
	layers []ChunkReader
	blocks uint64
}

var _ rofs.FS = (*Tree)(nil)

// inode is one file of the merged tree.
type inode struct {
	name     string // last path element of the first path naming it ("" for the root)
	parent   uint64 // directory of that path (the root's is itself)
	mode     uint32 // S_IF* | permission, setuid, setgid, sticky bits
	uid, gid uint32
	nlink    uint32
	layer    int32 // index of the layer holding the data (regular files)
	rdev     uint64
	size     int64
	mtimeSec int64
	mtimeNs  int32
	link     string              // symlink target
	xattrs   []xattr             // sorted by name
	children []rofs.Dirent       // directories: sorted by name
	chunks   []*estargz.TOCEntry // regular files: data chunks in file order
}

type xattr struct {
	name  string
	value []byte
}

func (t *Tree) node(ino uint64) (*inode, error) {
	if ino == 0 || ino > uint64(len(t.inodes)) {
		return nil, fmt.Errorf("tree: inode %d: %w", ino, syscall.ENOENT)
	}
	return &t.inodes[ino-1], nil
}

// Root returns the root directory's inode number, RootIno.
func (t *Tree) Root() uint64 { return RootIno }

// Len returns the number of inodes (hardlinks share one).
func (t *Tree) Len() int { return len(t.inodes) }

// Getattr returns ino's attributes.
func (t *Tree) Getattr(ino uint64) (rofs.Attr, error) {
	n, err := t.node(ino)
	if err != nil {
		return rofs.Attr{}, err
	}
	return rofs.Attr{
		Ino:   ino,
		Mode:  n.mode,
		UID:   n.uid,
		GID:   n.gid,
		Nlink: n.nlink,
		Rdev:  n.rdev,
		Size:  n.size,
		Mtime: time.Unix(n.mtimeSec, int64(n.mtimeNs)).UTC(),
	}, nil
}

func isDir(n *inode) bool { return n.mode&syscall.S_IFMT == syscall.S_IFDIR }

// Lookup returns the inode number of name in directory dir. "." is dir and
// ".." its parent (the root's is the root).
func (t *Tree) Lookup(dir uint64, name string) (uint64, error) {
	d, err := t.node(dir)
	if err != nil {
		return 0, err
	}
	if !isDir(d) {
		return 0, fmt.Errorf("tree: lookup %q in inode %d: %w", name, dir, syscall.ENOTDIR)
	}
	switch name {
	case ".":
		return dir, nil
	case "..":
		return d.parent, nil
	}
	i, ok := sort.Find(len(d.children), func(i int) int { return strings.Compare(name, d.children[i].Name) })
	if !ok {
		return 0, fmt.Errorf("tree: lookup %q in inode %d: %w", name, dir, syscall.ENOENT)
	}
	return d.children[i].Ino, nil
}

// ReadDir returns dir's entries sorted by name, without "." and "..". The
// slice is the caller's.
func (t *Tree) ReadDir(dir uint64) ([]rofs.Dirent, error) {
	d, err := t.node(dir)
	if err != nil {
		return nil, err
	}
	if !isDir(d) {
		return nil, fmt.Errorf("tree: readdir inode %d: %w", dir, syscall.ENOTDIR)
	}
	return slices.Clone(d.children), nil
}

// Readlink returns a symbolic link's target (EINVAL if ino is not one).
func (t *Tree) Readlink(ino uint64) (string, error) {
	n, err := t.node(ino)
	if err != nil {
		return "", err
	}
	if n.mode&syscall.S_IFMT != syscall.S_IFLNK {
		return "", fmt.Errorf("tree: readlink inode %d: not a symlink: %w", ino, syscall.EINVAL)
	}
	return n.link, nil
}

// Getxattr returns the value of ino's extended attribute name (ENODATA when
// it has none of that name). The slice is the caller's.
func (t *Tree) Getxattr(ino uint64, name string) ([]byte, error) {
	n, err := t.node(ino)
	if err != nil {
		return nil, err
	}
	i, ok := sort.Find(len(n.xattrs), func(i int) int { return strings.Compare(name, n.xattrs[i].name) })
	if !ok {
		return nil, fmt.Errorf("tree: getxattr %q on inode %d: %w", name, ino, syscall.ENODATA)
	}
	return slices.Clone(n.xattrs[i].value), nil
}

// Listxattr returns the names of ino's extended attributes, sorted.
func (t *Tree) Listxattr(ino uint64) ([]string, error) {
	n, err := t.node(ino)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(n.xattrs))
	for i, x := range n.xattrs {
		names[i] = x.name
	}
	return names, nil
}

// StatFS describes the tree: its size in BlockSize blocks (each inode's
// size rounded up, hardlinks counted once), its inode count, and the
// longest name it allows.
func (t *Tree) StatFS() rofs.StatFS {
	return rofs.StatFS{
		BlockSize: BlockSize,
		Blocks:    t.blocks,
		Files:     uint64(len(t.inodes)),
		NameLen:   MaxNameLen,
	}
}

// Resolve returns the inode number of path, following no symlinks: ENOENT
// for a name that is not there, ENOTDIR for a path through a non-directory.
// A leading "/" is optional, "" and "/" are the root, "." and empty
// elements are skipped and ".." goes to the parent.
func (t *Tree) Resolve(path string) (uint64, error) {
	ino := uint64(RootIno)
	for rest := path; rest != ""; {
		var elem string
		elem, rest, _ = strings.Cut(rest, "/")
		if elem == "" {
			continue
		}
		next, err := t.Lookup(ino, elem)
		if err != nil {
			return 0, fmt.Errorf("tree: resolve %q: %w", path, unwrapErrno(err))
		}
		ino = next
	}
	return ino, nil
}

// unwrapErrno returns the errno err wraps, or err.
func unwrapErrno(err error) error {
	var errno syscall.Errno
	if errors.As(err, &errno) {
		return errno
	}
	return err
}

// Path returns the path of ino, from the root ("/" for the root). For a
// file with hardlinks, it is the first of its paths in sorted order.
func (t *Tree) Path(ino uint64) (string, error) {
	n, err := t.node(ino)
	if err != nil {
		return "", err
	}
	if ino == RootIno {
		return "/", nil
	}
	var elems []string
	for ino != RootIno {
		elems = append(elems, n.name)
		ino = n.parent
		n = &t.inodes[ino-1]
	}
	slices.Reverse(elems)
	return "/" + strings.Join(elems, "/"), nil
}

// path is Path for error messages.
func (t *Tree) path(ino uint64) string {
	p, err := t.Path(ino)
	if err != nil {
		return fmt.Sprintf("inode %d", ino)
	}
	return p
}

// ReadAt reads regular file ino's bytes at off, as io.ReaderAt does: a read
// that stops at the end of the file returns io.EOF, as does one at or after
// it. It reads the chunks covering the range through the layer's
// ChunkReader, fetching them together first when there are several. Errors
// from the reader come back wrapped with the file's path.
func (t *Tree) ReadAt(ctx context.Context, ino uint64, p []byte, off int64) (int, error) {
	n, err := t.node(ino)
	if err != nil {
		return 0, err
	}
	switch n.mode & syscall.S_IFMT {
	case syscall.S_IFREG:
	case syscall.S_IFDIR:
		return 0, fmt.Errorf("tree: read %s: %w", t.path(ino), syscall.EISDIR)
	default:
		return 0, fmt.Errorf("tree: read %s: not a regular file: %w", t.path(ino), syscall.EINVAL)
	}
	if off < 0 {
		return 0, fmt.Errorf("tree: read %s at %d: negative offset: %w", t.path(ino), off, syscall.EINVAL)
	}
	if off >= n.size {
		return 0, io.EOF
	}
	if len(p) == 0 {
		return 0, nil
	}
	end := n.size
	if int64(len(p)) < n.size-off {
		end = off + int64(len(p))
	}
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("tree: read %s at %d: %w", t.path(ino), off, err)
	}
	// The chunks are validated by Build: in order, from 0, no gaps, ending
	// at size. first is the chunk holding off, last the one holding end-1.
	cs := n.chunks
	first := sort.Search(len(cs), func(i int) bool { return cs[i].ChunkOffset > off }) - 1
	last := sort.Search(len(cs), func(i int) bool { return cs[i].ChunkOffset >= end }) - 1
	r := t.layers[n.layer]
	if last > first {
		if err := r.Fetch(ctx, cs[first:last+1:last+1]); err != nil {
			return 0, fmt.Errorf("tree: read %s at %d: fetch %d chunks: %w", t.path(ino), off, last-first+1, err)
		}
	}
	done := 0
	for i := first; i <= last; i++ {
		ce := cs[i]
		cend := n.size
		if i+1 < len(cs) {
			cend = cs[i+1].ChunkOffset
		}
		from := max(off, ce.ChunkOffset)
		to := min(end, cend)
		want := int(to - from)
		got, err := r.ReadChunk(ctx, ce, p[done:done+want], from-ce.ChunkOffset)
		if got < 0 || got > want {
			return done, fmt.Errorf("tree: read %s at %d: chunk at %d: reader returned %d bytes for %d: %w",
				t.path(ino), from, ce.ChunkOffset, got, want, syscall.EIO)
		}
		done += got
		if err != nil && err != io.EOF {
			return done, fmt.Errorf("tree: read %s at %d: chunk at %d: %w", t.path(ino), from+int64(got), ce.ChunkOffset, err)
		}
		if got < want {
			return done, fmt.Errorf("tree: read %s at %d: chunk at %d: short chunk, %d of %d bytes: %w",
				t.path(ino), from+int64(got), ce.ChunkOffset, got, want, syscall.EIO)
		}
		// io.EOF with the bytes all there (the chunk's end) is no error.
	}
	if end == n.size && int64(len(p)) > end-off {
		return done, io.EOF
	}
	return done, nil
}
