package hostfs

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sort"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// MaxTrees is how many named trees a Trees can add in its life: tags
// 1..254, each used once (255 is the trees folder's).
const MaxTrees = 254

// TreesDir is the hidden folder in tree 0's root that holds the named
// trees, each under its name: a guest reaches them through the mount it
// already has (a virtio-9p device takes one mount), e.g. the agent's
// container roots under /run/kiln/image/.kiln-trees/NAME. It is not
// listed in the root, and hides an entry of that name there.
const TreesDir = ".kiln-trees"

// treesDirTag is the tag of TreesDir's inode, DirIno.
const treesDirTag = 255

// DirIno is TreesDir's inode number.
const DirIno = uint64(treesDirTag)<<56 | 1

// maxTreeName is the longest name of a tree.
const maxTreeName = 128

// Trees serves several host directories as one rofs.FS: a default tree at
// the root, and named trees, added and removed while it is served, that a
// 9P client attaches by name (Tattach aname; the ninep.NamedRoots
// interface) or walks to under TreesDir. Each tree is an FS with its own tag in the top 8 bits of its
// inode numbers, and every method goes to the tree of its inode's tag.
//
// A tag is never used again in a Trees' life, so that a fid a guest still
// holds on a removed tree cannot reach a tree added later: MaxTrees Adds
// in all. Calls for a removed tree's inodes fail with ESTALE.
//
// Its methods are safe for concurrent use.
type Trees struct {
	root uint64 // tree 0's root

	mu     sync.RWMutex
	trees  [MaxTrees + 2]*served // by tag: the trees served
	state  [MaxTrees + 2]tagState
	names  map[string]uint8 // name → tag, of the trees served or being added
	closed bool
}

// served is one directory served.
type served struct {
	fs *FS
	// busy counts the calls in flight. Add is called only under
	// Trees.mu while the tree is in Trees.trees, so that once it has been
	// taken out Wait sees every call end.
	busy sync.WaitGroup
}

// tagState is where a tag is in its life: free, then reserved by an Add
// (free again if the Add fails), served, removed.
type tagState uint8

const (
	tagFree tagState = iota
	tagReserved
	tagServed
	tagRemoved
)

var _ rofs.FS = (*Trees)(nil)

// NewTrees serves dir as tree 0, the default tree at the root. Close
// releases it and every tree added.
func NewTrees(dir string) (*Trees, error) {
	fs, err := openTag(dir, 0)
	if err != nil {
		return nil, err
	}
	t := &Trees{root: fs.Root(), names: map[string]uint8{}}
	t.trees[0] = &served{fs: fs}
	t.state[0] = tagServed
	return t, nil
}

// validTreeName reports whether name may name a tree: 1 to 128 of
// [A-Za-z0-9_.-], not "." or "..".
func validTreeName(name string) bool {
	if name == "" || len(name) > maxTreeName || name == "." || name == ".." {
		return false
	}
	for _, c := range []byte(name) {
		switch {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '_', c == '.', c == '-':
		default:
			return false
		}
	}
	return true
}

// Add serves dir as the tree name, with the lowest tag never used. It
// fails when name is not 1 to 128 of [A-Za-z0-9_.-] (or is "." or ".."),
// is served already, or all MaxTrees tags have been used.
func (t *Trees) Add(name, dir string) error {
	if !validTreeName(name) {
		return fmt.Errorf("hostfs: tree name %q: a name is 1 to %d of [A-Za-z0-9_.-], not \".\" or \"..\": %w", name, maxTreeName, unix.EINVAL)
	}
	t.mu.Lock()
	if t.closed {
		t.mu.Unlock()
		return fmt.Errorf("hostfs: add tree %q: the trees are closed: %w", name, unix.EBADF)
	}
	if _, dup := t.names[name]; dup {
		t.mu.Unlock()
		return fmt.Errorf("hostfs: add tree %q: a tree of that name is served already: %w", name, unix.EEXIST)
	}
	tag := 0
	for i := 1; i <= MaxTrees; i++ {
		if t.state[i] == tagFree {
			tag = i
			break
		}
	}
	if tag == 0 {
		t.mu.Unlock()
		return fmt.Errorf("hostfs: add tree %q: all %d tree tags have been used (a tag is not used again): %w", name, MaxTrees, unix.ENOSPC)
	}
	t.state[tag] = tagReserved
	t.names[name] = uint8(tag)
	t.mu.Unlock()

	// Open outside the lock: it makes system calls that may block.
	fs, err := openTag(dir, uint8(tag))

	t.mu.Lock()
	defer t.mu.Unlock()
	if err == nil && t.closed {
		fs.Close()
		err = fmt.Errorf("the trees were closed meanwhile: %w", unix.EBADF)
	}
	if err != nil {
		// Never served, so no fid can name it: the tag is free again.
		t.state[tag] = tagFree
		delete(t.names, name)
		return fmt.Errorf("hostfs: add tree %q: %w", name, err)
	}
	t.trees[tag] = &served{fs: fs}
	t.state[tag] = tagServed
	return nil
}

