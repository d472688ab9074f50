package erofs

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// richFS is a tree with one of everything the image must carry.
func richFS() *memFS {
	m := newMemFS()
	m.nodes[1].setxattr("user.root", []byte("r"))
	m.file("hello.txt", 0o644, []byte("hello, world\n"))
	m.file("empty", 0o600, nil)
	for _, size := range []int{1, 4095, 4096, 4097, 8191, 8192, 8193} {
		data := make([]byte, size)
		patternAt(int64(size), data)
		m.file(fmt.Sprintf("sizes/f%d", size), 0o644, data)
	}
	m.bigFile("big/ten-mib", 10<<20)
	m.file("modes/setuid", syscall.S_ISUID|0o755, []byte("#!/bin/true\n"))
	m.file("modes/setgid", syscall.S_ISGID|0o755, []byte("x"))
	m.file("modes/all", syscall.S_ISUID|syscall.S_ISGID|syscall.S_ISVTX|0o777, []byte("x"))
	m.mkdir("modes/sticky", syscall.S_ISVTX|0o777)
	m.file("modes/none", 0, []byte("no permissions"))
	m.file("owners/big-ids", 0o644, []byte("ids")).owner(100000, 4000000000)
	m.file("owners/nobody", 0o644, []byte("n")).owner(65534, 65534)
	m.file("times/nanos", 0o644, []byte("t")).mtime(time.Unix(1234567890, 987654321))
	m.file("times/old", 0o644, []byte("t")).mtime(time.Unix(-86400*365, 5))
	m.file("times/zero", 0o644, []byte("t")).mtime(time.Unix(0, 0))
	m.symlink("links/rel", "../hello.txt")
	m.symlink("links/abs", "/hello.txt")
	m.symlink("links/dangling", "no/such/file")
	m.symlink("links/long", strings.Repeat("d/", 2047)+"x") // 4095 bytes
	m.symlink("links/one", "x")
	h := m.file("hard/a", 0o644, []byte("hardlinked data"))
	m.link("hard/b", h)
	m.link("hard/sub/c", h)
	m.link("hello-again", m.nodes[m.nodes[1].kids[0].Ino])
	m.special("dev/null", syscall.S_IFCHR|0o666, unix.Mkdev(1, 3))
	m.special("dev/sda1", syscall.S_IFBLK|0o660, unix.Mkdev(8, 1))
	m.special("dev/big", syscall.S_IFCHR|0o600, unix.Mkdev(4095, 1<<20-1))
	m.special("dev/zero-zero", syscall.S_IFBLK|0o600, 0)
	m.special("dev/fifo", syscall.S_IFIFO|0o644, 0)
	m.special("dev/sock", syscall.S_IFSOCK|0o755, 0)
	// Extended attributes of every kind, and some EROFS cannot hold.
	ping := m.file("xattr/ping", 0o755, []byte("ELF..."))
	ping.setxattr("security.capability", []byte{1, 0, 0, 2, 0, 0x20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0})
	ping.setxattr("user.mime_type", []byte("application/x-executable"))
	ping.setxattr("user.empty", nil)
	ping.setxattr("trusted.overlay.opaque", []byte("y"))
	ping.setxattr("security.selinux", []byte("system_u:object_r:ping_exec_t:s0\x00"))
	ping.setxattr("system.posix_acl_access", []byte{2, 0, 0, 0, 1, 0, 7, 0, 0xff, 0xff, 0xff, 0xff})
	ping.setxattr("system.nfs4_acl", []byte("cannot be held"))
	ping.setxattr("unprefixed", []byte("cannot be held"))
	ping.setxattr("user.", []byte("cannot be held"))
	m.mkdir("xattr/acl-dir", 0o755).
		setxattr("system.posix_acl_default", []byte{2, 0, 0, 0, 1, 0, 7, 0, 0xff, 0xff, 0xff, 0xff}).
		setxattr("user.big", bytes.Repeat([]byte("v"), 65535))
	m.symlink("xattr/link", "ping").setxattr("trusted.x", bytes.Repeat([]byte("L"), 3000))
	// A symlink whose xattrs leave no room for its target in the block:
	// FLAT_PLAIN, the target in a block of its own.
	m.symlink("xattr/plain-link", strings.Repeat("t", 2000)).setxattr("user.pad", bytes.Repeat([]byte("p"), 3000))
	m.file("xattr/many", 0o644, []byte("m")).setxattr("user.a", []byte("1")).setxattr("user.b", []byte("22")).setxattr("user.c", []byte("333"))
	// A big directory: many dirent blocks.
	for i := range 3000 {
		m.file(fmt.Sprintf("bigdir/%s-%05d", strings.Repeat("long-name-", 8), i), 0o644, []byte{byte(i)})
	}
	// Names that sort before "." and between "." and "..".
	m.file("dots/!bang", 0o644, []byte("!"))
	m.file("dots/-dash", 0o644, []byte("-"))
	m.file("dots/.-", 0o644, []byte(".-"))
	m.file("dots/.hidden", 0o644, []byte("h"))
	m.file("dots/...", 0o644, []byte("..."))
	m.file("dots/\xff\xfe", 0o644, []byte("high bytes"))
	m.file("dots/"+strings.Repeat("n", 255), 0o644, []byte("longest name"))
	// A directory of exactly one block: no tail to inline.
	for i := range 15 {
		m.file(fmt.Sprintf("exact/%c%s", 'a'+i, strings.Repeat("e", 249)), 0o644, nil)
	}
	m.file("exact/p"+strings.Repeat("e", 126), 0o644, nil)
	// Deep paths.
	deep := ""
	for i := range 40 {
		deep += fmt.Sprintf("level%02d/", i)
	}
	m.file(deep+"bottom", 0o644, []byte("deep"))
	m.mkdir("emptydir", 0o700)
	return m
}

