package hostfs

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// tree makes a directory to serve: files, a subdirectory, links (one
// pointing out of the tree, one absolute), a hard link and a fifo; and a
// secret file beside it that nothing may reach.
func tree(t testing.TB) (dir, secret string) {
	t.Helper()
	top := t.TempDir()
	secret = filepath.Join(top, "secret")
	dir = filepath.Join(top, "root")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(secret, []byte("host secret"), 0o600))
	must(os.MkdirAll(filepath.Join(dir, "etc", "deep", "er"), 0o755))
	must(os.MkdirAll(filepath.Join(dir, "bin"), 0o755))
	must(os.WriteFile(filepath.Join(dir, "etc", "hostname"), []byte("kiln\n"), 0o644))
	must(os.WriteFile(filepath.Join(dir, "etc", "deep", "er", "f"), bytes.Repeat([]byte("x"), 10000), 0o640))
	must(os.WriteFile(filepath.Join(dir, "bin", "busybox"), []byte("\x7fELF..."), 0o755))
	must(os.Symlink("busybox", filepath.Join(dir, "bin", "sh")))
	must(os.Symlink("../../secret", filepath.Join(dir, "up")))
	must(os.Symlink("/", filepath.Join(dir, "slash")))
	must(os.Symlink(top, filepath.Join(dir, "abs")))
	must(os.Link(filepath.Join(dir, "etc", "hostname"), filepath.Join(dir, "hardlink")))
	must(unix.Mkfifo(filepath.Join(dir, "fifo"), 0o644))
	return dir, secret
}

func open(t testing.TB, dir string) *FS {
	t.Helper()
	fs, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { fs.Close() })
	return fs
}

// walkPath looks up a slash-separated path from the root.
func walkPath(fs rofs.FS, p string) (uint64, error) {
	ino := fs.Root()
	for _, el := range splitPath(p) {
		var err error
		if ino, err = fs.Lookup(ino, el); err != nil {
			return 0, err
		}
	}
	return ino, nil
}

func splitPath(p string) []string {
	var out []string
	for _, el := range bytes.Split([]byte(p), []byte("/")) {
		if len(el) > 0 {
			out = append(out, string(el))
		}
	}
	return out
}

func readAll(t *testing.T, fs rofs.FS, ino uint64) []byte {
	t.Helper()
	var out []byte
	buf := make([]byte, 4096)
	for off := int64(0); ; {
		n, err := fs.ReadAt(context.Background(), ino, buf, off)
		out = append(out, buf[:n]...)
		off += int64(n)
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("read inode %d at %d: %v", ino, off, err)
		}
	}
}

