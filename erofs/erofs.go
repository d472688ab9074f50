// Package erofs lays out a read-only file tree (any rofs.FS) as an EROFS
// filesystem image that Linux's in-kernel erofs driver (6.1 and later,
// 4096-byte blocks) mounts: a guest sees the image as a read-only block
// device and mounts it with `mount -t erofs`.
//
// The image has two regions. The metadata region (superblock, inodes,
// inline xattrs, directory blocks, symlink targets) is built by Build and
// held in memory. The data region that follows holds every regular file's
// bytes, one file after another, each starting on a block boundary; it is
// virtual: Image.ReadAt maps a data block to (inode, offset) and reads it
// through the tree's ReadAt, so a file's bytes are fetched only when the
// guest reads them. Build itself never reads file data.
//
// The layout uses only what Linux 6.1 reads without a feature_incompat
// bit: extended (64-byte) inodes, the FLAT_PLAIN layout for regular files
// and FLAT_INLINE (the tail after the inode, within one block) or
// FLAT_PLAIN for directories and symlinks, inline xattrs with the standard
// name prefixes, no shared xattrs, no compression, no checksum. Inodes are
// placed breadth-first from the root (the root first: its nid must fit the
// superblock's 16-bit root_nid), a directory's children together, and
// files' data in the same order. The same tree always gives the same image,
// byte for byte.
//
// The tree is untrusted input (an image's table of contents is written by
// whoever built the image): every limit of the format is checked, and a
// tree that breaks one (a bad name, a directory reached twice, a file too
// big for 32-bit block addresses...) makes Build return an error naming
// the path, never a panic.
package erofs

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"syscall"

	"github.com/kilnvm/kiln/rofs"
)

// BlockSize is the filesystem block size, in bytes (sb.blkszbits = 12):
// the page size Linux 6.1's erofs requires.
const BlockSize = 4096

// Options tune Build.
type Options struct {
	// VolumeName is the superblock's volume name (the label), at most 15
	// bytes and without NUL: Linux refuses a name that fills all 16 bytes
	// of the field without a terminating NUL.
	VolumeName string
	// UUID is the superblock's volume UUID.
	UUID [16]byte
	// Logger receives Build's notes (extended attributes it had to skip);
	// nil discards them.
	Logger *slog.Logger
}

// Image is an EROFS image of a tree: its metadata in memory, its file data
// read from the tree on demand. It is immutable after Build and safe for
// concurrent use.
type Image struct {
	fsys   rofs.FS
	meta   []byte // the metadata region: blocks [0, len(meta)/BlockSize)
	blocks int64  // total blocks
	inodes int
	digest string

	// The data extents, one per non-empty regular file, sorted by start
	// block (parallel slices: 20 bytes a file). File i's bytes are at
	// blocks [starts[i], starts[i]+blocksOf(sizes[i])); the extents tile
	// the data region without gaps.
	starts []uint32
	inos   []uint64
	sizes  []int64
}

// Size is the image's size in bytes, a multiple of BlockSize.
func (im *Image) Size() int64 { return im.blocks * BlockSize }

// MetadataSize is the size in bytes of the image's leading metadata
// region, the part held in memory (a multiple of BlockSize).
func (im *Image) MetadataSize() int64 { return int64(len(im.meta)) }

// Inodes is the number of inodes in the image (hardlinked names count
// once).
func (im *Image) Inodes() int { return im.inodes }

// Digest is "sha256:" and the hex SHA-256 of the metadata region. It
// identifies the layout (names, attributes, which file is at which block),
// not the files' contents: those are the tree's, which its own identity
// (an image digest) names.
func (im *Image) Digest() string { return im.digest }

