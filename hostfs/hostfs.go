// Package hostfs serves a host directory as a read-only rofs.FS, so that
// the 9P server (ninep) can export it to a guest: a container's root
// filesystem as containerd mounted it, for the containerd shim.
//
// The guest names what it reads, so every path is resolved beneath the
// directory with openat2(RESOLVE_BENEATH|RESOLVE_NO_SYMLINKS|
// RESOLVE_NO_MAGICLINKS|RESOLVE_NO_XDEV) from a descriptor of it: a
// symbolic link is served as a link (its target is the guest's to
// resolve, inside the guest), never followed on the host, and nothing
// outside the directory or on another mount is reached. Mount points
// below the directory are hidden. Fifos, sockets and device nodes are
// listed with their attributes but never opened.
//
// Inode numbers are derived from paths, not taken from the host: the top
// 8 bits are the FS's tree tag (0 for Open; Trees gives each of its trees
// its own), the low 56 bits a 64-bit FNV-1a hash of the path beneath the
// directory, cut to 56 bits (never 0). The same tree mounted again (a
// container's rootfs from the same image, for a restored checkpoint)
// gives the same numbers, as a restored 9P server's fid table needs,
// whereas an overlay mount's own st_ino differ per mount. Hard links are
// so separate files to the guest (with the host's link count); two paths
// whose numbers collide make the second EIO, never the wrong file. The
// directory is expected to be one filesystem; entries of another device
// are hidden. The tree must not change while it is served: a path that
// has gone is looked for again (by a walk), but a guest may see a
// half-changed tree.
//
// Trees serves several directories through one FS: a default tree at the
// root and named trees, added and removed while it is served.
//
// Unlike an image tree, every method but Root makes system calls.
package hostfs

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"path"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// resolve is how every path under the root is resolved.
const resolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

// Limits on what the tree may hold, so that a huge or hostile directory
// cannot make FS hold unbounded memory.
const (
	// MaxEntries is the most inodes FS remembers the paths of.
	MaxEntries = 1 << 22
	// maxXattr is the largest extended attribute value (XATTR_SIZE_MAX).
	maxXattr = 64 << 10
	// maxLink is the longest symbolic link target served.
	maxLink = 4096
	// openFiles is how many regular files FS keeps open for reads.
	openFiles = 64
)

// FS is a host directory served read-only. Its methods are safe for
// concurrent use.
type FS struct {
	root    *os.File // O_PATH|O_DIRECTORY
	dir     string
	dev     uint64 // the directory's device: entries of another are hidden
	tag     uint8  // the top 8 bits of every inode number
	rootIno uint64 // inoOf(tag, ".")

	mu       sync.Mutex
	paths    map[uint64]string // inode → a path beneath the root that named it ("." for the root)
	complete bool              // paths holds every inode of the tree (a full walk found no change since)
	files    map[uint64]*openFile
	order    []uint64 // files, oldest first
}

// openFile is a regular file kept open for reads; refs counts the reads in
// flight, and an evicted file is closed when the last one ends.
type openFile struct {
	f       *os.File
	refs    int
	evicted bool
}

var _ rofs.FS = (*FS)(nil)

// Open serves dir, which must be a directory, with tree tag 0. Close
// releases it.
func Open(dir string) (*FS, error) { return openTag(dir, 0) }

