package agent

import (
	"archive/tar"
	"bytes"
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestWritableRoundTrip: an overlay upper layer (a new file, a changed
// one, a whiteout, an opaque folder, a hard link, a symlink, a setuid
// mode, an owner), /tmp and the engines' storage exported as one tar and
// applied to a fresh root (the lower layer's files) make the root the
// writes made: the whiteout's file gone, the opaque folder holding only
// the layer's entries, the raw parts' device kept as a device.
func TestWritableRoundTrip(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root: whiteouts are character devices, opaque folders trusted xattrs")
	}
	src, dst := t.TempDir(), t.TempDir()
	upper, tmp, storage := filepath.Join(src, "upper"), filepath.Join(src, "tmp"), filepath.Join(src, "storage")
	root, rtmp, rstorage := filepath.Join(dst, "root"), filepath.Join(dst, "tmp"), filepath.Join(dst, "storage")
	for _, d := range []string{upper + "/etc", upper + "/opq", tmp, storage + "/layer", root + "/etc", root + "/opq/old", rtmp, rstorage} {
		mustMkdir(t, d)
	}
	write := func(p, s string, mode os.FileMode) {
		t.Helper()
		if err := os.WriteFile(p, []byte(s), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
	}
	// The lower layer, as a fresh boot has it.
	write(root+"/etc/hostname", "lower\n", 0o644)
	write(root+"/etc/gone", "lower\n", 0o644)
	write(root+"/opq/old/f", "lower\n", 0o644)
	write(root+"/opq/keep-not", "lower\n", 0o644)
	// The writes.
	write(upper+"/etc/hostname", "upper\n", 0o644)
	write(upper+"/new", "new file\n", 0o755)
	if err := os.Chown(upper+"/new", 1000, 1000); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(upper+"/new", 0o755|os.ModeSetuid); err != nil { // after the chown, which clears it
		t.Fatal(err)
	}
	if err := os.Link(upper+"/new", upper+"/new-link"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("/etc/hostname", upper+"/sym"); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(upper+"/etc/gone", unix.S_IFCHR, 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(upper+"/opq", "trusted.overlay.opaque", []byte("y"), 0); err != nil {
		t.Skipf("no trusted xattrs here: %v", err)
	}
	write(upper+"/opq/mine", "mine\n", 0o600)
	write(tmp+"/scratch", "tmp\n", 0o600)
	if err := unix.Mknod(storage+"/layer/wh", unix.S_IFCHR, 0); err != nil {
		t.Fatal(err)
	}

	var buf bytes.Buffer
	cb := bufferedTo(&buf)
	if err := exportWritable(context.Background(), cb, []writablePart{
		{prefix: partRoot, dir: upper, diff: true}, {prefix: partTmp, dir: tmp}, {prefix: partStorage, dir: storage},
	}); err != nil {
		t.Fatal(err)
	}
	if err := importWritable(context.Background(), &buf, []writablePart{
		{prefix: partRoot, apply: root, diff: true}, {prefix: partTmp, apply: rtmp}, {prefix: partStorage, apply: rstorage},
	}); err != nil {
		t.Fatal(err)
	}
	read := func(p string) string {
		b, err := os.ReadFile(p)
		if err != nil {
			return "error: " + err.Error()
		}
		return string(b)
	}
	if got := read(root + "/etc/hostname"); got != "upper\n" {
		t.Errorf("a changed file reads %q", got)
	}
	if _, err := os.Lstat(root + "/etc/gone"); !os.IsNotExist(err) {
		t.Errorf("a whited-out file: %v", err)
	}
	ents, _ := os.ReadDir(root + "/opq")
	if len(ents) != 1 || ents[0].Name() != "mine" {
		t.Errorf("the opaque folder holds %v", ents)
	}
	var st, lst unix.Stat_t
	unix.Stat(root+"/new", &st)
	unix.Stat(root+"/new-link", &lst)
	if st.Mode&0o7777 != 0o4755 || st.Uid != 1000 || st.Gid != 1000 || st.Ino != lst.Ino || read(root+"/new") != "new file\n" {
		t.Errorf("the new file: mode %o uid %d gid %d, linked %v", st.Mode&0o7777, st.Uid, st.Gid, st.Ino == lst.Ino)
	}
	if l, err := os.Readlink(root + "/sym"); err != nil || l != "/etc/hostname" {
		t.Errorf("the symlink: %q %v", l, err)
	}
	if got := read(rtmp + "/scratch"); got != "tmp\n" {
		t.Errorf("/tmp's file reads %q", got)
	}
	var dev unix.Stat_t
	if err := unix.Lstat(rstorage+"/layer/wh", &dev); err != nil || dev.Mode&unix.S_IFMT != unix.S_IFCHR {
		t.Errorf("the storage's device: %v mode %o", err, dev.Mode)
	}
}

// TestImportWritableRefuses: entries outside the parts, and hard links
// out of theirs, are refused.
func TestImportWritableRefuses(t *testing.T) {
	dst := t.TempDir()
	parts := []writablePart{{prefix: partRoot, apply: dst, diff: true}, {prefix: partTmp, apply: t.TempDir()}}
	for _, h := range []tar.Header{
		{Name: "elsewhere/x", Typeflag: tar.TypeReg},
		{Name: "root/../x", Typeflag: tar.TypeReg},
		{Name: "root/", Typeflag: tar.TypeDir},
		{Name: "root/l", Typeflag: tar.TypeLink, Linkname: "tmp/x"},
		{Name: "root/l", Typeflag: tar.TypeLink, Linkname: "root/../../x"},
	} {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		tw.WriteHeader(&h)
		tw.Close()
		if err := importWritable(context.Background(), &buf, parts); err == nil || !strings.Contains(err.Error(), "not in") {
			t.Errorf("%s → %s: %v", h.Name, h.Linkname, err)
		}
	}
}

func mustMkdir(t *testing.T, d string) {
	t.Helper()
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
}

// TestMountPoints: the agent's set of mount points has / (pid1's parser,
// whose escapes pid1's tests cover).
func TestMountPoints(t *testing.T) {
	if m := mountPoints(); !m["/"] {
		t.Errorf("mountPoints lacks /: %d entries", len(m))
	}
}
