package erofs

import (
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fuzzReader hands out the fuzz input a piece at a time; past its end it
// gives zeros.
type fuzzReader struct{ b []byte }

func (r *fuzzReader) done() bool { return len(r.b) == 0 }

func (r *fuzzReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *fuzzReader) bytes(n int) []byte {
	out := make([]byte, n)
	for i := range out {
		out[i] = r.byte()
	}
	return out
}

func (r *fuzzReader) u16() uint16 { return binary.LittleEndian.Uint16(r.bytes(2)) }
func (r *fuzzReader) u32() uint32 { return binary.LittleEndian.Uint32(r.bytes(4)) }
func (r *fuzzReader) u64() uint64 { return binary.LittleEndian.Uint64(r.bytes(8)) }

// hostile reports, for about one call in 32, that the next value should
// break a rule: the fuzzer still finds every fault, and most trees build.
func (r *fuzzReader) hostile() bool { return r.byte() < 8 }

// name is a directory entry's name: mostly short names of a few letters
// (so that some collide), sometimes raw bytes ('/', NUL...), ".", "..",
// empty, or at or past the 255-byte limit.
func (r *fuzzReader) name() string {
	k := r.byte() // past the input's end, 0: a plain name
	switch {
	case k == 255:
		return ""
	case k == 254:
		return "."
	case k == 253:
		return ".."
	case k == 252:
		return strings.Repeat("n", 255)
	case k == 251:
		return strings.Repeat("n", 256)
	case k >= 244:
		return string(r.bytes(int(k%16) + 1))
	}
	const alphabet = "ab.-_~XY\xff"
	b := r.bytes(int(k%8) + 1)
	for i := range b {
		b[i] = alphabet[int(b[i])%len(alphabet)]
	}
	return string(b)
}

// str is a symlink target or xattr name part: raw bytes (NUL among
// them, rarely), or empty, or at or past a limit.
func (r *fuzzReader) str(limit int) string {
	k := r.byte() // past the input's end, 0: one letter
	switch k {
	case 255:
		return ""
	case 254:
		return strings.Repeat("s", limit)
	case 253:
		return strings.Repeat("s", limit+1)
	}
	b := r.bytes(int(k%40) + 1)
	if k < 240 {
		for i := range b {
			b[i] = 'a' + b[i]%26
		}
	}
	return string(b)
}

// xattrPrefixes are the prefixes fuzzTree gives xattr names: the ones
// EROFS holds, and some it cannot.
var xattrPrefixes = []string{
	"user.", "trusted.", "security.", "system.posix_acl_access", "system.posix_acl_default",
	"system.", "", "user", "security.capability", "trusted.overlay.",
}

// fuzzTree turns fuzz bytes into a tree: files, directories, symlinks,
// hardlinks (to directories too), devices, FIFOs, sockets, xattrs, owners,
// mtimes and raw modes, with hostile values among them.
func fuzzTree(data []byte) *memFS {
	m := newMemFS()
	r := &fuzzReader{b: data}
	dirs := []*memNode{m.nodes[1]}
	all := []*memNode{m.nodes[1]}
	add := func(dir *memNode, name string, n *memNode) {
		m.entry(dir, name, n)
		all = append(all, n)
	}
	for ops := 0; ops < 48 && !r.done(); ops++ {
		op := r.byte()
		dir := dirs[int(r.byte())%len(dirs)]
		any := all[int(r.byte())%len(all)]
		switch op % 12 {
		case 0, 1:
			n := m.newIno(syscall.S_IFREG | uint32(r.u16())&0o7777)
			n.data = make([]byte, int(r.u16())%20000)
			patternAt(int64(n.attr.Ino)<<20, n.data)
			n.attr.Size = int64(len(n.data))
			add(dir, r.name(), n)
		case 2:
			n := m.newIno(syscall.S_IFDIR | uint32(r.u16())&0o7777)
			add(dir, r.name(), n)
			dirs = append(dirs, n)
		case 3:
			n := m.newIno(syscall.S_IFLNK | 0o777)
			n.target = r.str(maxLinkLen)
			n.attr.Size = int64(len(n.target))
			add(dir, r.name(), n)
		case 4:
			// A hardlink; to a directory (rarely) a cycle or a
			// hardlinked directory.
			if any.attr.Mode&syscall.S_IFMT != syscall.S_IFDIR || r.hostile() {
				m.entry(dir, r.name(), any)
			}
		case 5:
			mode := uint32(syscall.S_IFCHR)
			if r.byte()&1 == 1 {
				mode = syscall.S_IFBLK
			}
			n := m.newIno(mode | 0o600)
			if r.hostile() {
				n.attr.Rdev = r.u64()
			} else {
				n.attr.Rdev = unix.Mkdev(uint32(r.u16())&0xfff, uint32(r.u32())&0xfffff)
			}
			add(dir, r.name(), n)
		case 6:
			mode := uint32(syscall.S_IFIFO)
			if r.byte()&1 == 1 {
				mode = syscall.S_IFSOCK
			}
			add(dir, r.name(), m.newIno(mode|0o644))
		case 7, 8:
			name := xattrPrefixes[int(r.byte())%len(xattrPrefixes)] + r.str(maxXattrName)
			size := int(r.u16())
			if size == 0xFFFF && r.byte()&1 == 1 {
				size++
			}
			any.setxattr(name, make([]byte, size%70000))
		case 9:
			any.owner(r.u32(), r.u32())
			any.mtime(time.Unix(int64(r.u64()), int64(r.u32()%1e9)))
		case 10:
			if r.hostile() {
				any.attr.Mode = r.u32() // any type, or none
			} else {
				any.attr.Mode = any.attr.Mode&syscall.S_IFMT | uint32(r.u16())&0o7777
			}
		case 11:
			// A directory of many long names: several dirent blocks.
			prefix := strings.Repeat(string(rune('a'+r.byte()%26)), int(r.byte()))
			for i := range int(r.byte()) % 80 { // a few blocks; the fuzzer stays fast
				add(dir, fmt.Sprintf("%.250s%d", prefix, i), m.newIno(syscall.S_IFREG|0o644))
			}
		}
	}
	return m
}

// FuzzBuild builds images of fuzz-made trees: Build must return an error,
// or an image that keeps the kernel's layout rules and that go-erofs reads
// back equal to the tree.
func FuzzBuild(f *testing.F) {
	// Each op is [op][dir][any] and its own bytes (see fuzzTree).
	f.Add([]byte{})
	f.Add([]byte{0, 0, 0, 0xa4, 0x01, 0x10, 0, 0, 'a'})                                                                       // a file
	f.Add([]byte{2, 0, 0, 0xed, 0x01, 0, 'd', 0, 1, 0, 0xa4, 0x01, 0x10, 0, 0, 'f'})                                          // a dir and a file in it
	f.Add([]byte{3, 0, 0, 5, 'x', 'y', 'z', 'w', 'v', 'u', 0, 'l'})                                                           // a symlink
	f.Add([]byte{2, 0, 0, 0xed, 0x01, 0, 'd', 4, 0, 1, 0, 0, 0})                                                              // a hardlinked directory
	f.Add([]byte{2, 0, 0, 0xed, 0x01, 0, 'd', 4, 1, 0, 0, 0, 'u'})                                                            // a cycle to the root
	f.Add([]byte{0, 0, 0, 0xa4, 0x01, 0x10, 0, 0, 'a', 4, 0, 1, 0, 'b'})                                                      // a hardlinked file
	f.Add([]byte{5, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 'c'})                                                              // a device of any number
	f.Add([]byte{5, 0, 0, 1, 9, 0xff, 0x0f, 0xff, 0xff, 0x0f, 0, 0, 'c'})                                                     // the largest device
	f.Add([]byte{7, 0, 0, 0, 3, 'k', 'e', 'y', 's', 0xff, 0xff, 1})                                                           // an xattr of 65536 bytes
	f.Add([]byte{7, 0, 0, 0, 3, 'k', 'e', 'y', 's', 0xff, 0xff, 0})                                                           // an xattr of 65535 bytes
	f.Add([]byte{7, 0, 0, 3, 255, 28, 0})                                                                                     // an ACL on the root
	f.Add([]byte{7, 0, 0, 5, 3, 'a', 'b', 'c', 'd', 4, 0})                                                                    // an xattr EROFS cannot hold
	f.Add([]byte{11, 0, 0, 3, 200, 100})                                                                                      // a big directory
	f.Add([]byte{0, 0, 0, 0xa4, 0x01, 0x10, 0, 0, 'a', 10, 0, 1, 0, 0x30, 0x61, 0, 0})                                        // a file re-typed a block device, its size kept
	f.Add([]byte{10, 0, 0, 0, 0x80, 0x11, 0, 0})                                                                              // the root made a FIFO
	f.Add([]byte{2, 0, 0, 0xed, 0x01, 0, 'd', 11, 1, 0, 7, 250, 60, 7, 0, 1, 0, 5, 'a', 'b', 'c', 'd', 'e', 'f', 0x00, 0x10}) // a big directory with a big xattr
	rng := rand.New(rand.NewPCG(3, 4))
	for range 16 {
		b := make([]byte, 64+rng.IntN(256))
		for i := range b {
			b[i] = byte(rng.Uint32())
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m := fuzzTree(data)
		im, err := Build(context.Background(), m, Options{})
		if err != nil {
			return
		}
		if n := m.readCalls.Load(); n != 0 {
			t.Fatalf("Build made %d ReadAt calls", n)
		}
		raw := materialize(t, im)
		if err := checkLayout(raw, im.MetadataSize()); err != nil {
			t.Fatalf("layout: %v", err)
		}
		if err := goErofsDiff(m, im, expect(t, m)); err != nil {
			t.Fatal(err)
		}
	})
}