// openTag serves dir with inode numbers of tree tag tag.
func openTag(dir string, tag uint8) (*FS, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("hostfs: open %s: %w", dir, err)
	}
	root := os.NewFile(uintptr(fd), dir)
	var st unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_INO|unix.STATX_TYPE, &st); err != nil {
		root.Close()
		return nil, fmt.Errorf("hostfs: stat %s: %w", dir, err)
	}
	// openat2 is Linux 5.6's; say so here rather than on the guest's first
	// read.
	probe, err := unix.Openat2(fd, ".", &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: resolve})
	if err != nil {
		root.Close()
		if errors.Is(err, unix.ENOSYS) {
			return nil, fmt.Errorf("hostfs: %s: this kernel has no openat2 (Linux 5.6 or newer is needed): %w", dir, err)
		}
		return nil, fmt.Errorf("hostfs: open %s beneath itself: %w", dir, err)
	}
	unix.Close(probe)
	return &FS{
		root:    root,
		dir:     dir,
		dev:     unix.Mkdev(st.Dev_major, st.Dev_minor),
		tag:     tag,
		rootIno: inoOf(tag, "."),
		paths:   map[uint64]string{inoOf(tag, "."): "."},
		files:   map[uint64]*openFile{},
	}, nil
}

// Close releases the directory and the files kept open.
func (fs *FS) Close() error {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	for ino, of := range fs.files {
		of.evicted = true
		if of.refs == 0 {
			of.f.Close()
		}
		delete(fs.files, ino)
	}
	fs.order = nil
	return fs.root.Close()
}

// Root is the directory's inode number.
func (fs *FS) Root() uint64 { return fs.rootIno }

// tagShift places a tree's tag in the top 8 bits of its inode numbers.
const tagShift = 56

// tagOf is the tree tag of inode number ino.
func tagOf(ino uint64) uint8 { return uint8(ino >> tagShift) }

// inoOf is the inode number of the path p beneath the root ("." for the
// root itself) in the tree of tag tag: the tag, then FNV-1a cut to 56
// bits, never 0.
func inoOf(tag uint8, p string) uint64 {
	h := fnv.New64a()
	io.WriteString(h, p)
	low := h.Sum64() & (1<<tagShift - 1)
	if low == 0 {
		low = 1
	}
	return uint64(tag)<<tagShift | low
}

// openIno opens ino's remembered path with flags (O_NOFOLLOW and
// O_CLOEXEC are added) and returns the descriptor and the file's
// attributes. An inode not remembered (a restored server asks for the
// numbers another process handed out), or whose path has gone, is looked
// for by a walk of the tree (once); one still unknown gives ENOENT.
func (fs *FS) openIno(ino uint64, flags int) (int, unix.Statx_t, error) {
	if tagOf(ino) != fs.tag { // another tree's: no walk finds it here
		return -1, unix.Statx_t{}, fmt.Errorf("hostfs: inode %#x is not of tree %d: %w", ino, fs.tag, unix.ENOENT)
	}
	for try := 0; ; try++ {
		p, ok := fs.pathOf(ino)
		if ok {
			fd, st, err := fs.openPath(p, flags)
			if err == nil {
				return fd, st, nil
			}
			if !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.ENOTDIR) && !errors.Is(err, unix.EXDEV) && !errors.Is(err, unix.ELOOP) {
				return -1, st, err
			}
			fs.forget(ino)
		}
		if try > 0 || !fs.walk() {
			return -1, unix.Statx_t{}, fmt.Errorf("hostfs: inode %d: %w", ino, unix.ENOENT)
		}
	}
}

// openPath opens p beneath the root and stats it. Entries of another
// device give EXDEV.
func (fs *FS) openPath(p string, flags int) (int, unix.Statx_t, error) {
	var st unix.Statx_t
	fd, err := unix.Openat2(int(fs.root.Fd()), p, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_NOFOLLOW | unix.O_CLOEXEC),
		Resolve: resolve,
	})
	if err != nil {
		return -1, st, fmt.Errorf("hostfs: open %s: %w", p, err)
	}
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_BASIC_STATS, &st); err != nil {
		unix.Close(fd)
		return -1, st, fmt.Errorf("hostfs: stat %s: %w", p, err)
	}
	if unix.Mkdev(st.Dev_major, st.Dev_minor) != fs.dev {
		unix.Close(fd)
		return -1, st, fmt.Errorf("hostfs: %s is on another filesystem: %w", p, unix.EXDEV)
	}
	return fd, st, nil
}

