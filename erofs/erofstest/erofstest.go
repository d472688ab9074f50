// Package erofstest checks an EROFS layout (package erofs) with tools
// that share no code with it: go-erofs, an independent Go reader, walks
// the image and compares every file with the tree it was laid out from;
// Debian's fsck.erofs (erofs-utils) checks the image's structure. Tests of
// any tree (an in-memory one, an OCI image's merged layers) use them.
package erofstest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	goerofs "github.com/erofs/go-erofs"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/erofs"
	"github.com/kilnvm/kiln/rofs"
	"github.com/kilnvm/kiln/stmode"
)

// Options tune Compare.
type Options struct {
	// Bytes decides which regular files' contents are compared (read
	// through the image and through the tree): nil compares every file.
	Bytes func(path string, size int64) bool
}

// ReaderAt adapts an image to io.ReaderAt, with ctx for its reads.
type ReaderAt struct {
	Ctx   context.Context
	Image *erofs.Image
}

func (r ReaderAt) ReadAt(p []byte, off int64) (int, error) { return r.Image.ReadAt(r.Ctx, p, off) }

// Stats says what Compare checked.
type Stats struct {
	Paths, Files, BytesCompared int
}

// expected is what the image must show at one path.
type expected struct {
	ino    uint64
	attr   rofs.Attr
	nlink  uint32
	target string
	xattrs map[string]string
}