// ReadAt reads len(p) bytes of the image at byte offset off, as
// io.ReaderAt does: a read that reaches the end of the image returns the
// bytes before it and io.EOF, and off at or past the end returns 0 and
// io.EOF; a negative off is an error. Metadata is copied from memory; file
// data is read from the tree with ctx (the part of a file's last block past
// its end reads as zeros). A failed read of the tree returns an error that
// wraps syscall.EIO and names the inode and offsets.
func (im *Image) ReadAt(ctx context.Context, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("erofs: read at negative offset %d: %w", off, syscall.EINVAL)
	}
	size := im.Size()
	if off >= size {
		if len(p) == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	var eof error
	if int64(len(p)) > size-off {
		p = p[:size-off]
		eof = io.EOF
	}
	n := 0
	for n < len(p) {
		m, err := im.readSome(ctx, p[n:], off+int64(n))
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, eof
}

// readSome fills the start of p (at image offset off, inside the image)
// from one source: the metadata, or one file's extent. It returns how many
// bytes it filled (at least 1 unless it fails).
func (im *Image) readSome(ctx context.Context, p []byte, off int64) (int, error) {
	if off < int64(len(im.meta)) {
		return copy(p, im.meta[off:]), nil
	}
	blk := off / BlockSize
	// The last extent that starts at or before blk; the data region
	// starts with extent 0, at the end of the metadata.
	i := sort.Search(len(im.starts), func(i int) bool { return int64(im.starts[i]) > blk }) - 1
	if i < 0 {
		// Unreachable: the data region begins with an extent.
		return 0, fmt.Errorf("erofs: offset %d maps to no file: %w", off, syscall.EIO)
	}
	start := int64(im.starts[i]) * BlockSize
	fsize := im.sizes[i]
	end := start + alignUp(fsize, BlockSize) // the extent's end, past the zero padding
	if int64(len(p)) > end-off {
		p = p[:end-off]
	}
	foff := off - start
	if foff >= fsize {
		clear(p) // the last block's tail, past the file's end
		return len(p), nil
	}
	want := p
	if int64(len(want)) > fsize-foff {
		want = want[:fsize-foff]
	}
	ino := im.inos[i]
	m, err := im.fsys.ReadAt(ctx, ino, want, foff)
	if m > len(want) || m < 0 {
		return 0, fmt.Errorf("erofs: reading inode %d at file offset %d (image offset %d): read returned %d bytes for %d: %w", ino, foff, off, m, len(want), syscall.EIO)
	}
	if m == len(want) {
		// A full read, perhaps with io.EOF at the file's end: fine. The
		// rest of p (if any) is padding.
		clear(p[m:])
		return len(p), nil
	}
	switch {
	case err == nil:
		err = fmt.Errorf("short read (%d of %d bytes) without an error", m, len(want))
	case errors.Is(err, io.EOF):
		err = fmt.Errorf("file ends at %d, before its size %d", foff+int64(m), fsize)
	}
	return m, fmt.Errorf("erofs: reading inode %d at file offset %d (image offset %d): %w: %w", ino, foff+int64(m), off+int64(m), syscall.EIO, err)
}

// Build lays out fsys as an EROFS image. It reads only the tree's metadata
// (Getattr, ReadDir, Readlink, Listxattr, Getxattr), never file data, and
// returns an error naming the path for anything the format cannot hold:
// names that are empty, "." or "..", over 255 bytes or holding '/' or NUL;
// symlink targets empty, over 4095 bytes or holding NUL; a directory
// reached twice (a cycle, or a hardlinked directory); an xattr value over
// 65535 bytes, or a file's xattrs over the 256 KiB an inode can describe;
// a mode with bits beyond the type and 07777, or a type EROFS has not;
// device numbers over 12-bit major or 20-bit minor; an image over 2^32
// blocks. Extended attributes whose names EROFS cannot encode (no user.,
// trusted., security. prefix, nor a POSIX ACL) are skipped and logged
// once.
//
// What the image records beside the tree's attributes: a directory's nlink
// is 2 and its subdirectories, anything else's the number of names it has
// in the tree (Attr.Nlink is not used); devices, FIFOs and sockets have
// size 0; the superblock's build time is the root's mtime, so that the
// same tree always gives the same bytes.
func Build(ctx context.Context, fsys rofs.FS, opts Options) (*Image, error) {
	if len(opts.VolumeName) > 15 {
		return nil, fmt.Errorf("erofs: volume name %q is %d bytes, over 15", opts.VolumeName, len(opts.VolumeName))
	}
	for i := 0; i < len(opts.VolumeName); i++ {
		if opts.VolumeName[i] == 0 {
			return nil, fmt.Errorf("erofs: volume name %q holds NUL", opts.VolumeName)
		}
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	// The tree's inode count sizes the tables up front; it is only a
	// hint (and capped: the tree is untrusted).
	hint := int(min(fsys.StatFS().Files, 1<<22))
	b := &builder{ctx: ctx, fsys: fsys, nodes: make([]node, 0, hint), byIno: make(map[uint64]int32, hint)}
	if err := b.walk(); err != nil {
		return nil, err
	}
	if b.skipped > 0 {
		log.Warn("erofs: skipped extended attributes whose names EROFS cannot hold",
			"count", b.skipped, "first_path", b.skippedPath, "first_name", b.skippedName)
	}
	if err := b.layout(); err != nil {
		return nil, err
	}
	im := b.serialize(opts)
	sum := sha256.Sum256(im.meta)
	im.digest = "sha256:" + hex.EncodeToString(sum[:])
	return im, nil
}