// Remove stops serving the tree name and closes it, once the calls in
// flight on it have ended; its tag is not used again. Later calls for its
// inodes fail with ESTALE.
func (t *Trees) Remove(name string) error {
	t.mu.Lock()
	tag, ok := t.names[name]
	if !ok {
		t.mu.Unlock()
		return fmt.Errorf("hostfs: remove tree %q: no tree of that name is served: %w", name, unix.ENOENT)
	}
	tr := t.trees[tag]
	if tr == nil {
		t.mu.Unlock()
		return fmt.Errorf("hostfs: remove tree %q: it is still being added: %w", name, unix.EBUSY)
	}
	t.trees[tag] = nil
	t.state[tag] = tagRemoved
	delete(t.names, name)
	t.mu.Unlock()
	tr.busy.Wait()
	if err := tr.fs.Close(); err != nil {
		return fmt.Errorf("hostfs: remove tree %q: %w", name, err)
	}
	return nil
}

// Close stops serving every tree and closes them, once the calls in flight
// have ended. Later calls fail with ESTALE.
func (t *Trees) Close() error {
	t.mu.Lock()
	var trees []*served
	for tag, tr := range t.trees {
		if tr != nil {
			trees = append(trees, tr)
			t.trees[tag] = nil
			t.state[tag] = tagRemoved
		}
	}
	clear(t.names)
	t.closed = true
	t.mu.Unlock()
	var errs []error
	for _, tr := range trees {
		tr.busy.Wait()
		errs = append(errs, tr.fs.Close())
	}
	return errors.Join(errs...)
}

// AttachRoot returns the root inode of the tree name (ninep.NamedRoots).
func (t *Trees) AttachRoot(name string) (uint64, error) {
	t.mu.RLock()
	defer t.mu.RUnlock()
	if tag, ok := t.names[name]; ok && t.trees[tag] != nil {
		return t.trees[tag].fs.Root(), nil
	}
	return 0, fmt.Errorf("hostfs: no tree %q is served: %w", name, unix.ENOENT)
}

// IsRoot reports whether ino is the root of a named tree served now
// (ninep.NamedRoots).
func (t *Trees) IsRoot(ino uint64) bool {
	tag := tagOf(ino)
	t.mu.RLock()
	defer t.mu.RUnlock()
	return tag != 0 && t.trees[tag] != nil && t.trees[tag].fs.Root() == ino
}

// acquire returns the tree of ino's tag, counted busy until the caller
// releases it.
func (t *Trees) acquire(ino uint64) (*served, error) {
	tag := tagOf(ino)
	t.mu.RLock()
	defer t.mu.RUnlock()
	tr := t.trees[tag]
	if tr == nil {
		if t.state[tag] == tagRemoved {
			return nil, fmt.Errorf("hostfs: inode %#x: its tree (tag %d) has been removed: %w", ino, tag, unix.ESTALE)
		}
		return nil, fmt.Errorf("hostfs: inode %#x: no tree of tag %d is served: %w", ino, tag, unix.ENOENT)
	}
	tr.busy.Add(1)
	return tr, nil
}

