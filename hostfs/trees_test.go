package hostfs_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/hugelgupf/p9/p9"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/hostfs"
	"github.com/kilnvm/kiln/ninep"
	"github.com/kilnvm/kiln/rofs"
)

var _ ninep.NamedRoots = (*hostfs.Trees)(nil)

// rootfs makes a directory holding etc/hostname (content), a link and a
// subdirectory.
func rootfs(t testing.TB, content string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.MkdirAll(filepath.Join(dir, "etc", "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "etc", "hostname"), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("hostname", filepath.Join(dir, "etc", "link")); err != nil {
		t.Fatal(err)
	}
	return dir
}

func newTrees(t testing.TB, dir string) *hostfs.Trees {
	t.Helper()
	tr, err := hostfs.NewTrees(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr
}

// lookupFrom walks the slash-separated p from dir.
func lookupFrom(fs rofs.FS, dir uint64, p string) (uint64, error) {
	ino := dir
	for _, el := range strings.Split(p, "/") {
		var err error
		if ino, err = fs.Lookup(ino, el); err != nil {
			return 0, err
		}
	}
	return ino, nil
}

func readFile(fs rofs.FS, ino uint64) (string, error) {
	buf := make([]byte, 256)
	n, err := fs.ReadAt(context.Background(), ino, buf, 0)
	if err != nil && !errors.Is(err, io.EOF) {
		return "", err
	}
	return string(buf[:n]), nil
}

// TestTreesSeparate: the same path in two trees is two inodes, each
// reading its own tree's file, and tree 0's numbers are Open's.
func TestTreesSeparate(t *testing.T) {
	a, b := rootfs(t, "a\n"), rootfs(t, "b\n")
	trees := newTrees(t, a)
	if err := trees.Add("b", b); err != nil {
		t.Fatal(err)
	}
	broot, err := trees.AttachRoot("b")
	if err != nil {
		t.Fatal(err)
	}
	if broot == trees.Root() || broot>>56 != 1 || trees.Root()>>56 != 0 {
		t.Fatalf("roots %#x and %#x", trees.Root(), broot)
	}
	if !trees.IsRoot(broot) || trees.IsRoot(trees.Root()) {
		t.Error("IsRoot: only b's root is a named tree's root")
	}
	plain, err := hostfs.Open(a)
	if err != nil {
		t.Fatal(err)
	}
	defer plain.Close()
	want, _ := lookupFrom(plain, plain.Root(), "etc/hostname")
	for _, tt := range []struct {
		root    uint64
		tag     uint64
		content string
	}{{trees.Root(), 0, "a\n"}, {broot, 1, "b\n"}} {
		ino, err := lookupFrom(trees, tt.root, "etc/hostname")
		if err != nil {
			t.Fatal(err)
		}
		if ino>>56 != tt.tag || ino&(1<<56-1) != want&(1<<56-1) {
			t.Errorf("tree %d: etc/hostname is %#x, want tag %d and Open's low bits %#x", tt.tag, ino, tt.tag, want)
		}
		if got, err := readFile(trees, ino); got != tt.content || err != nil {
			t.Errorf("tree %d: read %q, %v; want %q", tt.tag, got, err, tt.content)
		}
		if a, err := trees.Getattr(ino); err != nil || a.Ino != ino {
			t.Errorf("tree %d: Getattr = %+v, %v", tt.tag, a, err)
		}
		link, _ := lookupFrom(trees, tt.root, "etc/link")
		if target, err := trees.Readlink(link); target != "hostname" || err != nil {
			t.Errorf("tree %d: Readlink = %q, %v", tt.tag, target, err)
		}
		etc, _ := lookupFrom(trees, tt.root, "etc")
		ents, err := trees.ReadDir(etc)
		if err != nil || len(ents) != 3 {
			t.Fatalf("tree %d: ReadDir(etc) = %v, %v", tt.tag, ents, err)
		}
		for _, e := range ents {
			if e.Ino>>56 != tt.tag {
				t.Errorf("tree %d: entry %s has inode %#x", tt.tag, e.Name, e.Ino)
			}
		}
		if _, err := trees.Listxattr(ino); err != nil {
			t.Errorf("tree %d: Listxattr: %v", tt.tag, err)
		}
	}
	// An inode of one tree is not found in another's directory.
	if _, err := trees.Lookup(broot|0xff, "etc"); err == nil {
		t.Error("Lookup of a made-up inode of tree b succeeded")
	}
	if st := trees.StatFS(); st.BlockSize == 0 {
		t.Errorf("StatFS = %+v", st)
	}
}

func TestTreesErrors(t *testing.T) {
	dir := rootfs(t, "x")
	trees := newTrees(t, dir)
	if err := trees.Add("taken", dir); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		op   func() error
		want error
	}{
		{"empty name", func() error { return trees.Add("", dir) }, unix.EINVAL},
		{"dot", func() error { return trees.Add(".", dir) }, unix.EINVAL},
		{"dot dot", func() error { return trees.Add("..", dir) }, unix.EINVAL},
		{"slash", func() error { return trees.Add("a/b", dir) }, unix.EINVAL},
		{"space", func() error { return trees.Add("a b", dir) }, unix.EINVAL},
		{"not ASCII", func() error { return trees.Add("é", dir) }, unix.EINVAL},
		{"too long", func() error { return trees.Add(strings.Repeat("x", 129), dir) }, unix.EINVAL},
		{"longest", func() error { return trees.Add(strings.Repeat("x", 128), dir) }, nil},
		{"odd but valid", func() error { return trees.Add("ctr-1_2.rootfs", dir) }, nil},
		{"duplicate", func() error { return trees.Add("taken", dir) }, unix.EEXIST},
		{"no such directory", func() error { return trees.Add("missing", filepath.Join(dir, "nothere")) }, unix.ENOENT},
		{"not a directory", func() error { return trees.Add("file", filepath.Join(dir, "etc", "hostname")) }, unix.ENOTDIR},
		{"name free after a failed add", func() error { return trees.Add("missing", dir) }, nil},
		{"attach unknown", func() error { _, err := trees.AttachRoot("nothere"); return err }, unix.ENOENT},
		{"attach empty", func() error { _, err := trees.AttachRoot(""); return err }, unix.ENOENT},
		{"remove unknown", func() error { return trees.Remove("nothere") }, unix.ENOENT},
		{"inode of no tree", func() error { _, err := trees.Getattr(200<<56 | 1); return err }, unix.ENOENT},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.op()
			if tt.want == nil && err != nil || tt.want != nil && !errors.Is(err, tt.want) {
				t.Fatalf("got %v, want %v", err, tt.want)
			}
			if err != nil && !strings.Contains(err.Error(), "hostfs: ") {
				t.Errorf("error %q has no context", err)
			}
		})
	}
	// Failed adds used no tag: taken, longest, odd but valid, missing.
	if root, err := trees.AttachRoot("missing"); err != nil || root>>56 != 4 {
		t.Errorf("AttachRoot(missing) = %#x, %v; want tag 4", root, err)
	}
}

