package erofs

import (
	"context"
	"fmt"
	"io"
	"path"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/rofs"
)

// memFS is an in-memory rofs.FS for the tests. Paths given to its helpers
// are slash-separated and relative to the root; missing parent directories
// are made. It counts the bytes ReadAt returns, so a test can see that
// Build reads no file data, and can make ReadAt fail for one inode.
type memFS struct {
	mu    sync.Mutex
	nodes map[uint64]*memNode
	next  uint64

	dataReads atomic.Int64  // bytes returned by ReadAt
	readCalls atomic.Int64  // ReadAt calls
	failIno   atomic.Uint64 // ReadAt of this inode fails (0: none)
}

// memNode is one inode of a memFS.
type memNode struct {
	attr   rofs.Attr
	data   []byte                    // a regular file's bytes (nil: gen makes them)
	gen    func(off int64, p []byte) // a big file's bytes, made on demand
	target string                    // a symlink's
	kids   []rofs.Dirent             // a directory's, in the order ReadDir returns
	xattrs map[string][]byte
	xorder []string // Listxattr's order
	short  int64    // > 0: ReadAt finds the file ending here, before its size
}

// testTime is the mtime memFS gives new inodes.
var testTime = time.Unix(1700000000, 123456789)

// newMemFS returns a tree with only its root (inode 1, 0755).
func newMemFS() *memFS {
	m := &memFS{nodes: map[uint64]*memNode{}, next: 2}
	m.nodes[1] = &memNode{attr: rofs.Attr{Ino: 1, Mode: syscall.S_IFDIR | 0o755, Nlink: 2, Mtime: testTime}}
	return m
}

// newIno adds an inode of the given mode.
func (m *memFS) newIno(mode uint32) *memNode {
	n := &memNode{attr: rofs.Attr{Ino: m.next, Mode: mode, Nlink: 1, Mtime: testTime}}
	m.nodes[m.next] = n
	m.next++
	return n
}

// dirOf returns the directory at p, making it and its parents as needed.
func (m *memFS) dirOf(p string) *memNode {
	d := m.nodes[1]
	if p == "" || p == "." {
		return d
	}
	for _, elem := range strings.Split(p, "/") {
		var found *memNode
		for _, k := range d.kids {
			if k.Name == elem {
				found = m.nodes[k.Ino]
			}
		}
		if found == nil {
			found = m.newIno(syscall.S_IFDIR | 0o755)
			d.kids = append(d.kids, rofs.Dirent{Name: elem, Ino: found.attr.Ino, Mode: syscall.S_IFDIR})
		}
		d = found
	}
	return d
}

// link adds the name p for node n.
func (m *memFS) link(p string, n *memNode) *memNode {
	dir, name := path.Split(p)
	d := m.dirOf(strings.TrimSuffix(dir, "/"))
	d.kids = append(d.kids, rofs.Dirent{Name: name, Ino: n.attr.Ino, Mode: n.attr.Mode & syscall.S_IFMT})
	return n
}

// entry adds a raw entry to directory dir, bypassing path handling: a
// hostile name, or a second name for any inode (a directory included).
func (m *memFS) entry(dir *memNode, name string, n *memNode) {
	dir.kids = append(dir.kids, rofs.Dirent{Name: name, Ino: n.attr.Ino, Mode: n.attr.Mode & syscall.S_IFMT})
}

// mkdir makes directory p (and its parents) with the given permissions.
func (m *memFS) mkdir(p string, perm uint32) *memNode {
	d := m.dirOf(p)
	d.attr.Mode = syscall.S_IFDIR | perm
	return d
}

// file adds a regular file.
func (m *memFS) file(p string, perm uint32, data []byte) *memNode {
	n := m.newIno(syscall.S_IFREG | perm)
	n.data = data
	n.attr.Size = int64(len(data))
	return m.link(p, n)
}

// bigFile adds a regular file of size bytes whose contents are made on
// demand from its offset (a pattern no two blocks share).
func (m *memFS) bigFile(p string, size int64) *memNode {
	n := m.newIno(syscall.S_IFREG | 0o644)
	n.attr.Size = size
	n.gen = patternAt
	return m.link(p, n)
}

// patternAt fills p with the pattern bytes at off.
func patternAt(off int64, p []byte) {
	for i := range p {
		o := off + int64(i)
		p[i] = byte(o*7 + o>>12*13 + o>>20)
	}
}

// symlink adds a symbolic link.
func (m *memFS) symlink(p, target string) *memNode {
	n := m.newIno(syscall.S_IFLNK | 0o777)
	n.target = target
	n.attr.Size = int64(len(target))
	return m.link(p, n)
}