// Root is tree 0's root.
func (t *Trees) Root() uint64 { return t.root }

// Getattr returns ino's attributes.
func (t *Trees) Getattr(ino uint64) (rofs.Attr, error) {
	if ino == DirIno {
		return rofs.Attr{Ino: DirIno, Mode: unix.S_IFDIR | 0o555, Nlink: 2}, nil
	}
	tr, err := t.acquire(ino)
	if err != nil {
		return rofs.Attr{}, err
	}
	defer tr.busy.Done()
	return tr.fs.Getattr(ino)
}

// Lookup returns the inode number of name in directory dir.
func (t *Trees) Lookup(dir uint64, name string) (uint64, error) {
	switch {
	case dir == t.root && name == TreesDir:
		return DirIno, nil
	case dir == DirIno:
		return t.AttachRoot(name)
	}
	tr, err := t.acquire(dir)
	if err != nil {
		return 0, err
	}
	defer tr.busy.Done()
	return tr.fs.Lookup(dir, name)
}

// ReadDir returns dir's entries sorted by name.
func (t *Trees) ReadDir(dir uint64) ([]rofs.Dirent, error) {
	if dir == DirIno {
		t.mu.RLock()
		var ents []rofs.Dirent
		for name, tag := range t.names {
			if tr := t.trees[tag]; tr != nil {
				ents = append(ents, rofs.Dirent{Name: name, Ino: tr.fs.Root(), Mode: unix.S_IFDIR})
			}
		}
		t.mu.RUnlock()
		sort.Slice(ents, func(i, j int) bool { return ents[i].Name < ents[j].Name })
		return ents, nil
	}
	tr, err := t.acquire(dir)
	if err != nil {
		return nil, err
	}
	defer tr.busy.Done()
	ents, err := tr.fs.ReadDir(dir)
	if err == nil && dir == t.root {
		ents = slices.DeleteFunc(ents, func(e rofs.Dirent) bool { return e.Name == TreesDir })
	}
	return ents, err
}

// Readlink returns a symbolic link's target.
func (t *Trees) Readlink(ino uint64) (string, error) {
	if ino == DirIno {
		return "", fmt.Errorf("hostfs: %s is a folder: %w", TreesDir, unix.EINVAL)
	}
	tr, err := t.acquire(ino)
	if err != nil {
		return "", err
	}
	defer tr.busy.Done()
	return tr.fs.Readlink(ino)
}

// ReadAt reads a regular file's bytes.
func (t *Trees) ReadAt(ctx context.Context, ino uint64, p []byte, off int64) (int, error) {
	if ino == DirIno {
		return 0, fmt.Errorf("hostfs: %s is a folder: %w", TreesDir, unix.EISDIR)
	}
	tr, err := t.acquire(ino)
	if err != nil {
		return 0, err
	}
	defer tr.busy.Done()
	return tr.fs.ReadAt(ctx, ino, p, off)
}

// Getxattr returns the value of extended attribute name.
func (t *Trees) Getxattr(ino uint64, name string) ([]byte, error) {
	if ino == DirIno {
		return nil, fmt.Errorf("hostfs: %s has no attribute %q: %w", TreesDir, name, unix.ENODATA)
	}
	tr, err := t.acquire(ino)
	if err != nil {
		return nil, err
	}
	defer tr.busy.Done()
	return tr.fs.Getxattr(ino, name)
}

// Listxattr returns the names of ino's extended attributes.
func (t *Trees) Listxattr(ino uint64) ([]string, error) {
	if ino == DirIno {
		return nil, nil
	}
	tr, err := t.acquire(ino)
	if err != nil {
		return nil, err
	}
	defer tr.busy.Done()
	return tr.fs.Listxattr(ino)
}

// StatFS describes tree 0's filesystem.
func (t *Trees) StatFS() rofs.StatFS {
	tr, err := t.acquire(t.root)
	if err != nil {
		return rofs.StatFS{BlockSize: 4096, NameLen: 255}
	}
	defer tr.busy.Done()
	return tr.fs.StatFS()
}