func (fs *FS) pathOf(ino uint64) (string, bool) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	p, ok := fs.paths[ino]
	return p, ok
}

// forget drops ino's stale path, so that the next miss walks the tree.
func (fs *FS) forget(ino uint64) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if ino != fs.rootIno {
		delete(fs.paths, ino)
	}
	fs.complete = false
}

// remember records p, and returns its inode number; another path of the
// same number (a hash collision) is EIO.
func (fs *FS) remember(p string) (uint64, error) {
	ino := inoOf(fs.tag, p)
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if q, ok := fs.paths[ino]; ok {
		if q != p {
			return 0, fmt.Errorf("hostfs: %s and %s have the same inode number %#x: %w", q, p, ino, unix.EIO)
		}
		return ino, nil
	}
	if len(fs.paths) < MaxEntries {
		fs.paths[ino] = p
	}
	return ino, nil
}

// walk visits the whole tree, remembering every inode's path, unless the
// last walk found it all and nothing has gone stale since. It reports
// whether it walked. A restored 9P server asks for inodes it learned in
// another process: the first such question fills the table.
func (fs *FS) walk() bool {
	fs.mu.Lock()
	if fs.complete {
		fs.mu.Unlock()
		return false
	}
	fs.mu.Unlock()
	queue := []string{"."}
	for len(queue) > 0 {
		dir := queue[0]
		queue = queue[1:]
		fd, _, err := fs.openPath(dir, unix.O_RDONLY|unix.O_DIRECTORY)
		if err != nil {
			continue
		}
		ents, err := fs.readDir(fd, dir)
		unix.Close(fd)
		if err != nil {
			continue
		}
		for _, e := range ents {
			if e.Mode&unix.S_IFMT == unix.S_IFDIR {
				queue = append(queue, path.Join(dir, e.Name))
			}
		}
	}
	fs.mu.Lock()
	fs.complete = true
	fs.mu.Unlock()
	return true
}

// Getattr returns ino's attributes.
func (fs *FS) Getattr(ino uint64) (rofs.Attr, error) {
	fd, st, err := fs.openIno(ino, unix.O_PATH)
	if err != nil {
		return rofs.Attr{}, err
	}
	unix.Close(fd)
	return attrOf(ino, &st), nil
}

func attrOf(ino uint64, st *unix.Statx_t) rofs.Attr {
	return rofs.Attr{
		Ino:   ino,
		Mode:  uint32(st.Mode),
		UID:   st.Uid,
		GID:   st.Gid,
		Nlink: st.Nlink,
		Rdev:  unix.Mkdev(st.Rdev_major, st.Rdev_minor),
		Size:  int64(st.Size),
		Mtime: time.Unix(st.Mtime.Sec, int64(st.Mtime.Nsec)),
	}
}

// validName reports whether name is one path element a guest may look up.
func validName(name string) bool {
	return name != "" && name != "." && name != ".." && len(name) <= 255 &&
		!strings.ContainsAny(name, "/\x00")
}

// Lookup returns the inode number of name in directory dir.
func (fs *FS) Lookup(dir uint64, name string) (uint64, error) {
	if !validName(name) {
		return 0, fmt.Errorf("hostfs: name %q: %w", name, unix.ENOENT)
	}
	fd, st, err := fs.openIno(dir, unix.O_PATH)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return 0, fmt.Errorf("hostfs: inode %d: %w", dir, unix.ENOTDIR)
	}
	p, _ := fs.pathOf(dir)
	var est unix.Statx_t
	if err := unix.Statx(fd, name, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_INO|unix.STATX_TYPE, &est); err != nil {
		return 0, fmt.Errorf("hostfs: %s: %w", path.Join(p, name), err)
	}
	if !fs.visible(&est) {
		return 0, fmt.Errorf("hostfs: %s is a mount point or on another filesystem: %w", path.Join(p, name), unix.ENOENT)
	}
	return fs.remember(path.Join(p, name))
}