func TestServe(t *testing.T) {
	dir, _ := tree(t)
	fs := open(t, dir)

	if a, err := fs.Getattr(fs.Root()); err != nil || a.Mode&unix.S_IFMT != unix.S_IFDIR || a.Ino != fs.Root() {
		t.Errorf("Getattr(root) = %+v, %v", a, err)
	}
	ents, err := fs.ReadDir(fs.Root())
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	types := map[string]uint32{}
	for _, e := range ents {
		names = append(names, e.Name)
		types[e.Name] = e.Mode
	}
	want := []string{"abs", "bin", "etc", "fifo", "hardlink", "slash", "up"}
	if !equal(names, want) {
		t.Errorf("ReadDir(root) = %v, want %v (sorted)", names, want)
	}
	for name, typ := range map[string]uint32{"bin": unix.S_IFDIR, "up": unix.S_IFLNK, "fifo": unix.S_IFIFO, "hardlink": unix.S_IFREG} {
		if types[name] != typ {
			t.Errorf("%s: type %o, want %o", name, types[name], typ)
		}
	}

	f, err := walkPath(fs, "etc/deep/er/f")
	if err != nil {
		t.Fatal(err)
	}
	a, err := fs.Getattr(f)
	if err != nil {
		t.Fatal(err)
	}
	if a.Ino != f || a.Size != 10000 || a.Mode != unix.S_IFREG|0o640 || a.Nlink != 1 {
		t.Errorf("Getattr(f) = %+v", a)
	}
	if got := readAll(t, fs, f); len(got) != 10000 || got[9999] != 'x' {
		t.Errorf("read %d bytes of f, want 10000", len(got))
	}
	// A short read at the end returns io.EOF.
	buf := make([]byte, 100)
	if n, err := fs.ReadAt(context.Background(), f, buf, 9950); n != 50 || !errors.Is(err, io.EOF) {
		t.Errorf("ReadAt at 9950 = %d, %v; want 50, io.EOF", n, err)
	}
	if n, err := fs.ReadAt(context.Background(), f, buf, 20000); n != 0 || !errors.Is(err, io.EOF) {
		t.Errorf("ReadAt past the end = %d, %v; want 0, io.EOF", n, err)
	}

	// Hard links are files of their own (inode numbers come from
	// paths), with the host's link count and the same bytes.
	h1, _ := walkPath(fs, "etc/hostname")
	h2, err := walkPath(fs, "hardlink")
	if err != nil || h1 == h2 {
		t.Errorf("a hard link's inode %d (%v), want one of its own (not %d)", h2, err, h1)
	}
	if a, _ := fs.Getattr(h2); a.Nlink != 2 || string(readAll(t, fs, h2)) != "kiln\n" {
		t.Errorf("the hard link: nlink %d, want 2, or its bytes differ", a.Nlink)
	}

	sh, _ := walkPath(fs, "bin/sh")
	if target, err := fs.Readlink(sh); err != nil || target != "busybox" {
		t.Errorf("Readlink(bin/sh) = %q, %v", target, err)
	}
	if _, err := fs.Readlink(f); !errors.Is(err, unix.EINVAL) {
		t.Errorf("Readlink of a file: %v, want EINVAL", err)
	}
	if _, err := fs.ReadAt(context.Background(), sh, buf, 0); !errors.Is(err, unix.EINVAL) {
		t.Errorf("ReadAt of a link: %v, want EINVAL", err)
	}
	bin, _ := walkPath(fs, "bin")
	if _, err := fs.ReadAt(context.Background(), bin, buf, 0); !errors.Is(err, unix.EINVAL) {
		t.Errorf("ReadAt of a directory: %v, want EINVAL", err)
	}
	if _, err := fs.ReadDir(f); !errors.Is(err, unix.ENOTDIR) {
		t.Errorf("ReadDir of a file: %v, want ENOTDIR", err)
	}
	if _, err := fs.Lookup(f, "x"); !errors.Is(err, unix.ENOTDIR) {
		t.Errorf("Lookup in a file: %v, want ENOTDIR", err)
	}
	if _, err := fs.Getattr(1 << 60); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Getattr of an unknown inode: %v, want ENOENT", err)
	}
	if s := fs.StatFS(); s.BlockSize == 0 || s.NameLen == 0 {
		t.Errorf("StatFS = %+v", s)
	}
}

// TestContained: nothing outside the directory is reached, through links
// (they are the guest's to resolve), names, or the fifo (never opened: a
// read of it would block).
func TestContained(t *testing.T) {
	dir, _ := tree(t)
	fs := open(t, dir)
	for _, p := range []string{"up/x", "slash/etc", "abs/secret", "bin/sh/x"} {
		if ino, err := walkPath(fs, p); !errors.Is(err, unix.ENOTDIR) {
			t.Errorf("walk %s = %d, %v; want ENOTDIR (a link is not followed)", p, ino, err)
		}
	}
	for _, name := range []string{"", ".", "..", "etc/hostname", "a\x00b", string(bytes.Repeat([]byte("a"), 256))} {
		if ino, err := fs.Lookup(fs.Root(), name); !errors.Is(err, unix.ENOENT) {
			t.Errorf("Lookup(root, %q) = %d, %v; want ENOENT", name, ino, err)
		}
	}
	up, _ := walkPath(fs, "up")
	if a, err := fs.Getattr(up); err != nil || a.Mode&unix.S_IFMT != unix.S_IFLNK {
		t.Errorf("Getattr(up) = %+v, %v; want the link itself", a, err)
	}
	if target, _ := fs.Readlink(up); target != "../../secret" {
		t.Errorf("Readlink(up) = %q", target)
	}
	fifo, _ := walkPath(fs, "fifo")
	if _, err := fs.ReadAt(context.Background(), fifo, make([]byte, 1), 0); !errors.Is(err, unix.EINVAL) {
		t.Errorf("ReadAt of a fifo: %v, want EINVAL without opening it", err)
	}
	if _, err := fs.Getxattr(fifo, "user.x"); !errors.Is(err, unix.ENODATA) {
		t.Errorf("Getxattr of a fifo: %v, want ENODATA", err)
	}
	if names, err := fs.Listxattr(fifo); err != nil || len(names) != 0 {
		t.Errorf("Listxattr of a fifo = %v, %v", names, err)
	}
}