// Compare reads im back with go-erofs and checks it against src, the tree
// it was laid out from: the same paths both ways; each one's type and
// permission bits (setuid, setgid, sticky), owner, size, link count (2 +
// subdirectories for a directory, the names of it for anything else),
// mtime, device number, link target and the extended attributes EROFS can
// hold (user., trusted., security., the POSIX ACLs); hardlinks one inode;
// every name found again by lookup; and the bytes of the files
// opts.Bytes picks. It returns the first difference.
func Compare(ctx context.Context, im *erofs.Image, src rofs.FS, opts Options) (Stats, error) {
	var st Stats
	want := map[string]*expected{}
	names := map[uint64]uint32{}
	subdirs := map[uint64]uint32{}
	var walk func(p string, ino uint64) error
	walk = func(p string, ino uint64) error {
		if err := ctx.Err(); err != nil {
			return err
		}
		a, err := src.Getattr(ino)
		if err != nil {
			return fmt.Errorf("tree: getattr %s: %w", p, err)
		}
		names[ino]++
		e := &expected{ino: ino, attr: a, xattrs: map[string]string{}}
		keys, err := src.Listxattr(ino)
		if err != nil {
			return fmt.Errorf("tree: listxattr %s: %w", p, err)
		}
		for _, k := range keys {
			if !representable(k) {
				continue
			}
			v, err := src.Getxattr(ino, k)
			if err != nil {
				return fmt.Errorf("tree: getxattr %s %s: %w", p, k, err)
			}
			e.xattrs[k] = string(v)
		}
		switch a.Mode & syscall.S_IFMT {
		case syscall.S_IFLNK:
			if e.target, err = src.Readlink(ino); err != nil {
				return fmt.Errorf("tree: readlink %s: %w", p, err)
			}
			e.attr.Size = int64(len(e.target))
		case syscall.S_IFDIR:
			ents, err := src.ReadDir(ino)
			if err != nil {
				return fmt.Errorf("tree: readdir %s: %w", p, err)
			}
			for _, d := range ents {
				if d.Mode&syscall.S_IFMT == syscall.S_IFDIR {
					subdirs[ino]++
				}
				if err := walk(path.Join(p, d.Name), d.Ino); err != nil {
					return err
				}
			}
		}
		want[p] = e
		return nil
	}
	if err := walk(".", src.Root()); err != nil {
		return st, err
	}
	for _, e := range want {
		if e.attr.Mode&syscall.S_IFMT == syscall.S_IFDIR {
			e.nlink = 2 + subdirs[e.ino]
		} else {
			e.nlink = names[e.ino]
		}
	}

	img, err := goerofs.Open(ReaderAt{ctx, im})
	if err != nil {
		return st, fmt.Errorf("go-erofs: open: %w", err)
	}
	rl, ok := img.(fs.ReadLinkFS)
	if !ok {
		return st, fmt.Errorf("go-erofs: %T has no Lstat/ReadLink", img)
	}
	seen := map[string]bool{}
	nids := map[uint64]int64{}
	err = fs.WalkDir(img, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("go-erofs: walk %s: %w", p, err)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		seen[p] = true
		st.Paths++
		w, ok := want[p]
		if !ok {
			return fmt.Errorf("the image has %q, the tree does not", p)
		}
		fi, err := rl.Lstat(p)
		if err != nil {
			return fmt.Errorf("go-erofs: lstat %s: %w", p, err)
		}
		s, ok := fi.Sys().(*goerofs.Stat)
		if !ok {
			return fmt.Errorf("%s: go-erofs's Sys() is %T", p, fi.Sys())
		}
		typ := w.attr.Mode & syscall.S_IFMT
		if got, want := s.Mode, stmode.FileMode(w.attr.Mode); got != want {
			return fmt.Errorf("%s: mode %v, want %v", p, got, want)
		}
		if p != "." && d.Type() != s.Mode.Type() {
			return fmt.Errorf("%s: the directory entry says %v, the inode %v", p, d.Type(), s.Mode.Type())
		}
		if s.UID != w.attr.UID || s.GID != w.attr.GID {
			return fmt.Errorf("%s: owner %d:%d, want %d:%d", p, s.UID, s.GID, w.attr.UID, w.attr.GID)
		}
		if typ != syscall.S_IFDIR && s.Size != w.attr.Size {
			return fmt.Errorf("%s: size %d, want %d", p, s.Size, w.attr.Size)
		}
		if uint32(s.Nlink) != w.nlink {
			return fmt.Errorf("%s: nlink %d, want %d", p, s.Nlink, w.nlink)
		}
		if mt := w.attr.Mtime; mt.Unix() >= 0 {
			if got := time.Unix(int64(s.Mtime), int64(s.MtimeNs)); !got.Equal(mt) {
				return fmt.Errorf("%s: mtime %v, want %v", p, got, mt)
			}
		}
		if prev, ok := nids[w.ino]; ok && prev != s.Ino {
			return fmt.Errorf("%s: a hardlinked file has two inodes (%d, %d)", p, prev, s.Ino)
		}
		nids[w.ino] = s.Ino
		if typ == syscall.S_IFCHR || typ == syscall.S_IFBLK {
			if got := decodeDev(s.Rdev); got != w.attr.Rdev {
				return fmt.Errorf("%s: device %#x, want %#x", p, got, w.attr.Rdev)
			}
		}
		got := map[string]string{}
		for k, v := range s.Xattrs {
			// go-erofs names the POSIX ACLs with a trailing dot.
			got[strings.TrimSuffix(k, ".")] = v
		}
		if !maps.Equal(got, w.xattrs) {
			return fmt.Errorf("%s: xattrs %q, want %q", p, got, w.xattrs)
		}
		switch typ {
		case syscall.S_IFLNK:
			target, err := rl.ReadLink(p)
			if err != nil {
				return fmt.Errorf("go-erofs: readlink %s: %w", p, err)
			}
			if target != w.target {
				return fmt.Errorf("%s: link target %q, want %q", p, target, w.target)
			}
		case syscall.S_IFREG:
			st.Files++
			if opts.Bytes != nil && !opts.Bytes(p, w.attr.Size) {
				return nil
			}
			n, err := sameBytes(ctx, img, p, src, w.ino, w.attr.Size)
			if err != nil {
				return err
			}
			st.BytesCompared += n
		case syscall.S_IFDIR:
			ents, err := img.(fs.ReadDirFS).ReadDir(p)
			if err != nil {
				return fmt.Errorf("go-erofs: readdir %s: %w", p, err)
			}
			for _, e := range ents { // each name found by lookup, not only listed
				if _, err := rl.Lstat(path.Join(p, e.Name())); err != nil {
					return fmt.Errorf("go-erofs: lookup %s in %s: %w", e.Name(), p, err)
				}
			}
		}
		return nil
	})
	if err != nil {
		return st, err
	}
	for p := range want {
		if !seen[p] {
			return st, fmt.Errorf("the tree has %q, the image does not", p)
		}
	}
	return st, nil
}

