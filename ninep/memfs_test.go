package ninep

import (
	"context"
	"fmt"
	"io"
	"path"
	"slices"
	"sort"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// memFS is an in-memory rofs.FS for tests: a map of inodes built by path.
type memFS struct {
	root  uint64
	nodes map[uint64]*memNode
	paths map[string]uint64
	next  uint64
	// blockStarted is signalled when a read of a blocking file starts.
	blockStarted chan struct{}
	reads        atomic.Int64
}

type memNode struct {
	attr    rofs.Attr
	data    []byte
	target  string
	entries []rofs.Dirent
	xattrs  map[string][]byte
	block   bool // ReadAt blocks until ctx ends
	eio     bool // ReadAt fails with EIO
}

var memTime = time.Date(2024, 5, 6, 7, 8, 9, 123456789, time.UTC)

func newMemFS() *memFS {
	m := &memFS{nodes: map[uint64]*memNode{}, paths: map[string]uint64{}, next: 1, blockStarted: make(chan struct{}, 16)}
	m.root = m.add("/", unix.S_IFDIR|0o755, nil)
	return m
}

// add creates path (its parent must exist) with mode; returns its inode.
func (m *memFS) add(p string, mode uint32, fill func(*memNode)) uint64 {
	ino := m.next
	m.next++
	n := &memNode{attr: rofs.Attr{Ino: ino, Mode: mode, Nlink: 1, UID: 1000, GID: 1000, Mtime: memTime}, xattrs: map[string][]byte{}}
	if mode&unix.S_IFMT == unix.S_IFDIR {
		n.attr.Nlink = 2
		n.attr.Size = 4096
	}
	if fill != nil {
		fill(n)
	}
	m.nodes[ino] = n
	m.paths[p] = ino
	if p != "/" {
		m.link(p, ino)
	}
	return ino
}

// link adds a directory entry p for an existing inode.
func (m *memFS) link(p string, ino uint64) {
	dir := m.nodes[m.paths[path.Dir(p)]]
	n := m.nodes[ino]
	dir.entries = append(dir.entries, rofs.Dirent{Name: path.Base(p), Ino: ino, Mode: n.attr.Mode & unix.S_IFMT})
	sort.Slice(dir.entries, func(i, j int) bool { return dir.entries[i].Name < dir.entries[j].Name })
	m.paths[p] = ino
}

func (m *memFS) dir(p string) uint64 { return m.add(p, unix.S_IFDIR|0o755, nil) }

func (m *memFS) file(p string, data []byte) uint64 {
	return m.add(p, unix.S_IFREG|0o644, func(n *memNode) { n.data = data; n.attr.Size = int64(len(data)) })
}

func (m *memFS) symlink(p, target string) uint64 {
	return m.add(p, unix.S_IFLNK|0o777, func(n *memNode) { n.target = target; n.attr.Size = int64(len(target)) })
}

func (m *memFS) get(ino uint64) (*memNode, error) {
	n, ok := m.nodes[ino]
	if !ok {
		return nil, fmt.Errorf("memfs: inode %d: %w", ino, syscall.ENOENT)
	}
	return n, nil
}

func (m *memFS) Root() uint64 { return m.root }

func (m *memFS) Getattr(ino uint64) (rofs.Attr, error) {
	n, err := m.get(ino)
	if err != nil {
		return rofs.Attr{}, err
	}
	return n.attr, nil
}

func (m *memFS) Lookup(dir uint64, name string) (uint64, error) {
	n, err := m.get(dir)
	if err != nil {
		return 0, err
	}
	if n.attr.Mode&unix.S_IFMT != unix.S_IFDIR {
		return 0, fmt.Errorf("memfs: inode %d: %w", dir, syscall.ENOTDIR)
	}
	i, ok := slices.BinarySearchFunc(n.entries, name, func(d rofs.Dirent, name string) int { return strings.Compare(d.Name, name) })
	if !ok {
		return 0, fmt.Errorf("memfs: %q in %d: %w", name, dir, syscall.ENOENT)
	}
	return n.entries[i].Ino, nil
}

func (m *memFS) ReadDir(dir uint64) ([]rofs.Dirent, error) {
	n, err := m.get(dir)
	if err != nil {
		return nil, err
	}
	if n.attr.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, fmt.Errorf("memfs: inode %d: %w", dir, syscall.ENOTDIR)
	}
	return n.entries, nil
}

func (m *memFS) Readlink(ino uint64) (string, error) {
	n, err := m.get(ino)
	if err != nil {
		return "", err
	}
	if n.attr.Mode&unix.S_IFMT != unix.S_IFLNK {
		return "", fmt.Errorf("memfs: inode %d is not a symlink: %w", ino, syscall.EINVAL)
	}
	return n.target, nil
}

