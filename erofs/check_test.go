package erofs

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"path"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	goerofs "github.com/erofs/go-erofs"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/stmode"
)

// want is what the image must show at one path, from the source tree.
type want struct {
	ino    uint64 // the source inode (hardlinks share it)
	mode   uint32 // type and permission bits
	uid    uint32
	gid    uint32
	nlink  uint32
	size   int64
	rdev   uint64
	mtime  time.Time
	target string
	xattrs map[string]string // those EROFS can hold
	node   *memNode
}

// expect lists what the image of m must hold, by path ("" is the root):
// nlink as the image counts it (2 + subdirectories for a directory, the
// number of names for anything else), the xattrs EROFS can hold.
func expect(t testing.TB, m *memFS) map[string]*want {
	t.Helper()
	out := map[string]*want{}
	names := map[uint64]uint32{}
	var walk func(p string, ino uint64)
	walk = func(p string, ino uint64) {
		n := m.nodes[ino]
		names[ino]++
		w := &want{
			ino: ino, mode: n.attr.Mode, uid: n.attr.UID, gid: n.attr.GID,
			size: n.attr.Size, mtime: n.attr.Mtime, target: n.target, node: n,
			xattrs: map[string]string{},
		}
		if t := n.attr.Mode & syscall.S_IFMT; t == syscall.S_IFCHR || t == syscall.S_IFBLK {
			w.rdev = n.attr.Rdev
		}
		switch n.attr.Mode & syscall.S_IFMT {
		case syscall.S_IFREG, syscall.S_IFDIR:
		case syscall.S_IFLNK:
			w.size = int64(len(n.target))
		default:
			w.size = 0 // a device's, FIFO's or socket's size means nothing
		}
		for _, name := range n.xorder {
			if _, _, ok := splitXattr(name); ok {
				w.xattrs[name] = string(n.xattrs[name])
			}
		}
		out[p] = w
		if n.attr.Mode&syscall.S_IFMT != syscall.S_IFDIR {
			return
		}
		w.nlink = 2
		for _, k := range n.kids {
			if m.nodes[k.Ino].attr.Mode&syscall.S_IFMT == syscall.S_IFDIR {
				w.nlink++
			}
			walk(path.Join(p, k.Name), k.Ino)
		}
	}
	walk("", m.Root())
	for _, w := range out {
		if w.mode&syscall.S_IFMT != syscall.S_IFDIR {
			w.nlink = names[w.ino]
		}
	}
	return out
}

// readerAt adapts an Image to io.ReaderAt.
type readerAt struct{ im *Image }

func (r readerAt) ReadAt(p []byte, off int64) (int, error) {
	return r.im.ReadAt(context.Background(), p, off)
}

// materialize reads the whole image, a block at a time.
func materialize(t testing.TB, im *Image) []byte {
	t.Helper()
	out := make([]byte, im.Size())
	for off := int64(0); off < im.Size(); off += BlockSize {
		n, err := im.ReadAt(context.Background(), out[off:off+BlockSize], off)
		if err != nil || n != BlockSize {
			t.Fatalf("ReadAt(block at %d) = %d, %v", off, n, err)
		}
	}
	return out
}

// decodeDev is Linux's new_decode_dev.
func decodeDev(d uint32) uint64 {
	major := (d & 0xfff00) >> 8
	minor := d&0xff | (d>>12)&0xfff00
	return unix.Mkdev(major, minor)
}

// compareGoErofs opens the image with go-erofs (an independent reader) and
// checks every path of the source tree against it: names (both ways),
// modes, owners, sizes, nlink, mtimes, rdev, link targets, xattrs and
// contents.
func compareGoErofs(t testing.TB, m *memFS, im *Image) {
	t.Helper()
	if err := goErofsDiff(m, im, expect(t, m)); err != nil {
		t.Fatal(err)
	}
}