// visible reports whether an entry is served: one of the root's device,
// not the root of a mount below it.
func (fs *FS) visible(st *unix.Statx_t) bool {
	if unix.Mkdev(st.Dev_major, st.Dev_minor) != fs.dev {
		return false
	}
	return st.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT == 0 || st.Attributes&unix.STATX_ATTR_MOUNT_ROOT == 0
}

// ReadDir returns dir's entries sorted by name.
func (fs *FS) ReadDir(dir uint64) ([]rofs.Dirent, error) {
	fd, st, err := fs.openIno(dir, unix.O_PATH)
	if err != nil {
		return nil, err
	}
	unix.Close(fd)
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, fmt.Errorf("hostfs: inode %d: %w", dir, unix.ENOTDIR)
	}
	fd, st, err = fs.openIno(dir, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	p, _ := fs.pathOf(dir)
	return fs.readDir(fd, p)
}

// readDir lists the open directory fd (at path p), remembering its
// entries' paths.
func (fs *FS) readDir(fd int, p string) ([]rofs.Dirent, error) {
	var ents []rofs.Dirent
	buf := make([]byte, 32<<10)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			return nil, fmt.Errorf("hostfs: read directory %s: %w", p, err)
		}
		if n <= 0 {
			break
		}
		var names []string
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
		for _, name := range names {
			if !validName(name) {
				continue
			}
			var st unix.Statx_t
			if err := unix.Statx(fd, name, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_INO|unix.STATX_TYPE, &st); err != nil || !fs.visible(&st) {
				continue // gone since, or a mount point
			}
			ino, err := fs.remember(path.Join(p, name))
			if err != nil {
				continue // a collision: the entry is not listed
			}
			ents = append(ents, rofs.Dirent{Name: name, Ino: ino, Mode: uint32(st.Mode) & unix.S_IFMT})
		}
	}
	sort.Slice(ents, func(i, j int) bool { return ents[i].Name < ents[j].Name })
	return ents, nil
}

// Readlink returns a symbolic link's target.
func (fs *FS) Readlink(ino uint64) (string, error) {
	fd, st, err := fs.openIno(ino, unix.O_PATH)
	if err != nil {
		return "", err
	}
	defer unix.Close(fd)
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		return "", fmt.Errorf("hostfs: inode %d is not a symbolic link: %w", ino, unix.EINVAL)
	}
	buf := make([]byte, maxLink+1)
	n, err := unix.Readlinkat(fd, "", buf)
	if err != nil {
		return "", fmt.Errorf("hostfs: read link %d: %w", ino, err)
	}
	if n > maxLink {
		return "", fmt.Errorf("hostfs: link %d is longer than %d bytes: %w", ino, maxLink, unix.ENAMETOOLONG)
	}
	return string(buf[:n]), nil
}

// ReadAt reads a regular file's bytes.
func (fs *FS) ReadAt(ctx context.Context, ino uint64, p []byte, off int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("hostfs: read at %d: %w", off, unix.EINVAL)
	}
	of, err := fs.file(ino)
	if err != nil {
		return 0, err
	}
	defer fs.release(of)
	n, err := of.f.ReadAt(p, off)
	if err != nil && !errors.Is(err, io.EOF) {
		return n, fmt.Errorf("hostfs: read inode %d: %w", ino, unix.EIO)
	}
	return n, err
}