func TestRichTree(t *testing.T) {
	m := richFS()
	var logs bytes.Buffer
	opts := Options{VolumeName: "kiln-test", UUID: [16]byte{1, 2, 3}, Logger: slog.New(slog.NewTextHandler(&logs, nil))}
	im, err := Build(context.Background(), m, opts)
	if err != nil {
		t.Fatal(err)
	}
	if n := m.readCalls.Load(); n != 0 {
		t.Errorf("Build read file data (%d ReadAt calls)", n)
	}
	if got := strings.Count(logs.String(), "\n"); got != 1 || !strings.Contains(logs.String(), "count=3") {
		t.Errorf("log: %q, want one line counting 3 skipped xattrs", logs.String())
	}
	if im.Size()%BlockSize != 0 || im.MetadataSize()%BlockSize != 0 || im.MetadataSize() > im.Size() {
		t.Errorf("Size %d, MetadataSize %d", im.Size(), im.MetadataSize())
	}
	if !strings.HasPrefix(im.Digest(), "sha256:") || len(im.Digest()) != 7+64 {
		t.Errorf("Digest %q", im.Digest())
	}
	if want := len(expectInos(m)); im.Inodes() != want {
		t.Errorf("Inodes() = %d, want %d", im.Inodes(), want)
	}
	raw := materialize(t, im)
	if err := checkLayout(raw, im.MetadataSize()); err != nil {
		t.Fatalf("layout: %v", err)
	}
	compareGoErofs(t, m, im)
	if !bytes.Equal(raw[superOffset+64:superOffset+80], append([]byte("kiln-test"), make([]byte, 7)...)) {
		t.Errorf("volume name field % x", raw[superOffset+64:superOffset+80])
	}
	if !bytes.Equal(raw[superOffset+48:superOffset+64], []byte{1, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}) {
		t.Errorf("uuid field % x", raw[superOffset+48:superOffset+64])
	}
	t.Logf("image: %d blocks, %d metadata blocks, %d inodes", im.Size()/BlockSize, im.MetadataSize()/BlockSize, im.Inodes())
}

// expectInos is the set of inodes reachable in m.
func expectInos(m *memFS) map[uint64]bool {
	seen := map[uint64]bool{}
	var walk func(ino uint64)
	walk = func(ino uint64) {
		seen[ino] = true
		for _, k := range m.nodes[ino].kids {
			walk(k.Ino)
		}
	}
	walk(m.Root())
	return seen
}