// special adds a device, FIFO or socket (mode has the type bits).
func (m *memFS) special(p string, mode uint32, rdev uint64) *memNode {
	n := m.newIno(mode)
	n.attr.Rdev = rdev
	return m.link(p, n)
}

// setxattr sets an extended attribute of n.
func (n *memNode) setxattr(name string, value []byte) *memNode {
	if n.xattrs == nil {
		n.xattrs = map[string][]byte{}
	}
	if _, ok := n.xattrs[name]; !ok {
		n.xorder = append(n.xorder, name)
	}
	n.xattrs[name] = value
	return n
}

// owner sets n's owner.
func (n *memNode) owner(uid, gid uint32) *memNode {
	n.attr.UID, n.attr.GID = uid, gid
	return n
}

// mtime sets n's mtime.
func (n *memNode) mtime(t time.Time) *memNode {
	n.attr.Mtime = t
	return n
}

// node returns inode ino.
func (m *memFS) node(ino uint64) (*memNode, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	n, ok := m.nodes[ino]
	if !ok {
		return nil, syscall.ENOENT
	}
	return n, nil
}

func (m *memFS) Root() uint64 { return 1 }

func (m *memFS) Getattr(ino uint64) (rofs.Attr, error) {
	n, err := m.node(ino)
	if err != nil {
		return rofs.Attr{}, err
	}
	return n.attr, nil
}

func (m *memFS) Lookup(dir uint64, name string) (uint64, error) {
	n, err := m.node(dir)
	if err != nil {
		return 0, err
	}
	if n.attr.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return 0, syscall.ENOTDIR
	}
	for _, k := range n.kids {
		if k.Name == name {
			return k.Ino, nil
		}
	}
	return 0, syscall.ENOENT
}

func (m *memFS) ReadDir(dir uint64) ([]rofs.Dirent, error) {
	n, err := m.node(dir)
	if err != nil {
		return nil, err
	}
	if n.attr.Mode&syscall.S_IFMT != syscall.S_IFDIR {
		return nil, syscall.ENOTDIR
	}
	return n.kids, nil // its own slice: Build must not reorder it
}

func (m *memFS) Readlink(ino uint64) (string, error) {
	n, err := m.node(ino)
	if err != nil {
		return "", err
	}
	if n.attr.Mode&syscall.S_IFMT != syscall.S_IFLNK {
		return "", syscall.EINVAL
	}
	return n.target, nil
}

func (m *memFS) ReadAt(ctx context.Context, ino uint64, p []byte, off int64) (int, error) {
	m.readCalls.Add(1)
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	n, err := m.node(ino)
	if err != nil {
		return 0, err
	}
	if n.attr.Mode&syscall.S_IFMT != syscall.S_IFREG {
		return 0, syscall.EINVAL
	}
	if m.failIno.Load() == ino {
		return 0, fmt.Errorf("chunk of inode %d failed its check: %w", ino, syscall.EIO)
	}
	if off < 0 {
		return 0, syscall.EINVAL
	}
	if off >= n.attr.Size {
		return 0, io.EOF
	}
	end := n.attr.Size
	if n.short > 0 {
		end = min(end, n.short)
	}
	if off >= end {
		return 0, io.EOF
	}
	want := p
	if rem := end - off; int64(len(want)) > rem {
		want = want[:rem]
	}
	if n.gen != nil {
		n.gen(off, want)
	} else {
		// Past data (a node re-typed by a hostile tree), zeros.
		var k int
		if off < int64(len(n.data)) {
			k = copy(want, n.data[off:])
		}
		clear(want[k:])
	}
	m.dataReads.Add(int64(len(want)))
	if len(want) < len(p) {
		return len(want), io.EOF
	}
	return len(want), nil
}

func (m *memFS) Getxattr(ino uint64, name string) ([]byte, error) {
	n, err := m.node(ino)
	if err != nil {
		return nil, err
	}
	v, ok := n.xattrs[name]
	if !ok {
		return nil, syscall.ENODATA
	}
	return v, nil
}

func (m *memFS) Listxattr(ino uint64) ([]string, error) {
	n, err := m.node(ino)
	if err != nil {
		return nil, err
	}
	return slices.Clone(n.xorder), nil
}

func (m *memFS) StatFS() rofs.StatFS {
	return rofs.StatFS{BlockSize: BlockSize, Files: uint64(len(m.nodes)), NameLen: 255}
}

// content returns a regular file's bytes: Size of them, as ReadAt gives
// them.
func (n *memNode) content() []byte {
	b := make([]byte, n.attr.Size)
	if n.gen != nil {
		n.gen(0, b)
	} else {
		copy(b, n.data)
	}
	return b
}

var _ rofs.FS = (*memFS)(nil)