// TestTreesRemove: a removed tree's inodes fail cleanly (ESTALE), its
// name can be added again with a new tag, and tree 0 goes on.
func TestTreesRemove(t *testing.T) {
	a, b := rootfs(t, "a\n"), rootfs(t, "b\n")
	trees := newTrees(t, a)
	if err := trees.Add("b", b); err != nil {
		t.Fatal(err)
	}
	broot, _ := trees.AttachRoot("b")
	file, err := lookupFrom(trees, broot, "etc/hostname")
	if err != nil {
		t.Fatal(err)
	}
	if got, err := readFile(trees, file); got != "b\n" || err != nil { // keeps it open
		t.Fatalf("read %q, %v", got, err)
	}
	if err := trees.Remove("b"); err != nil {
		t.Fatal(err)
	}
	if err := trees.Remove("b"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("second Remove: %v", err)
	}
	calls := map[string]func() error{
		"Getattr":   func() error { _, err := trees.Getattr(file); return err },
		"Lookup":    func() error { _, err := trees.Lookup(broot, "etc"); return err },
		"ReadDir":   func() error { _, err := trees.ReadDir(broot); return err },
		"Readlink":  func() error { _, err := trees.Readlink(file); return err },
		"ReadAt":    func() error { _, err := readFile(trees, file); return err },
		"Getxattr":  func() error { _, err := trees.Getxattr(file, "user.x"); return err },
		"Listxattr": func() error { _, err := trees.Listxattr(file); return err },
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, unix.ESTALE) {
			t.Errorf("%s of a removed tree's inode: %v, want ESTALE", name, err)
		}
	}
	if _, err := trees.AttachRoot("b"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("AttachRoot of a removed tree: %v", err)
	}
	if trees.IsRoot(broot) {
		t.Error("a removed tree's root is still a root")
	}
	if err := trees.Add("b", a); err != nil {
		t.Fatal(err)
	}
	if root, _ := trees.AttachRoot("b"); root>>56 != 2 || root == broot {
		t.Errorf("b added again has root %#x, want tag 2", root)
	}
	if _, err := trees.Getattr(file); !errors.Is(err, unix.ESTALE) {
		t.Errorf("an old inode after its name was added again: %v", err)
	}
	if ino, err := lookupFrom(trees, trees.Root(), "etc/hostname"); err != nil {
		t.Error(err)
	} else if got, _ := readFile(trees, ino); got != "a\n" {
		t.Errorf("tree 0 reads %q", got)
	}
	if err := trees.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := trees.Getattr(trees.Root()); !errors.Is(err, unix.ESTALE) {
		t.Errorf("Getattr after Close: %v", err)
	}
	if err := trees.Add("c", a); err == nil {
		t.Error("Add after Close succeeded")
	}
	if st := trees.StatFS(); st.BlockSize == 0 {
		t.Errorf("StatFS after Close = %+v", st)
	}
	if err := trees.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
}

