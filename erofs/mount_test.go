package erofs

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"maps"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestKernelMount loop-mounts images with the running kernel's erofs
// driver and checks the tree it shows against the source, xattrs and
// setuid bits included. It needs root, loop devices and erofs in
// /proc/filesystems, and skips without them: the guest kernel (6.1) is
// checked by the KVM tests, this is whatever kernel the machine runs.
func TestKernelMount(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to loop-mount")
	}
	if fss, err := os.ReadFile("/proc/filesystems"); err != nil || !bytes.Contains(fss, []byte("\terofs\n")) {
		t.Skip("the running kernel has no erofs driver (modprobe erofs)")
	}
	if _, err := exec.LookPath("mount"); err != nil {
		t.Skip("no mount(8)")
	}
	for _, tc := range []struct {
		name string
		fs   func() *memFS
	}{{"rich", richFS}, {"limits", limitsFS}, {"empty-root", newMemFS}} {
		t.Run(tc.name, func(t *testing.T) {
			m := tc.fs()
			im, err := Build(context.Background(), m, Options{VolumeName: "kiln"})
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			img := writeImage(t, im, dir)
			mnt := filepath.Join(dir, "mnt")
			if err := os.Mkdir(mnt, 0o755); err != nil {
				t.Fatal(err)
			}
			if out, err := exec.Command("mount", "-t", "erofs", "-o", "loop,ro", img, mnt).CombinedOutput(); err != nil {
				t.Skipf("cannot loop-mount here: %v: %s", err, out)
			}
			t.Cleanup(func() {
				if out, err := exec.Command("umount", mnt).CombinedOutput(); err != nil {
					t.Errorf("umount %s: %v: %s", mnt, err, out)
				}
			})
			if err := compareMounted(expect(t, m), mnt); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestKernelMountFuzzTrees mounts images of random fuzz-made trees (the
// ones that build) with the running kernel: varied layouts, block
// boundaries and directory sizes. POSIX ACLs and file capabilities are
// left out: the kernel parses their values, which fuzzTree makes up.
func TestKernelMountFuzzTrees(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to loop-mount")
	}
	if fss, err := os.ReadFile("/proc/filesystems"); err != nil || !bytes.Contains(fss, []byte("\terofs\n")) {
		t.Skip("the running kernel has no erofs driver (modprobe erofs)")
	}
	rng := rand.New(rand.NewPCG(11, 12))
	dir := t.TempDir()
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	built := 0
	for i := 0; built < 40 && i < 400; i++ {
		b := make([]byte, 64+rng.IntN(600))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		m := fuzzTree(b)
		for _, n := range m.nodes {
			n.xorder = slices.DeleteFunc(n.xorder, func(k string) bool {
				return strings.HasPrefix(k, "system.posix_acl_") || k == "security.capability"
			})
		}
		im, err := Build(context.Background(), m, Options{})
		if err != nil {
			continue
		}
		built++
		img := writeImage(t, im, dir)
		if out, err := exec.Command("mount", "-t", "erofs", "-o", "loop,ro", img, mnt).CombinedOutput(); err != nil {
			t.Skipf("cannot loop-mount here: %v: %s", err, out)
		}
		err = compareMounted(expect(t, m), mnt)
		if out, uerr := exec.Command("umount", mnt).CombinedOutput(); uerr != nil {
			t.Fatalf("umount: %v: %s", uerr, out)
		}
		if err != nil {
			t.Fatalf("tree %d (input %x): %v", i, b, err)
		}
	}
	if built < 40 {
		t.Fatalf("only %d trees built", built)
	}
}

// compareMounted checks the tree the kernel shows at root against wants:
// paths, modes (setuid, setgid and sticky included), owners, nlink,
// inode numbers shared by hardlinks only, sizes, mtimes, rdev, targets,
// xattrs and contents.
func compareMounted(wants map[string]*want, root string) error {
	seen := map[string]bool{}
	inos := map[uint64]uint64{} // source ino -> kernel ino
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			rel = ""
		}
		seen[rel] = true
		w, ok := wants[rel]
		if !ok {
			return fmt.Errorf("kernel shows %q, not in the tree", rel)
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		if st.Mode != w.mode {
			return fmt.Errorf("%q: mode %#o, want %#o", rel, st.Mode, w.mode)
		}
		if st.Uid != w.uid || st.Gid != w.gid {
			return fmt.Errorf("%q: owner %d:%d, want %d:%d", rel, st.Uid, st.Gid, w.uid, w.gid)
		}
		if uint32(st.Nlink) != w.nlink {
			return fmt.Errorf("%q: nlink %d, want %d", rel, st.Nlink, w.nlink)
		}
		if w.mode&syscall.S_IFMT != syscall.S_IFDIR && st.Size != w.size {
			return fmt.Errorf("%q: size %d, want %d", rel, st.Size, w.size)
		}
		if got := time.Unix(st.Mtim.Unix()); !got.Equal(w.mtime) {
			return fmt.Errorf("%q: mtime %v, want %v", rel, got, w.mtime)
		}
		if prev, ok := inos[w.ino]; ok && prev != st.Ino {
			return fmt.Errorf("%q: hardlinked inode has kernel inos %d and %d", rel, prev, st.Ino)
		}
		inos[w.ino] = st.Ino
		got, err := kernelXattrs(p)
		if err != nil {
			return fmt.Errorf("%q: %w", rel, err)
		}
		wantX := w.xattrs
		if t := w.mode & syscall.S_IFMT; t != syscall.S_IFREG && t != syscall.S_IFDIR {
			// Linux reads user.* only on files and directories
			// (xattr_permission: ENODATA elsewhere); kernelXattrs
			// leaves those out.
			wantX = maps.Clone(wantX)
			maps.DeleteFunc(wantX, func(k, _ string) bool { return strings.HasPrefix(k, "user.") })
		}
		if !maps.Equal(got, wantX) {
			return fmt.Errorf("%q: xattrs %q, want %q", rel, got, w.xattrs)
		}
		if err := compareContent(rel, p, st.Rdev, w); err != nil {
			return err
		}
		if w.mode&syscall.S_IFMT == syscall.S_IFDIR {
			// Every name found by lookup (the kernel's binary search),
			// not only by readdir.
			ents, err := os.ReadDir(p)
			if err != nil {
				return err
			}
			for _, e := range ents {
				if _, err := os.Lstat(filepath.Join(p, e.Name())); err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for p := range wants {
		if !seen[p] {
			return fmt.Errorf("kernel does not show %q", p)
		}
	}
	return nil
}

// kernelXattrs lists and reads a path's xattrs (without following a
// symlink), leaving out the user.* ones Linux lists but refuses to read
// on anything but a file or a directory.
func kernelXattrs(p string) (map[string]string, error) {
	buf := make([]byte, 1<<16)
	n, err := unix.Llistxattr(p, buf)
	if err != nil {
		return nil, fmt.Errorf("listxattr: %w", err)
	}
	out := map[string]string{}
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if name == "" {
			continue
		}
		v := make([]byte, 1<<16)
		n, err := unix.Lgetxattr(p, name, v)
		if err == unix.ENODATA && strings.HasPrefix(name, "user.") {
			continue // listed, but not readable on this file type
		}
		if err != nil {
			return nil, fmt.Errorf("getxattr %s: %w", name, err)
		}
		out[name] = string(v[:n])
	}
	return out, nil
}
