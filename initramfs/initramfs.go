// Package initramfs builds Linux initramfs images: deterministic newc cpio
// archives, optionally gzip-compressed, in which the same inputs always give
// the same bytes.
package initramfs

import (
	"bytes"
	"compress/gzip"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"

	"github.com/u-root/u-root/pkg/cpio"
)

type kind int

const (
	kindDir kind = iota
	kindFile
	kindHostFile
	kindSymlink
)

type entry struct {
	kind     kind
	mode     os.FileMode
	data     []byte // file contents or symlink target
	hostPath string
	implicit bool // a directory created as some entry's parent
}

// Builder collects the entries of an archive. The zero value is not usable;
// call New.
type Builder struct {
	entries map[string]*entry
}

// New returns an empty Builder.
func New() *Builder {
	return &Builder{entries: map[string]*entry{}}
}

// CleanPath validates an archive path and returns it relative to the
// archive's root, without a leading slash. A leading "/" means the root; ".."
// elements, NUL bytes and paths naming the root itself are rejected.
func CleanPath(p string) (string, error) {
	if p == "" {
		return "", errors.New("empty path")
	}
	if strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("path %q contains a NUL byte", p)
	}
	for _, el := range strings.Split(p, "/") {
		if el == ".." {
			return "", fmt.Errorf("path %q contains \"..\"", p)
		}
	}
	c := strings.TrimLeft(path.Clean("/"+p), "/")
	if c == "" {
		return "", fmt.Errorf("path %q names the archive root", p)
	}
	return c, nil
}

// AddFile adds a regular file with the given contents and permission bits
// (setuid, setgid and sticky bits included). The data is copied.
func (b *Builder) AddFile(p string, data []byte, mode os.FileMode) error {
	return b.add(p, &entry{kind: kindFile, mode: mode, data: bytes.Clone(data)})
}

