package erofs

import (
	"bytes"
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// writeImage materializes im into a file in dir.
func writeImage(t *testing.T, im *Image, dir string) string {
	t.Helper()
	p := filepath.Join(dir, "image.erofs")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	buf := make([]byte, 1<<20)
	for off := int64(0); off < im.Size(); {
		n, err := im.ReadAt(context.Background(), buf, off)
		if n == 0 && err != nil {
			t.Fatalf("ReadAt(%d): %v", off, err)
		}
		if _, err := f.Write(buf[:n]); err != nil {
			t.Fatal(err)
		}
		off += int64(n)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestFsckErofs checks images with Debian's fsck.erofs (erofs-utils), a
// reader independent of this package and of go-erofs: it checks the
// image and extracts it, and the extracted tree must be the source tree.
func TestFsckErofs(t *testing.T) {
	tool, err := exec.LookPath("fsck.erofs")
	if err != nil {
		t.Fatalf("fsck.erofs is missing (%v): install Debian's erofs-utils package (apt-get install erofs-utils)", err)
	}
	if os.Geteuid() != 0 {
		t.Skip("fsck.erofs --extract needs root here: it makes device nodes and sets owners")
	}
	tests := []struct {
		name string
		fs   func() *memFS
	}{
		{"rich", richFS},
		{"limits", limitsFS},
		{"empty-root", newMemFS},
		{"one-empty-file", func() *memFS { m := newMemFS(); m.file("e", 0o644, nil); return m }},
		{"only-big-dir", func() *memFS {
			m := newMemFS()
			for i := range 1000 {
				m.symlink(fmt.Sprintf("d/%0200d", i), fmt.Sprintf("target-%d", i))
			}
			return m
		}},
		{"unaligned-sizes", func() *memFS {
			m := newMemFS()
			for i := range 50 {
				data := make([]byte, i*1237)
				patternAt(int64(i), data)
				m.file(fmt.Sprintf("f%02d", i), 0o644, data)
			}
			return m
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m := tc.fs()
			im, err := Build(context.Background(), m, Options{VolumeName: "fsck"})
			if err != nil {
				t.Fatal(err)
			}
			dir := t.TempDir()
			img := writeImage(t, im, dir)
			out := filepath.Join(dir, "out")
			cmd := exec.Command(tool, "--extract="+out, "--preserve", img)
			cmd.Env = append(os.Environ(), "LC_ALL=C")
			log, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("%s: %v\n%s", cmd, err, log)
			}
			if bytes.Contains(log, []byte("<W>")) || bytes.Contains(log, []byte("<E>")) {
				t.Errorf("%s warned:\n%s", cmd, log)
			}
			if err := compareExtracted(expect(t, m), out); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// compareExtracted checks the tree fsck.erofs extracted to root against
// wants: the same paths, types, permissions, owners, mtimes, link targets,
// device numbers and contents. fsck.erofs 1.5 chmods a file before it
// chowns it, and chown clears setuid and setgid on anything but a
// directory, so those two bits are not compared there (go-erofs checks
// them).
func compareExtracted(wants map[string]*want, root string) error {
	seen := map[string]bool{}
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
			return fmt.Errorf("extracted %q, not in the tree", rel)
		}
		fi, err := os.Lstat(p)
		if err != nil {
			return err
		}
		st := fi.Sys().(*syscall.Stat_t)
		mask := uint32(syscall.S_IFMT | 0o7777)
		if w.mode&syscall.S_IFMT != syscall.S_IFDIR {
			mask &^= syscall.S_ISUID | syscall.S_ISGID
		}
		if w.mode&syscall.S_IFMT == syscall.S_IFLNK {
			mask = syscall.S_IFMT // a symlink's permissions are always 0777
		}
		if st.Mode&mask != w.mode&mask {
			return fmt.Errorf("%q: mode %#o, want %#o", rel, st.Mode, w.mode)
		}
		if st.Uid != w.uid || st.Gid != w.gid {
			return fmt.Errorf("%q: owner %d:%d, want %d:%d", rel, st.Uid, st.Gid, w.uid, w.gid)
		}
		if got := time.Unix(st.Mtim.Unix()); !got.Equal(w.mtime) {
			return fmt.Errorf("%q: mtime %v, want %v", rel, got, w.mtime)
		}
		return compareContent(rel, p, st.Rdev, w)
	})
	if err != nil {
		return err
	}
	var missing []string
	for p := range wants {
		if !seen[p] {
			missing = append(missing, p)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("not extracted: %s", strings.Join(missing, ", "))
	}
	return nil
}

// compareContent checks what the file at p (rel in the tree) holds
// against w: a symlink's target, a regular file's bytes, a device's
// number (rdev, from its stat).
func compareContent(rel, p string, rdev uint64, w *want) error {
	switch w.mode & syscall.S_IFMT {
	case syscall.S_IFLNK:
		target, err := os.Readlink(p)
		if err != nil {
			return err
		}
		if target != w.target {
			return fmt.Errorf("%q: target %q, want %q", rel, target, w.target)
		}
	case syscall.S_IFREG:
		data, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		if !bytes.Equal(data, w.node.content()) {
			return fmt.Errorf("%q: contents differ (%d bytes, want %d)", rel, len(data), w.size)
		}
	case syscall.S_IFCHR, syscall.S_IFBLK:
		if rdev != w.rdev {
			return fmt.Errorf("%q: rdev %#x, want %#x", rel, rdev, w.rdev)
		}
	}
	return nil
}