// TestTreesTagsRunOut: tags are not used again, so the 256th add fails
// however many trees were removed.
func TestTreesTagsRunOut(t *testing.T) {
	dir := rootfs(t, "x")
	trees := newTrees(t, dir)
	for i := range hostfs.MaxTrees {
		if err := trees.Add("t", dir); err != nil {
			t.Fatalf("add %d: %v", i+1, err)
		}
		if root, _ := trees.AttachRoot("t"); root>>56 != uint64(i+1) {
			t.Fatalf("add %d has root %#x", i+1, root)
		}
		if err := trees.Remove("t"); err != nil {
			t.Fatal(err)
		}
	}
	err := trees.Add("t", dir)
	if !errors.Is(err, unix.ENOSPC) || !strings.Contains(err.Error(), `"t"`) {
		t.Errorf("add past the tags: %v", err)
	}
}

// TestTreesConcurrent: reads race with adds and removes of the tree read;
// each succeeds or fails with ESTALE. Run with -race.
func TestTreesConcurrent(t *testing.T) {
	a, b := rootfs(t, "a\n"), rootfs(t, "b\n")
	trees := newTrees(t, a)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				root, err := trees.AttachRoot("b")
				if err != nil {
					continue
				}
				ino, err := lookupFrom(trees, root, "etc/hostname")
				if err == nil {
					var got string
					if got, err = readFile(trees, ino); err == nil && got != "b\n" {
						t.Errorf("read %q", got)
						return
					}
				}
				if err != nil && !errors.Is(err, unix.ESTALE) {
					t.Errorf("read of a tree being removed: %v", err)
					return
				}
			}
		}()
	}
	for range 100 {
		if err := trees.Add("b", b); err != nil {
			t.Error(err)
			break
		}
		if err := trees.Remove("b"); err != nil {
			t.Error(err)
			break
		}
	}
	close(stop)
	wg.Wait()
}