// TestMountHidden: a mount below the directory is not served (its root,
// and so everything on it, is hidden).
func TestMountHidden(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir, _ := tree(t)
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mnt, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("mount tmpfs: %v", err)
	}
	t.Cleanup(func() { unix.Unmount(mnt, unix.MNT_DETACH) })
	if err := os.WriteFile(filepath.Join(mnt, "other"), []byte("other fs"), 0o644); err != nil {
		t.Fatal(err)
	}
	fs := open(t, dir)
	if ino, err := fs.Lookup(fs.Root(), "mnt"); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Lookup(mnt) = %d, %v; want ENOENT for a mount point", ino, err)
	}
	ents, err := fs.ReadDir(fs.Root())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name == "mnt" {
			t.Errorf("ReadDir lists the mount point mnt")
		}
	}
}

// TestRestore: an FS over a copy of the directory (the same image's rootfs
// mounted again, its host inode numbers all different, for a restored
// checkpoint) answers for the inodes the first one handed out, which it
// has never looked up, by walking the tree once.
func TestRestore(t *testing.T) {
	dir, _ := tree(t)
	first := open(t, dir)
	f, err := walkPath(first, "etc/deep/er/f")
	if err != nil {
		t.Fatal(err)
	}
	sh, _ := walkPath(first, "bin/sh")
	root := first.Root()

	again := filepath.Join(t.TempDir(), "again")
	if out, err := exec.Command("cp", "-a", dir, again).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
	second := open(t, again)
	if second.Root() != root {
		t.Errorf("the copy's root inode %d, want the first's %d", second.Root(), root)
	}
	if a, err := second.Getattr(f); err != nil || a.Size != 10000 {
		t.Fatalf("restored Getattr(f) = %+v, %v", a, err)
	}
	if target, err := second.Readlink(sh); err != nil || target != "busybox" {
		t.Errorf("restored Readlink(bin/sh) = %q, %v", target, err)
	}
	// An inode that is not in the tree stays unknown, without another walk.
	if _, err := second.Getattr(1 << 60); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Getattr of an unknown inode: %v", err)
	}

	if got := readAll(t, second, f); len(got) != 10000 {
		t.Errorf("read %d bytes of f through the copy, want 10000", len(got))
	}
	// A file gone from the tree is ENOENT, after one more walk.
	if err := os.RemoveAll(filepath.Join(again, "etc", "deep")); err != nil {
		t.Fatal(err)
	}
	second.mu.Lock()
	if of := second.files[f]; of != nil {
		of.evicted = true
		delete(second.files, f)
	}
	second.mu.Unlock()
	if _, err := second.Getattr(f); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Getattr of a removed file: %v, want ENOENT", err)
	}
}

// TestXattr: extended attributes of files and directories, where the
// host's filesystem keeps user ones.
func TestXattr(t *testing.T) {
	dir, _ := tree(t)
	fs := open(t, dir)
	f, _ := walkPath(fs, "etc/hostname")
	if _, err := fs.Getxattr(f, "user.none"); !errors.Is(err, unix.ENODATA) {
		t.Errorf("Getxattr of a missing name: %v, want ENODATA", err)
	}
	if err := unix.Setxattr(filepath.Join(dir, "etc", "hostname"), "user.kiln", []byte("v1"), 0); err != nil {
		t.Logf("this filesystem keeps no user xattrs (%v): only the missing case is checked", err)
		return
	}
	if v, err := fs.Getxattr(f, "user.kiln"); err != nil || string(v) != "v1" {
		t.Errorf("Getxattr(user.kiln) = %q, %v", v, err)
	}
	names, err := fs.Listxattr(f)
	if err != nil || !contains(names, "user.kiln") {
		t.Errorf("Listxattr = %v, %v", names, err)
	}
}