func (m *memFS) ReadAt(ctx context.Context, ino uint64, p []byte, off int64) (int, error) {
	m.reads.Add(1)
	n, err := m.get(ino)
	if err != nil {
		return 0, err
	}
	switch {
	case n.attr.Mode&unix.S_IFMT != unix.S_IFREG:
		return 0, fmt.Errorf("memfs: inode %d is not a file: %w", ino, syscall.EINVAL)
	case n.block:
		select {
		case m.blockStarted <- struct{}{}:
		default:
		}
		<-ctx.Done()
		return 0, fmt.Errorf("memfs: fetch of inode %d: %w", ino, ctx.Err())
	case n.eio:
		return 0, fmt.Errorf("memfs: chunk of inode %d fails its digest: %w", ino, syscall.EIO)
	}
	if off >= int64(len(n.data)) {
		return 0, io.EOF
	}
	k := copy(p, n.data[off:])
	if k < len(p) {
		return k, io.EOF
	}
	return k, nil
}

func (m *memFS) Getxattr(ino uint64, name string) ([]byte, error) {
	n, err := m.get(ino)
	if err != nil {
		return nil, err
	}
	v, ok := n.xattrs[name]
	if !ok {
		return nil, fmt.Errorf("memfs: xattr %q: %w", name, syscall.ENODATA)
	}
	return v, nil
}

func (m *memFS) Listxattr(ino uint64) ([]string, error) {
	n, err := m.get(ino)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(n.xattrs))
	for k := range n.xattrs {
		names = append(names, k)
	}
	slices.Sort(names)
	return names, nil
}

func (m *memFS) StatFS() rofs.StatFS {
	var size int64
	for _, n := range m.nodes {
		size += n.attr.Size
	}
	return rofs.StatFS{BlockSize: 4096, Blocks: uint64(size+4095) / 4096, Files: uint64(len(m.nodes)), NameLen: 255}
}

var _ rofs.FS = (*memFS)(nil)

// Sizes of the test tree's files.
const (
	bigSize    = 3*DefaultMsize + 12345
	manyFiles  = 300
	helloText  = "hello, kiln\n"
	capability = "\x01\x00\x00\x02\x00\x20\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"
)

// bigByte is the big file's byte at off.
func bigByte(off int) byte { return byte(off*131 + off>>12) }

// testTree builds the tree every test serves:
//
//	/etc/hello          "hello, kiln\n", xattr user.note
//	/etc/link -> hello  symlink
//	/etc/hard           hard link of /etc/hello (nlink 2)
//	/bin/ping           setuid root, security.capability
//	/dev/null, /dev/sda char and block devices
//	/big                bigSize bytes
//	/many/f000..f299    empty files
//	/slow               ReadAt blocks until ctx ends
//	/bad                ReadAt fails with EIO
//	/deep/a/b/c         nested dirs
func testTree() *memFS {
	m := newMemFS()
	m.dir("/etc")
	hello := m.file("/etc/hello", []byte(helloText))
	m.nodes[hello].xattrs["user.note"] = []byte("a note")
	m.symlink("/etc/link", "hello")
	m.link("/etc/hard", hello)
	m.nodes[hello].attr.Nlink = 2
	m.dir("/bin")
	ping := m.add("/bin/ping", unix.S_IFREG|unix.S_ISUID|0o755, func(n *memNode) {
		n.data = []byte("\x7fELF")
		n.attr.Size = 4
		n.attr.UID, n.attr.GID = 0, 0
	})
	m.nodes[ping].xattrs["security.capability"] = []byte(capability)
	m.dir("/dev")
	m.add("/dev/null", unix.S_IFCHR|0o666, func(n *memNode) { n.attr.Rdev = unix.Mkdev(1, 3) })
	m.add("/dev/sda", unix.S_IFBLK|0o660, func(n *memNode) { n.attr.Rdev = unix.Mkdev(8, 0) })
	big := make([]byte, bigSize)
	for i := range big {
		big[i] = bigByte(i)
	}
	m.file("/big", big)
	m.dir("/many")
	for i := range manyFiles {
		m.file(fmt.Sprintf("/many/f%03d", i), nil)
	}
	m.add("/slow", unix.S_IFREG|0o644, func(n *memNode) { n.block = true; n.attr.Size = 100 })
	m.add("/bad", unix.S_IFREG|0o644, func(n *memNode) { n.eio = true; n.attr.Size = 100 })
	m.dir("/deep")
	m.dir("/deep/a")
	m.dir("/deep/a/b")
	m.dir("/deep/a/b/c")
	return m
}

func TestMemFS(t *testing.T) {
	m := testTree()
	ino, err := m.Lookup(m.paths["/etc"], "hello")
	if err != nil || ino != m.paths["/etc/hello"] || ino != m.paths["/etc/hard"] {
		t.Fatalf("lookup hello: %d %v", ino, err)
	}
	if _, err := m.Lookup(m.paths["/etc/hello"], "x"); err == nil {
		t.Fatal("lookup in a file succeeded")
	}
}