// file returns ino opened for reading, from the files kept open or opened
// now; the caller releases it.
func (fs *FS) file(ino uint64) (*openFile, error) {
	fs.mu.Lock()
	if of, ok := fs.files[ino]; ok {
		of.refs++
		fs.mu.Unlock()
		return of, nil
	}
	fs.mu.Unlock()
	// Look before opening: a fifo or a device node is never opened.
	fd, st, err := fs.openIno(ino, unix.O_PATH)
	if err != nil {
		return nil, err
	}
	unix.Close(fd)
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return nil, fmt.Errorf("hostfs: inode %d is not a regular file: %w", ino, unix.EINVAL)
	}
	fd, st, err = fs.openIno(ino, unix.O_RDONLY|unix.O_NONBLOCK)
	if err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, fmt.Errorf("hostfs: inode %d is not a regular file: %w", ino, unix.EINVAL)
	}
	p, _ := fs.pathOf(ino)
	of := &openFile{f: os.NewFile(uintptr(fd), p), refs: 1}
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if cur, ok := fs.files[ino]; ok { // opened meanwhile by another read
		of.f.Close()
		cur.refs++
		return cur, nil
	}
	fs.files[ino] = of
	fs.order = append(fs.order, ino)
	for len(fs.order) > openFiles {
		old := fs.files[fs.order[0]]
		delete(fs.files, fs.order[0])
		fs.order = fs.order[1:]
		old.evicted = true
		if old.refs == 0 {
			old.f.Close()
		}
	}
	return of, nil
}

func (fs *FS) release(of *openFile) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	of.refs--
	if of.evicted && of.refs == 0 {
		of.f.Close()
	}
}

// xattrFd opens ino for its extended attributes: regular files and
// directories only (opening anything else could block or act); others
// have none (ok false).
func (fs *FS) xattrFd(ino uint64) (fd int, ok bool, err error) {
	fd, st, err := fs.openIno(ino, unix.O_PATH)
	if err != nil {
		return -1, false, err
	}
	unix.Close(fd)
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		fd, st, err = fs.openIno(ino, unix.O_RDONLY|unix.O_NONBLOCK)
	case unix.S_IFDIR:
		fd, st, err = fs.openIno(ino, unix.O_RDONLY|unix.O_DIRECTORY)
	default:
		return -1, false, nil
	}
	if err != nil {
		return -1, false, err
	}
	if t := st.Mode & unix.S_IFMT; t != unix.S_IFREG && t != unix.S_IFDIR {
		unix.Close(fd)
		return -1, false, nil
	}
	return fd, true, nil
}

// Getxattr returns the value of extended attribute name.
func (fs *FS) Getxattr(ino uint64, name string) ([]byte, error) {
	if name == "" || len(name) > 255 || strings.ContainsRune(name, 0) {
		return nil, fmt.Errorf("hostfs: xattr name %q: %w", name, unix.ENODATA)
	}
	fd, ok, err := fs.xattrFd(ino)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("hostfs: inode %d: xattr %s: %w", ino, name, unix.ENODATA)
	}
	defer unix.Close(fd)
	buf := make([]byte, maxXattr)
	n, err := unix.Fgetxattr(fd, name, buf)
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			err = unix.ENODATA
		}
		return nil, fmt.Errorf("hostfs: inode %d: xattr %s: %w", ino, name, err)
	}
	return buf[:n:n], nil
}

// Listxattr returns the names of ino's extended attributes.
func (fs *FS) Listxattr(ino uint64) ([]string, error) {
	fd, ok, err := fs.xattrFd(ino)
	if err != nil || !ok {
		return nil, err
	}
	defer unix.Close(fd)
	buf := make([]byte, maxXattr)
	n, err := unix.Flistxattr(fd, buf)
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		return nil, fmt.Errorf("hostfs: inode %d: list xattrs: %w", ino, err)
	}
	var names []string
	for _, s := range strings.Split(string(buf[:n]), "\x00") {
		if s != "" {
			names = append(names, s)
		}
	}
	return names, nil
}

// StatFS describes the directory's filesystem.
func (fs *FS) StatFS() rofs.StatFS {
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(fs.root.Fd()), &st); err != nil {
		return rofs.StatFS{BlockSize: 4096, NameLen: 255}
	}
	bs := uint32(st.Frsize)
	if bs == 0 {
		bs = uint32(st.Bsize)
	}
	return rofs.StatFS{BlockSize: bs, Blocks: st.Blocks, Files: st.Files, NameLen: uint32(st.Namelen)}
}