// TestReadsManyFiles: more files than are kept open, read concurrently.
func TestReadsManyFiles(t *testing.T) {
	dir := t.TempDir()
	const n = 3 * openFiles
	for i := 0; i < n; i++ {
		if err := os.WriteFile(filepath.Join(dir, string(rune('a'+i%26))+string(rune('a'+i/26))), []byte{byte(i)}, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	fs := open(t, dir)
	ents, err := fs.ReadDir(fs.Root())
	if err != nil || len(ents) != n {
		t.Fatalf("ReadDir: %d entries, %v", len(ents), err)
	}
	done := make(chan error, 4)
	for g := 0; g < 4; g++ {
		go func() {
			for round := 0; round < 3; round++ {
				for _, e := range ents {
					b := make([]byte, 2)
					if n, err := fs.ReadAt(context.Background(), e.Ino, b, 0); n != 1 || !errors.Is(err, io.EOF) {
						done <- errors.New(e.Name + ": short or failed read")
						return
					}
				}
			}
			done <- nil
		}()
	}
	for g := 0; g < 4; g++ {
		if err := <-done; err != nil {
			t.Error(err)
		}
	}
	fs.mu.Lock()
	open := len(fs.files)
	fs.mu.Unlock()
	if open > openFiles {
		t.Errorf("%d files kept open, want at most %d", open, openFiles)
	}
}

func TestOpenErrors(t *testing.T) {
	dir, _ := tree(t)
	for _, p := range []string{filepath.Join(dir, "nope"), filepath.Join(dir, "etc", "hostname")} {
		if fs, err := Open(p); err == nil {
			fs.Close()
			t.Errorf("Open(%s) succeeded, want an error", p)
		}
	}
}

func equal(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func contains(s []string, x string) bool {
	for _, v := range s {
		if v == x {
			return true
		}
	}
	return false
}

// FuzzLookup walks names a guest chooses: every inode it reaches is one of
// the tree's, and nothing outside it.
func FuzzLookup(f *testing.F) {
	dir, _ := tree(f)
	fs, err := Open(dir)
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { fs.Close() })
	// Every inode the tree has, by path, and the file each is.
	inTree := map[uint64]string{}
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err == nil {
			rel, _ := filepath.Rel(dir, p)
			inTree[inoOf(0, rel)] = p
		}
		return nil
	})
	for _, s := range []string{"etc/hostname", "up/../secret", "../secret", "slash/etc/passwd", "bin/sh", "etc/deep/er/f", "fifo", "."} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		ino := fs.Root()
		for _, el := range splitPath(p) {
			next, err := fs.Lookup(ino, el)
			if err != nil {
				return
			}
			hostPath, ok := inTree[next]
			if !ok {
				t.Fatalf("walk %q reached inode %d, not in the tree", p, next)
			}
			ino = next
			a, err := fs.Getattr(ino)
			if err != nil || a.Ino != ino {
				t.Fatalf("Getattr(%d) after walking %q = %+v, %v", ino, p, a, err)
			}
			var st syscall.Stat_t
			if err := syscall.Lstat(hostPath, &st); err != nil || st.Mode != a.Mode || st.Size != a.Size {
				t.Fatalf("walk %q: attributes %+v, the host's %s has mode %o size %d (%v)", p, a, hostPath, st.Mode, st.Size, err)
			}
		}
	})
}

// TestCollision: two paths with one inode number (a hash collision,
// forced here) make the second EIO, never the first's file.
func TestCollision(t *testing.T) {
	dir, _ := tree(t)
	fs := open(t, dir)
	fs.mu.Lock()
	fs.paths[inoOf(0, "etc")] = "bin/elsewhere"
	fs.mu.Unlock()
	if ino, err := fs.Lookup(fs.Root(), "etc"); !errors.Is(err, unix.EIO) {
		t.Errorf("Lookup of a colliding path = %d, %v; want EIO", ino, err)
	}
	ents, err := fs.ReadDir(fs.Root())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name == "etc" {
			t.Errorf("ReadDir lists the colliding etc")
		}
	}
}