// TestTreesNinep: a named tree attached by aname through the 9P server,
// and a fid on it after the tree is removed.
func TestTreesNinep(t *testing.T) {
	trees := newTrees(t, rootfs(t, "a\n"))
	if err := trees.Add("ctr2", rootfs(t, "b\n")); err != nil {
		t.Fatal(err)
	}
	cc, sc := net.Pipe()
	serve(t, ninep.NewServer(trees, ninep.Options{}), sc)
	c, err := p9.NewClient(cc, p9.WithMessageSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	read := func(root p9.File, names ...string) (string, error) {
		_, f, err := root.Walk(names)
		if err != nil {
			return "", err
		}
		if _, _, err := f.Open(p9.ReadOnly); err != nil {
			return "", err
		}
		buf := make([]byte, 64)
		n, err := f.ReadAt(buf, 0)
		if err != nil && !errors.Is(err, io.EOF) {
			return "", err
		}
		return string(buf[:n]), nil
	}
	for _, tt := range []struct{ aname, want string }{{"", "a\n"}, {"/", "a\n"}, {"ctr2", "b\n"}} {
		root, err := c.Attach(tt.aname)
		if err != nil {
			t.Fatalf("attach %q: %v", tt.aname, err)
		}
		if got, err := read(root, "etc", "hostname"); got != tt.want || err != nil {
			t.Errorf("attach %q: read %q, %v; want %q", tt.aname, got, err, tt.want)
		}
		// ".." stays in the tree attached.
		if got, err := read(root, "..", "etc", "hostname"); got != tt.want || err != nil {
			t.Errorf("attach %q: read ../etc/hostname %q, %v", tt.aname, got, err)
		}
	}
	if _, err := c.Attach("nothere"); !isErrno(err, unix.ENOENT) {
		t.Errorf("attach nothere: %v, want ENOENT", err)
	}
	root, err := c.Attach("ctr2")
	if err != nil {
		t.Fatal(err)
	}
	if err := trees.Remove("ctr2"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := root.Walk([]string{"etc"}); !isErrno(err, unix.ESTALE) {
		t.Errorf("walk in a removed tree: %v, want ESTALE", err)
	}
	if _, err := c.Attach("ctr2"); !isErrno(err, unix.ENOENT) {
		t.Errorf("attach a removed tree: %v, want ENOENT", err)
	}
}

// TestTreesDir: the named trees are reachable from tree 0's root through
// the hidden TreesDir (a guest's one 9p mount of the device), which is
// not listed and hides an entry of that name in the tree.
func TestTreesDir(t *testing.T) {
	base := rootfs(t, "base\n")
	if err := os.Mkdir(filepath.Join(base, hostfs.TreesDir), 0o755); err != nil { // hidden
		t.Fatal(err)
	}
	tr := newTrees(t, base)
	if err := tr.Add("web", rootfs(t, "web\n")); err != nil {
		t.Fatal(err)
	}
	if err := tr.Add("side", rootfs(t, "side\n")); err != nil {
		t.Fatal(err)
	}
	ents, err := tr.ReadDir(tr.Root())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name == hostfs.TreesDir {
			t.Errorf("the root lists %s", hostfs.TreesDir)
		}
	}
	dir, err := tr.Lookup(tr.Root(), hostfs.TreesDir)
	if err != nil || dir != hostfs.DirIno {
		t.Fatalf("Lookup(%s) = %#x, %v", hostfs.TreesDir, dir, err)
	}
	if a, err := tr.Getattr(dir); err != nil || a.Mode&unix.S_IFMT != unix.S_IFDIR {
		t.Errorf("Getattr(%s) = %+v, %v; want a folder", hostfs.TreesDir, a, err)
	}
	ents, err = tr.ReadDir(dir)
	if err != nil || len(ents) != 2 || ents[0].Name != "side" || ents[1].Name != "web" {
		t.Fatalf("ReadDir(%s) = %+v, %v; want side, web", hostfs.TreesDir, ents, err)
	}
	for _, name := range []string{"web", "side"} {
		ino, err := lookupFrom(tr, dir, name+"/etc/hostname")
		if err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 64)
		n, _ := tr.ReadAt(context.Background(), ino, buf, 0)
		if got := string(buf[:n]); got != name+"\n" {
			t.Errorf("%s/%s/etc/hostname = %q", hostfs.TreesDir, name, got)
		}
	}
	if _, err := tr.Lookup(dir, "nope"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Lookup of an unknown tree = %v, want ENOENT", err)
	}
	if _, err := tr.ReadAt(context.Background(), dir, make([]byte, 8), 0); !errors.Is(err, unix.EISDIR) {
		t.Errorf("ReadAt(%s) = %v, want EISDIR", hostfs.TreesDir, err)
	}
	if err := tr.Remove("web"); err != nil {
		t.Fatal(err)
	}
	if ents, _ := tr.ReadDir(dir); len(ents) != 1 || ents[0].Name != "side" {
		t.Errorf("ReadDir(%s) after removing web = %+v", hostfs.TreesDir, ents)
	}
}