// goErofsDiff is compareGoErofs's check, returning the first difference.
func goErofsDiff(m *memFS, im *Image, wants map[string]*want) error {
	img, err := goerofs.Open(readerAt{im})
	if err != nil {
		return fmt.Errorf("go-erofs: open: %w", err)
	}
	seen := map[string]bool{}
	nids := map[uint64]int64{} // source ino -> image ino (nid)
	err = fs.WalkDir(img, ".", func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("go-erofs: walk %s: %w", p, err)
		}
		key := p
		if p == "." {
			key = ""
		}
		seen[key] = true
		w, ok := wants[key]
		if !ok {
			return fmt.Errorf("image has %q, the tree does not", p)
		}
		fi, err := img.(fs.ReadLinkFS).Lstat(p)
		if err != nil {
			return fmt.Errorf("go-erofs: lstat %s: %w", p, err)
		}
		st, ok := fi.Sys().(*goerofs.Stat)
		if !ok {
			return fmt.Errorf("%s: Sys() is %T", p, fi.Sys())
		}
		if got, want := st.Mode, stmode.FileMode(w.mode); got != want {
			return fmt.Errorf("%s: mode %v, want %v", p, got, want)
		}
		if fi.Mode().Type() != st.Mode.Type() || (p != "." && d.Type() != st.Mode.Type()) {
			return fmt.Errorf("%s: dirent type %v, lstat %v, inode %v", p, d.Type(), fi.Mode().Type(), st.Mode.Type())
		}
		if st.UID != w.uid || st.GID != w.gid {
			return fmt.Errorf("%s: owner %d:%d, want %d:%d", p, st.UID, st.GID, w.uid, w.gid)
		}
		// A directory's size is its dirent bytes, which checkLayout
		// checks; the tree's own directory sizes mean nothing here.
		if w.mode&syscall.S_IFMT != syscall.S_IFDIR && st.Size != w.size {
			return fmt.Errorf("%s: size %d, want %d", p, st.Size, w.size)
		}
		if uint32(st.Nlink) != w.nlink {
			return fmt.Errorf("%s: nlink %d, want %d", p, st.Nlink, w.nlink)
		}
		if got := time.Unix(int64(st.Mtime), int64(st.MtimeNs)); !got.Equal(w.mtime) {
			return fmt.Errorf("%s: mtime %v, want %v", p, got, w.mtime)
		}
		if prev, ok := nids[w.ino]; ok && prev != st.Ino {
			return fmt.Errorf("%s: hardlinked inode %d has nids %d and %d", p, w.ino, prev, st.Ino)
		}
		nids[w.ino] = st.Ino
		if t := w.mode & syscall.S_IFMT; t == syscall.S_IFCHR || t == syscall.S_IFBLK {
			if got := decodeDev(st.Rdev); got != w.rdev {
				return fmt.Errorf("%s: rdev %#x, want %#x", p, got, w.rdev)
			}
		} else if st.Rdev != 0 && t != syscall.S_IFREG && t != syscall.S_IFDIR && t != syscall.S_IFLNK {
			return fmt.Errorf("%s: rdev %#x on a %#o", p, st.Rdev, t)
		}
		got := map[string]string{}
		for k, v := range st.Xattrs {
			// go-erofs names the POSIX ACLs with a trailing dot.
			if k == "system.posix_acl_access." || k == "system.posix_acl_default." {
				k = strings.TrimSuffix(k, ".")
			}
			got[k] = v
		}
		if !maps.Equal(got, w.xattrs) {
			return fmt.Errorf("%s: xattrs %q, want %q", p, got, w.xattrs)
		}
		switch w.mode & syscall.S_IFMT {
		case syscall.S_IFLNK:
			target, err := img.(fs.ReadLinkFS).ReadLink(p)
			if err != nil {
				return fmt.Errorf("go-erofs: readlink %s: %w", p, err)
			}
			if target != w.target {
				return fmt.Errorf("%s: target %q, want %q", p, target, w.target)
			}
		case syscall.S_IFREG:
			f, err := img.Open(p)
			if err != nil {
				return fmt.Errorf("go-erofs: open %s: %w", p, err)
			}
			data, err := io.ReadAll(f)
			f.Close()
			if err != nil {
				return fmt.Errorf("go-erofs: read %s: %w", p, err)
			}
			if !bytes.Equal(data, w.node.content()) {
				return fmt.Errorf("%s: contents differ (%d bytes, want %d)", p, len(data), w.size)
			}
		case syscall.S_IFDIR:
			// A lookup of every name through go-erofs's binary search
			// (WalkDir only lists).
			ents, err := img.(fs.ReadDirFS).ReadDir(p)
			if err != nil {
				return fmt.Errorf("go-erofs: readdir %s: %w", p, err)
			}
			for _, e := range ents {
				if _, err := img.(fs.ReadLinkFS).Lstat(path.Join(p, e.Name())); err != nil {
					return fmt.Errorf("go-erofs: lookup %s in %s: %w", e.Name(), p, err)
				}
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	for _, p := range slices.Sorted(maps.Keys(wants)) {
		if !seen[p] {
			return fmt.Errorf("image lacks %q", p)
		}
	}
	return nil
}

// rawInode is an inode as checkLayout decodes it.
type rawInode struct {
	nid      uint64
	format   uint16
	layout   int
	mode     uint16
	size     uint64
	u        uint32
	nlink    uint32
	xsize    int
	dataOff  int64 // where an inline tail starts
	children int   // subdirectories, for a directory
}

// checkLayout decodes the image itself and checks the rules Linux 6.1's
// erofs driver holds an image to, which fsck.erofs does not all check:
// the superblock; extended inodes of a known layout, not crossing a
// block; inline tails (inode, xattrs and tail) within one block and never
// a whole block; xattr areas (never a bare header, entries filling them
// exactly); directory blocks (nameoff of the first dirent a multiple of
// 12 in [12, 4096), names increasing, non-empty, no NUL, ending where the
// kernel finds their end), names sorted across the whole directory, "."
// and ".." present and right, dirent file types matching the inodes,
// directories' nlink; block addresses inside the right region.
func checkLayout(img []byte, metaSize int64) error {
	le := binary.LittleEndian
	if len(img)%BlockSize != 0 || len(img) < BlockSize {
		return fmt.Errorf("image is %d bytes", len(img))
	}
	sb := img[superOffset : superOffset+superSize]
	if le.Uint32(sb) != superMagic || sb[12] != blockBits || sb[13] != 0 {
		return fmt.Errorf("bad superblock % x", sb[:16])
	}
	if le.Uint32(sb[4:]) != 0 || le.Uint32(sb[8:]) != 0 || le.Uint32(sb[80:]) != 0 {
		return fmt.Errorf("checksum, feature_compat or feature_incompat set")
	}
	if le.Uint32(sb[40:]) != 0 || le.Uint32(sb[44:]) != 0 {
		return fmt.Errorf("meta_blkaddr or xattr_blkaddr set")
	}
	if int64(le.Uint32(sb[36:]))*BlockSize != int64(len(img)) {
		return fmt.Errorf("sb.blocks %d, image %d bytes", le.Uint32(sb[36:]), len(img))
	}
	if bytes.IndexByte(sb[64:80], 0) < 0 {
		return fmt.Errorf("volume name without NUL")
	}
	inos := le.Uint64(sb[16:])
	rootNid := uint64(le.Uint16(sb[14:]))

	inodes := map[uint64]*rawInode{}
	readInode := func(nid uint64) (*rawInode, error) {
		if in, ok := inodes[nid]; ok {
			return in, nil
		}
		off := int64(nid) * slotSize
		if off < superOffset+superSize || off+inodeSize > metaSize {
			return nil, fmt.Errorf("nid %d outside the inode area", nid)
		}
		if off/BlockSize != (off+inodeSize-1)/BlockSize {
			return nil, fmt.Errorf("nid %d: inode crosses a block", nid)
		}
		b := img[off : off+inodeSize]
		in := &rawInode{nid: nid, format: le.Uint16(b), mode: le.Uint16(b[4:]), size: le.Uint64(b[8:]), u: le.Uint32(b[16:]), nlink: le.Uint32(b[44:])}
		if in.format&1 != 1 || in.format&^0xF != 0 {
			return nil, fmt.Errorf("nid %d: i_format %#x", nid, in.format)
		}
		in.layout = int(in.format >> 1)
		if in.layout != layoutFlatPlain && in.layout != layoutFlatInline {
			return nil, fmt.Errorf("nid %d: layout %d", nid, in.layout)
		}
		if !bytes.Equal(b[48:64], make([]byte, 16)) || le.Uint16(b[6:]) != 0 {
			return nil, fmt.Errorf("nid %d: reserved bytes set", nid)
		}
		if icount := int(le.Uint16(b[2:])); icount > 0 {
			if icount == 1 {
				return nil, fmt.Errorf("nid %d: i_xattr_icount 1 (a bare header: the kernel refuses it)", nid)
			}
			in.xsize = xattrHeaderSize + 4*(icount-1)
			xa := img[off+inodeSize : off+inodeSize+int64(in.xsize)]
			if !bytes.Equal(xa[:xattrHeaderSize], make([]byte, xattrHeaderSize)) {
				return nil, fmt.Errorf("nid %d: xattr header % x", nid, xa[:xattrHeaderSize])
			}
			for p := xattrHeaderSize; p < len(xa); {
				if p+4 > len(xa) {
					return nil, fmt.Errorf("nid %d: xattr entry header past the area", nid)
				}
				nl, idx, vl := int(xa[p]), xa[p+1], int(le.Uint16(xa[p+2:]))
				switch idx {
				case xattrIndexUser, xattrIndexTrusted, xattrIndexSecurity:
					if nl == 0 {
						return nil, fmt.Errorf("nid %d: empty xattr name", nid)
					}
				case xattrIndexACLAccess, xattrIndexACLDefault:
					if nl != 0 {
						return nil, fmt.Errorf("nid %d: ACL xattr with a name", nid)
					}
				default:
					return nil, fmt.Errorf("nid %d: xattr index %d", nid, idx)
				}
				p += int(alignUp(int64(4+nl+vl), 4))
				if p > len(xa) {
					return nil, fmt.Errorf("nid %d: xattr entry past the area", nid)
				}
			}
		}
		in.dataOff = off + inodeSize + int64(in.xsize)
		typ := in.mode & sIFMT
		if in.layout == layoutFlatInline {
			if typ != sIFDIR && typ != sIFLNK {
				return nil, fmt.Errorf("nid %d: inline layout for mode %#o", nid, in.mode)
			}
			tail := int64(in.size % BlockSize)
			if tail == 0 {
				return nil, fmt.Errorf("nid %d: inline layout with size %d (the kernel would inline a whole block)", nid, in.size)
			}
			if in.dataOff%BlockSize+tail > BlockSize {
				return nil, fmt.Errorf("nid %d: inline tail crosses a block", nid)
			}
			// Linux 6.1's fast symlink: the end of the inode core,
			// plus the xattrs, plus the target, within the core's block.
			if typ == sIFLNK && (off%BlockSize)+inodeSize+int64(in.xsize)+tail > BlockSize {
				return nil, fmt.Errorf("nid %d: fast symlink target leaves the inode's block", nid)
			}
		}
		full := int64(in.size / BlockSize)
		if in.layout == layoutFlatPlain && in.size%BlockSize != 0 {
			full++
		}
		if typ == sIFDIR || typ == sIFLNK || typ == sIFREG {
			if full > 0 {
				start, end := int64(in.u)*BlockSize, (int64(in.u)+full)*BlockSize
				if typ == sIFREG && (start < metaSize || end > int64(len(img))) {
					return nil, fmt.Errorf("nid %d: data blocks [%d,%d) outside the data region", nid, in.u, int64(in.u)+full)
				}
				if typ != sIFREG && (start < BlockSize || end > metaSize) {
					return nil, fmt.Errorf("nid %d: blocks [%d,%d) outside the metadata", nid, in.u, int64(in.u)+full)
				}
			}
		}
		if typ == sIFIFO || typ == sIFSOCK {
			if in.u != 0 {
				return nil, fmt.Errorf("nid %d: fifo/socket with i_u %#x", nid, in.u)
			}
		}
		inodes[nid] = in
		return in, nil
	}
	// content returns a directory's or symlink's bytes.
	content := func(in *rawInode) []byte {
		out := make([]byte, 0, in.size)
		full := int64(in.size / BlockSize)
		if in.layout == layoutFlatPlain {
			start := int64(in.u) * BlockSize
			return append(out, img[start:start+int64(in.size)]...)
		}
		start := int64(in.u) * BlockSize
		out = append(out, img[start:start+full*BlockSize]...)
		return append(out, img[in.dataOff:in.dataOff+int64(in.size%BlockSize)]...)
	}
	root, err := readInode(rootNid)
	if err != nil {
		return err
	}
	if root.mode&sIFMT != sIFDIR {
		return fmt.Errorf("root nid %d is not a directory", rootNid)
	}
	type item struct{ nid, parent uint64 }
	queue := []item{{rootNid, rootNid}}
	visited := map[uint64]bool{rootNid: true}
	for len(queue) > 0 {
		it := queue[0]
		queue = queue[1:]
		dir, _ := readInode(it.nid)
		data := content(dir)
		var names []string
		subdirs := 0
		for pos := 0; pos < len(data); pos += BlockSize {
			blk := data[pos:min(pos+BlockSize, len(data))]
			maxsize := len(blk)
			if len(blk) < direntSize {
				return fmt.Errorf("dir nid %d: block at %d is %d bytes", it.nid, pos, len(blk))
			}
			nameoff0 := int(le.Uint16(blk[8:]))
			if nameoff0 < direntSize || nameoff0 >= BlockSize || nameoff0%direntSize != 0 || nameoff0 > maxsize {
				return fmt.Errorf("dir nid %d: block at %d: first nameoff %d", it.nid, pos, nameoff0)
			}
			count := nameoff0 / direntSize
			for i := 0; i < count; i++ {
				de := blk[i*direntSize:]
				nid, nameoff, ft := le.Uint64(de), int(le.Uint16(de[8:])), de[10]
				var end int
				if i+1 < count {
					end = int(le.Uint16(de[direntSize+8:]))
				} else {
					// The kernel: strnlen(name, maxsize - nameoff).
					end = maxsize
					if z := bytes.IndexByte(blk[nameoff:maxsize], 0); z >= 0 {
						end = nameoff + z
					}
					if pos+BlockSize < len(data) && end < BlockSize && blk[end] != 0 {
						return fmt.Errorf("dir nid %d: last name of block at %d not NUL-terminated", it.nid, pos)
					}
				}
				if nameoff < nameoff0 || end <= nameoff || end > maxsize || end-nameoff > maxNameLen {
					return fmt.Errorf("dir nid %d: dirent %d of block at %d: name [%d,%d)", it.nid, i, pos, nameoff, end)
				}
				name := string(blk[nameoff:end])
				if strings.IndexByte(name, 0) >= 0 || strings.IndexByte(name, '/') >= 0 {
					return fmt.Errorf("dir nid %d: name %q", it.nid, name)
				}
				if len(names) > 0 && names[len(names)-1] >= name {
					return fmt.Errorf("dir nid %d: %q after %q: not sorted", it.nid, name, names[len(names)-1])
				}
				names = append(names, name)
				child, err := readInode(nid)
				if err != nil {
					return fmt.Errorf("dir nid %d, %q: %w", it.nid, name, err)
				}
				if ft != fileType(child.mode) {
					return fmt.Errorf("dir nid %d, %q: file type %d, inode mode %#o", it.nid, name, ft, child.mode)
				}
				switch name {
				case ".":
					if nid != it.nid {
						return fmt.Errorf("dir nid %d: \".\" is nid %d", it.nid, nid)
					}
				case "..":
					if nid != it.parent {
						return fmt.Errorf("dir nid %d: \"..\" is nid %d, want %d", it.nid, nid, it.parent)
					}
				default:
					if child.mode&sIFMT == sIFDIR {
						subdirs++
						if visited[nid] {
							return fmt.Errorf("dir nid %d reached twice", nid)
						}
						visited[nid] = true
						queue = append(queue, item{nid, it.nid})
					}
				}
			}
		}
		if !slices.Contains(names, ".") || !slices.Contains(names, "..") {
			return fmt.Errorf("dir nid %d lacks \".\" or \"..\"", it.nid)
		}
		if dir.nlink != uint32(2+subdirs) {
			return fmt.Errorf("dir nid %d: nlink %d, %d subdirectories", it.nid, dir.nlink, subdirs)
		}
	}
	if uint64(len(inodes)) != inos {
		return fmt.Errorf("sb.inos %d, %d inodes reachable", inos, len(inodes))
	}
	for _, in := range inodes {
		if in.mode&sIFMT == sIFLNK {
			target := content(in)
			if len(target) == 0 || bytes.IndexByte(target, 0) >= 0 {
				return fmt.Errorf("symlink nid %d: target %q", in.nid, target)
			}
		}
	}
	return nil
}

// buildOK builds m's image and runs the checks that need no tool: the raw
// layout rules and go-erofs's walk.
func buildOK(t testing.TB, m *memFS, opts Options) (*Image, []byte) {
	t.Helper()
	im, err := Build(context.Background(), m, opts)
	if err != nil {
		t.Fatalf("Build: %v", err)
	}
	raw := materialize(t, im)
	if err := checkLayout(raw, im.MetadataSize()); err != nil {
		t.Fatalf("layout: %v", err)
	}
	compareGoErofs(t, m, im)
	return im, raw
}