// AddHostFile adds the regular file hostPath of this machine, read when the
// archive is written. A zero mode takes the host file's permission bits.
func (b *Builder) AddHostFile(p, hostPath string, mode os.FileMode) error {
	fi, err := os.Stat(hostPath)
	if err != nil {
		return fmt.Errorf("adding %s: %w", p, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("adding %s: %s is not a regular file", p, hostPath)
	}
	if mode == 0 {
		mode = fi.Mode() & (fs.ModePerm | fs.ModeSetuid | fs.ModeSetgid | fs.ModeSticky)
	}
	return b.add(p, &entry{kind: kindHostFile, mode: mode, hostPath: hostPath})
}

// AddDir adds a directory. Adding a directory that was created implicitly as
// a parent sets its mode; adding it twice explicitly is an error.
func (b *Builder) AddDir(p string, mode os.FileMode) error {
	return b.add(p, &entry{kind: kindDir, mode: mode})
}

// AddSymlink adds a symbolic link to target.
func (b *Builder) AddSymlink(p, target string) error {
	if target == "" || strings.ContainsRune(target, 0) {
		return fmt.Errorf("adding symlink %s: bad target %q", p, target)
	}
	return b.add(p, &entry{kind: kindSymlink, mode: 0o777, data: []byte(target)})
}

func (b *Builder) add(p string, e *entry) error {
	name, err := CleanPath(p)
	if err != nil {
		return fmt.Errorf("initramfs: %w", err)
	}
	if e.mode&^(fs.ModePerm|fs.ModeSetuid|fs.ModeSetgid|fs.ModeSticky) != 0 {
		return fmt.Errorf("initramfs: %s: mode %v has more than permission bits", name, e.mode)
	}
	// Parents must be directories; create the missing ones.
	var parents []string
	for dir := path.Dir(name); dir != "."; dir = path.Dir(dir) {
		if pe, ok := b.entries[dir]; ok {
			if pe.kind != kindDir {
				return fmt.Errorf("initramfs: cannot add %s: parent %s is not a directory", name, dir)
			}
			break
		}
		parents = append(parents, dir)
	}
	if old, ok := b.entries[name]; ok {
		if !(old.implicit && e.kind == kindDir) {
			return fmt.Errorf("initramfs: duplicate path %s", name)
		}
	}
	for _, dir := range parents {
		b.entries[dir] = &entry{kind: kindDir, mode: 0o755, implicit: true}
	}
	b.entries[name] = e
	return nil
}

// WriteTo writes the archive as newc cpio to w: entries sorted by path, inode
// numbers in that order, zero mtimes, uids and gids. It implements
// io.WriterTo.
func (b *Builder) WriteTo(w io.Writer) (int64, error) {
	cw := &countWriter{w: w}
	names := make([]string, 0, len(b.entries))
	for n := range b.entries {
		names = append(names, n)
	}
	sort.Strings(names)
	rw := cpio.Newc.Writer(cw)
	for i, name := range names {
		rec, err := b.entries[name].record(name)
		if err != nil {
			return cw.n, err
		}
		rec.Ino = uint64(i + 1)
		if err := rw.WriteRecord(rec); err != nil {
			if c, ok := rec.ReaderAt.(io.Closer); ok {
				c.Close()
			}
			return cw.n, fmt.Errorf("initramfs: writing %s: %w", name, err)
		}
	}
	if err := cpio.WriteTrailer(rw); err != nil {
		return cw.n, fmt.Errorf("initramfs: writing trailer: %w", err)
	}
	return cw.n, nil
}

// WriteGzip writes the archive gzip-compressed, with an empty gzip header, so
// the output too depends only on the inputs.
func (b *Builder) WriteGzip(w io.Writer) (int64, error) {
	cw := &countWriter{w: w}
	zw, err := gzip.NewWriterLevel(cw, gzip.BestSpeed)
	if err != nil {
		return 0, err
	}
	if _, err := b.WriteTo(zw); err != nil {
		return cw.n, err
	}
	if err := zw.Close(); err != nil {
		return cw.n, fmt.Errorf("initramfs: compressing: %w", err)
	}
	return cw.n, nil
}

// WriteFile writes the archive to the file path, gzip-compressed when
// compress is set. The file appears complete or not at all.
func (b *Builder) WriteFile(p string, compress bool) error {
	f, err := os.CreateTemp(filepath.Dir(p), ".initramfs-*")
	if err != nil {
		return fmt.Errorf("initramfs: %w", err)
	}
	defer os.Remove(f.Name())
	write := b.WriteTo
	if compress {
		write = b.WriteGzip
	}
	if _, err := write(f); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(0o644); err != nil {
		f.Close()
		return fmt.Errorf("initramfs: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("initramfs: writing %s: %w", p, err)
	}
	if err := os.Rename(f.Name(), p); err != nil {
		return fmt.Errorf("initramfs: %w", err)
	}
	return nil
}

func (e *entry) record(name string) (cpio.Record, error) {
	perm := uint64(e.mode.Perm())
	if e.mode&fs.ModeSetuid != 0 {
		perm |= cpio.S_ISUID
	}
	if e.mode&fs.ModeSetgid != 0 {
		perm |= cpio.S_ISGID
	}
	if e.mode&fs.ModeSticky != 0 {
		perm |= cpio.S_ISVTX
	}
	info := cpio.Info{Name: name, NLink: 1}
	switch e.kind {
	case kindDir:
		info.Mode = cpio.S_IFDIR | perm
		info.NLink = 2
		return cpio.Record{Info: info}, nil
	case kindSymlink:
		info.Mode = cpio.S_IFLNK | 0o777
		return cpio.StaticRecord(e.data, info), nil
	case kindFile:
		info.Mode = cpio.S_IFREG | perm
		return cpio.StaticRecord(e.data, info), nil
	case kindHostFile:
		f, err := os.Open(e.hostPath)
		if err != nil {
			return cpio.Record{}, fmt.Errorf("initramfs: %s: %w", name, err)
		}
		fi, err := f.Stat()
		if err != nil {
			f.Close()
			return cpio.Record{}, fmt.Errorf("initramfs: %s: %w", name, err)
		}
		info.Mode = cpio.S_IFREG | perm
		info.FileSize = uint64(fi.Size())
		// The cpio writer closes f once it has copied it.
		return cpio.Record{ReaderAt: f, Info: info}, nil
	}
	return cpio.Record{}, fmt.Errorf("initramfs: %s: unknown entry kind %d", name, e.kind)
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