// sameBytes compares file p of the image with ino of src, in pieces.
func sameBytes(ctx context.Context, img fs.FS, p string, src rofs.FS, ino uint64, size int64) (int, error) {
	f, err := img.Open(p)
	if err != nil {
		return 0, fmt.Errorf("go-erofs: open %s: %w", p, err)
	}
	defer f.Close()
	a, b := make([]byte, 1<<20), make([]byte, 1<<20)
	var off int64
	for {
		n, err := io.ReadFull(f, a)
		if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
			return int(off), fmt.Errorf("go-erofs: read %s at %d: %w", p, off, err)
		}
		if n == 0 {
			break
		}
		m, serr := src.ReadAt(ctx, ino, b[:n], off)
		if m != n || (serr != nil && !errors.Is(serr, io.EOF)) {
			return int(off), fmt.Errorf("tree: read %s at %d: %d of %d bytes: %v", p, off, m, n, serr)
		}
		if !bytes.Equal(a[:n], b[:n]) {
			return int(off), fmt.Errorf("%s: bytes differ in [%d, %d)", p, off, off+int64(n))
		}
		off += int64(n)
	}
	if off != size {
		return int(off), fmt.Errorf("%s: read %d bytes through the image, want %d", p, off, size)
	}
	return int(off), nil
}

// representable reports whether EROFS has a name prefix for an extended
// attribute (erofs's layout skips the others).
func representable(name string) bool {
	switch name {
	case "system.posix_acl_access", "system.posix_acl_default":
		return true
	}
	for _, p := range []string{"user.", "trusted.", "security."} {
		if strings.HasPrefix(name, p) && len(name) > len(p) {
			return true
		}
	}
	return false
}

// decodeDev turns EROFS's new_encode_dev form into unix.Mkdev's.
func decodeDev(d uint32) uint64 {
	major := (d & 0xfff00) >> 8
	minor := (d & 0xff) | ((d >> 12) & 0xfff00)
	return unix.Mkdev(major, minor)
}

// Fsck writes im to a file in dir (with every file's bytes when data is
// true; otherwise the data region is a hole that reads as zeros, which
// fsck.erofs takes, since EROFS keeps no data checksums) and runs Debian's
// fsck.erofs on it. It fails when the tool is missing (make deps installs
// erofs-utils).
func Fsck(ctx context.Context, im *erofs.Image, dir string, data bool) error {
	bin, err := exec.LookPath("fsck.erofs")
	if err != nil {
		return fmt.Errorf("fsck.erofs (Debian's erofs-utils; make deps installs it): %w", err)
	}
	f, err := os.CreateTemp(dir, "image-*.erofs")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	upto := im.MetadataSize()
	if data {
		upto = im.Size()
	}
	buf := make([]byte, 1<<20)
	for off := int64(0); off < upto; {
		n := min(int64(len(buf)), upto-off)
		if _, err := im.ReadAt(ctx, buf[:n], off); err != nil {
			return fmt.Errorf("reading the image at %d: %w", off, err)
		}
		if _, err := f.WriteAt(buf[:n], off); err != nil {
			return err
		}
		off += n
	}
	if err := f.Truncate(im.Size()); err != nil {
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, bin, f.Name()).CombinedOutput()
	if err != nil {
		return fmt.Errorf("fsck.erofs %s: %w\n%s", filepath.Base(f.Name()), err, out)
	}
	return nil
}
