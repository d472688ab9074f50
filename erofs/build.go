package erofs

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sort"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// maxBlocks is the most blocks an image may have: sb.blocks and every
// block address are 32-bit.
const maxBlocks = math.MaxUint32

// node is one inode of the tree while Build lays it out. Its fields are
// ordered by size, to pack it (88 bytes).
type node struct {
	ino   uint64 // the tree's inode number
	name  string // its name in parent
	size  int64  // file bytes; a directory's dirent bytes; a target's length
	mtime int64  // seconds since the epoch
	nid   uint64 // set by layout: byte offset / slotSize

	parent   int32 // the directory it was first found in (-1: the root)
	uid, gid uint32
	nlink    uint32
	rdev     uint32 // encoded (new_encode_dev), for devices
	nsec     uint32
	aux      int32  // a directory's index in builder.dirs, a symlink's in builder.links; else -1
	xattr    int32  // index in builder.xattrs; -1: none
	blk      uint32 // set by layout: first block of a file's data, of a directory's or symlink's full blocks

	mode   uint16 // type and permission bits
	inline bool   // set by layout: FLAT_INLINE, the tail (size % BlockSize) after the inode
}

// dent is one directory entry: "." and ".." included, sorted by name.
type dent struct {
	name string
	node int32 // index in builder.nodes
}

// builder holds Build's state.
type builder struct {
	ctx    context.Context
	fsys   rofs.FS
	nodes  []node
	byIno  map[uint64]int32
	dirs   [][]dent
	links  []string
	xattrs [][]byte // encoded inline xattr areas

	skipped     int // xattrs skipped for names EROFS cannot hold
	skippedPath string
	skippedName string

	metaBlocks  int64
	totalBlocks int64
}

// path is node i's path, from the names it was first found by.
func (b *builder) path(i int32) string {
	if i <= 0 {
		return "/"
	}
	var parts []string
	for ; i > 0; i = b.nodes[i].parent {
		parts = append(parts, b.nodes[i].name)
	}
	slices.Reverse(parts)
	return "/" + strings.Join(parts, "/")
}

// childPath is the path of name in directory dir.
func (b *builder) childPath(dir int32, name string) string {
	p := b.path(dir)
	if p != "/" {
		p += "/"
	}
	return p + name
}

// walk reads the tree breadth-first from the root: nodes gets the inodes
// in layout order (each directory's new children together, in name
// order), dirs their sorted entries.
func (b *builder) walk() error {
	if _, err := b.add(b.fsys.Root(), -1, ""); err != nil {
		return err
	}
	if b.nodes[0].mode&sIFMT != sIFDIR {
		return fmt.Errorf("erofs: root (inode %d) is not a directory (mode %#o)", b.nodes[0].ino, b.nodes[0].mode)
	}
	// nodes grows as directories are read: reading them in order is the
	// breadth-first walk.
	for i := 0; i < len(b.nodes); i++ {
		if b.nodes[i].mode&sIFMT != sIFDIR {
			continue
		}
		if err := b.ctx.Err(); err != nil {
			return err
		}
		if err := b.readDir(int32(i)); err != nil {
			return err
		}
	}
	return nil
}

// checkName reports what is wrong with a directory entry's name.
func checkName(name string) error {
	switch {
	case name == "":
		return errors.New("empty name")
	case name == "." || name == "..":
		return fmt.Errorf("entry named %q", name)
	case len(name) > maxNameLen:
		return fmt.Errorf("name is %d bytes, over %d", len(name), maxNameLen)
	case strings.IndexByte(name, '/') >= 0:
		return errors.New("name holds '/'")
	case strings.IndexByte(name, 0) >= 0:
		return errors.New("name holds NUL")
	}
	return nil
}

// readDir reads directory d's entries, adds the inodes not seen before
// and records its sorted entries, nlink and size.
func (b *builder) readDir(d int32) error {
	ents, err := b.fsys.ReadDir(b.nodes[d].ino)
	if err != nil {
		return fmt.Errorf("erofs: %s: reading directory: %w", b.path(d), err)
	}
	list := make([]dent, 0, len(ents)+2)
	for _, e := range ents {
		if err := checkName(e.Name); err != nil {
			return fmt.Errorf("erofs: %q in %s: %w", e.Name, b.path(d), err)
		}
		list = append(list, dent{name: e.Name})
	}
	// The kernel binary-searches a directory by name, bytewise: sort it.
	// ents keeps the tree's order (it may be the tree's own slice); sort
	// an index instead.
	order := make([]int32, len(ents))
	for i := range order {
		order[i] = int32(i)
	}
	slices.SortFunc(order, func(x, y int32) int { return strings.Compare(ents[x].Name, ents[y].Name) })
	for k := 1; k < len(order); k++ {
		if ents[order[k]].Name == ents[order[k-1]].Name {
			return fmt.Errorf("erofs: %s: two entries named %q", b.path(d), ents[order[k]].Name)
		}
	}
	subdirs := 0
	for k, i := range order {
		e := &ents[i]
		child, seen := b.byIno[e.Ino]
		if seen {
			c := &b.nodes[child]
			if c.mode&sIFMT == sIFDIR {
				return fmt.Errorf("erofs: %s: directory (inode %d) reached twice, also as %s: a cycle or a hardlinked directory",
					b.childPath(d, e.Name), e.Ino, b.path(child))
			}
			if c.nlink == math.MaxUint32 {
				return fmt.Errorf("erofs: %s: too many links to inode %d", b.childPath(d, e.Name), e.Ino)
			}
			c.nlink++
		} else {
			child, err = b.add(e.Ino, d, e.Name)
			if err != nil {
				return err
			}
			if b.nodes[child].mode&sIFMT == sIFDIR {
				subdirs++
			}
		}
		list[k] = dent{name: e.Name, node: child}
	}
	parent := b.nodes[d].parent
	if parent < 0 {
		parent = d // the root's ".." is itself
	}
	for _, s := range [...]dent{{".", d}, {"..", parent}} {
		at := sort.Search(len(list), func(i int) bool { return list[i].name > s.name })
		list = slices.Insert(list, at, s)
	}
	n := &b.nodes[d]
	n.nlink = uint32(2 + subdirs) // subdirs < len(ents), which fits memory
	n.size = packDir(list, nil)
	b.dirs[n.aux] = list
	return nil
}

// packDir splits a directory's sorted entries into blocks the way the
// kernel reads them: each block holds dirents, then their names, and no
// name crosses a block. It calls fn (if not nil) with block k's entries
// list[i:j] and the bytes they take, and returns the directory's i_size:
// whole blocks, then the last block up to the end of its last name.
func packDir(list []dent, fn func(k, i, j, used int)) int64 {
	var size int64
	for k, i := 0, 0; i < len(list); k++ {
		used, j := 0, i
		// A name is at most 255 bytes: every block takes at least one.
		for j < len(list) && used+direntSize+len(list[j].name) <= BlockSize {
			used += direntSize + len(list[j].name)
			j++
		}
		if fn != nil {
			fn(k, i, j, used)
		}
		if j == len(list) {
			size += int64(used)
		} else {
			size += BlockSize
		}
		i = j
	}
	return size
}

// add reads inode ino's attributes (and its symlink target and xattrs),
// found as name in directory parent, and appends it to nodes.
func (b *builder) add(ino uint64, parent int32, name string) (int32, error) {
	if len(b.nodes) >= math.MaxInt32 {
		return 0, fmt.Errorf("erofs: %s: too many inodes", b.childPath(parent, name))
	}
	path := func() string {
		if parent < 0 {
			return "/"
		}
		return b.childPath(parent, name)
	}
	attr, err := b.fsys.Getattr(ino)
	if err != nil {
		return 0, fmt.Errorf("erofs: %s: getattr inode %d: %w", path(), ino, err)
	}
	if attr.Mode&^(sIFMT|modeBits) != 0 {
		return 0, fmt.Errorf("erofs: %s: mode %#o has bits beyond the file type and permissions", path(), attr.Mode)
	}
	n := node{
		ino:    ino,
		parent: parent,
		name:   name,
		mode:   uint16(attr.Mode),
		uid:    attr.UID,
		gid:    attr.GID,
		nlink:  1,
		mtime:  attr.Mtime.Unix(),
		nsec:   uint32(attr.Mtime.Nanosecond()),
		aux:    -1,
		xattr:  -1,
	}
	switch attr.Mode & sIFMT {
	case sIFREG:
		if attr.Size < 0 {
			return 0, fmt.Errorf("erofs: %s: negative size %d", path(), attr.Size)
		}
		if attr.Size/BlockSize >= maxBlocks {
			return 0, fmt.Errorf("erofs: %s: size %d is too big for 32-bit block addresses", path(), attr.Size)
		}
		n.size = attr.Size
	case sIFDIR:
		n.aux = int32(len(b.dirs))
		b.dirs = append(b.dirs, nil) // filled by readDir
	case sIFLNK:
		target, err := b.fsys.Readlink(ino)
		if err != nil {
			return 0, fmt.Errorf("erofs: %s: readlink: %w", path(), err)
		}
		switch {
		case target == "":
			return 0, fmt.Errorf("erofs: %s: empty symlink target", path())
		case len(target) > maxLinkLen:
			return 0, fmt.Errorf("erofs: %s: symlink target is %d bytes, over %d", path(), len(target), maxLinkLen)
		case strings.IndexByte(target, 0) >= 0:
			return 0, fmt.Errorf("erofs: %s: symlink target holds NUL", path())
		}
		n.aux = int32(len(b.links))
		b.links = append(b.links, target)
		n.size = int64(len(target))
	case sIFCHR, sIFBLK:
		major, minor := unix.Major(attr.Rdev), unix.Minor(attr.Rdev)
		if major >= 1<<12 || minor >= 1<<20 {
			return 0, fmt.Errorf("erofs: %s: device %d:%d does not fit 32 bits (12-bit major, 20-bit minor)", path(), major, minor)
		}
		n.rdev = encodeDev(major, minor)
	case sIFIFO, sIFSOCK:
		// Nothing: i_u is 0. Special files get size 0 whatever the tree says.
	default:
		return 0, fmt.Errorf("erofs: %s: unsupported file type (mode %#o)", path(), attr.Mode)
	}
	xa, err := b.encodeXattrs(ino, path)
	if err != nil {
		return 0, err
	}
	if xa != nil {
		n.xattr = int32(len(b.xattrs))
		b.xattrs = append(b.xattrs, xa)
	}
	i := int32(len(b.nodes))
	b.nodes = append(b.nodes, n)
	b.byIno[ino] = i
	return i, nil
}

// splitXattr splits an xattr name into its EROFS name index and the rest,
// or reports that EROFS cannot hold it: its prefix is none of the indexed
// ones (user., trusted., security., the two POSIX ACLs), the rest is
// empty, or it is not a name Linux could hand over (over 255 bytes, NUL).
func splitXattr(name string) (index uint8, rest string, ok bool) {
	if len(name) > maxXattrName || strings.IndexByte(name, 0) >= 0 {
		return 0, "", false
	}
	switch name {
	case "system.posix_acl_access":
		return xattrIndexACLAccess, "", true
	case "system.posix_acl_default":
		return xattrIndexACLDefault, "", true
	}
	for _, p := range [...]struct {
		prefix string
		index  uint8
	}{{"user.", xattrIndexUser}, {"trusted.", xattrIndexTrusted}, {"security.", xattrIndexSecurity}} {
		if rest, ok := strings.CutPrefix(name, p.prefix); ok && rest != "" {
			return p.index, rest, true
		}
	}
	return 0, "", false
}

// encodeXattrs reads ino's extended attributes and encodes them as an
// inline xattr area (nil when it has none EROFS can hold): the ibody
// header, then the entries sorted by name, each padded to 4 bytes.
func (b *builder) encodeXattrs(ino uint64, path func() string) ([]byte, error) {
	names, err := b.fsys.Listxattr(ino)
	if err != nil {
		return nil, fmt.Errorf("erofs: %s: listxattr: %w", path(), err)
	}
	if len(names) == 0 {
		return nil, nil
	}
	type xattr struct {
		name  string
		index uint8
		rest  string
		value []byte
	}
	list := make([]xattr, 0, len(names))
	for _, name := range names {
		index, rest, ok := splitXattr(name)
		if !ok {
			if b.skipped == 0 {
				b.skippedPath, b.skippedName = path(), name
			}
			b.skipped++
			continue
		}
		value, err := b.fsys.Getxattr(ino, name)
		if err != nil {
			return nil, fmt.Errorf("erofs: %s: getxattr %q: %w", path(), name, err)
		}
		if len(value) > maxXattrValue {
			return nil, fmt.Errorf("erofs: %s: xattr %q value is %d bytes, over %d", path(), name, len(value), maxXattrValue)
		}
		list = append(list, xattr{name, index, rest, value})
	}
	if len(list) == 0 {
		return nil, nil
	}
	slices.SortFunc(list, func(x, y xattr) int { return strings.Compare(x.name, y.name) })
	size := int64(xattrHeaderSize)
	for i := range list {
		if i > 0 && list[i].name == list[i-1].name {
			return nil, fmt.Errorf("erofs: %s: xattr %q listed twice", path(), list[i].name)
		}
		size += alignUp(int64(xattrEntrySize+len(list[i].rest)+len(list[i].value)), 4)
	}
	if size > maxXattrArea {
		return nil, fmt.Errorf("erofs: %s: xattrs take %d bytes, over the %d an inode can hold", path(), size, maxXattrArea)
	}
	buf := make([]byte, size) // the header is all zeros: no shared xattrs
	off := xattrHeaderSize
	for _, x := range list {
		buf[off] = uint8(len(x.rest))
		buf[off+1] = x.index
		buf[off+2] = uint8(len(x.value))
		buf[off+3] = uint8(len(x.value) >> 8)
		off += xattrEntrySize
		off += copy(buf[off:], x.rest)
		off += copy(buf[off:], x.value)
		off = int(alignUp(int64(off), 4))
	}
	return buf, nil
}

// layout places every inode (assigning nids), then directories' and
// symlinks' full blocks after the inodes, then regular files' data.
func (b *builder) layout() error {
	pos := int64(superOffset + superSize)
	for i := range b.nodes {
		n := &b.nodes[i]
		need := int64(inodeSize)
		if n.xattr >= 0 {
			need += int64(len(b.xattrs[n.xattr]))
		}
		if t := n.mode & sIFMT; t == sIFDIR || t == sIFLNK {
			// The tail goes inline when the inode, its xattrs and the
			// tail fit one block: the kernel refuses inline data that
			// crosses a block boundary. A size that is a multiple of
			// the block size has no tail to inline (the kernel would
			// take its last whole block as the tail).
			if tail := n.size % BlockSize; tail != 0 && need+tail <= BlockSize {
				n.inline = true
				need += tail
			}
		}
		// Keep an inode (with its xattrs and tail) within one block
		// when it fits one; else start it on a block.
		if need > BlockSize || pos%BlockSize+need > BlockSize {
			pos = alignUp(pos, BlockSize)
		}
		n.nid = uint64(pos / slotSize)
		pos = alignUp(pos+need, slotSize)
	}
	if b.nodes[0].nid > math.MaxUint16 {
		return errors.New("erofs: root nid does not fit 16 bits") // unreachable: the root comes first
	}
	blk := blocksOf(pos)
	for i := range b.nodes {
		n := &b.nodes[i]
		if t := n.mode & sIFMT; t != sIFDIR && t != sIFLNK {
			continue
		}
		full := blocksOf(n.size)
		if n.inline {
			full = n.size / BlockSize
		}
		if full == 0 {
			continue
		}
		if blk+full > maxBlocks {
			return fmt.Errorf("erofs: %s: image over %d blocks", b.path(int32(i)), int64(maxBlocks))
		}
		n.blk = uint32(blk)
		blk += full
	}
	b.metaBlocks = blk
	for i := range b.nodes {
		n := &b.nodes[i]
		if n.mode&sIFMT != sIFREG || n.size == 0 {
			continue
		}
		full := blocksOf(n.size)
		if blk+full > maxBlocks {
			return fmt.Errorf("erofs: %s: image over %d blocks", b.path(int32(i)), int64(maxBlocks))
		}
		n.blk = uint32(blk)
		blk += full
	}
	b.totalBlocks = blk
	return nil
}

// serialize writes the metadata region and the extent table.
func (b *builder) serialize(opts Options) *Image {
	meta := make([]byte, b.metaBlocks*BlockSize)
	root := &b.nodes[0]
	putSuper(meta[superOffset:superOffset+superSize], &superblock{
		rootNid:    uint16(root.nid),
		inos:       uint64(len(b.nodes)),
		buildTime:  uint64(root.mtime),
		buildNsec:  root.nsec,
		blocks:     uint32(b.totalBlocks),
		uuid:       opts.UUID,
		volumeName: opts.VolumeName,
	})
	var scratch [BlockSize]byte
	files := 0
	for i := range b.nodes {
		n := &b.nodes[i]
		off := int64(n.nid) * slotSize
		var xa []byte
		if n.xattr >= 0 {
			xa = b.xattrs[n.xattr]
		}
		layout := uint16(layoutFlatPlain)
		if n.inline {
			layout = layoutFlatInline
		}
		in := inode{
			format:     formatExtended | layout<<1,
			xattrCount: xattrCount(len(xa)),
			mode:       n.mode,
			size:       uint64(n.size),
			ino:        uint32(i + 1),
			uid:        n.uid,
			gid:        n.gid,
			mtime:      uint64(n.mtime),
			mtimeNsec:  n.nsec,
			nlink:      n.nlink,
		}
		switch n.mode & sIFMT {
		case sIFREG:
			in.u = n.blk
			if n.size > 0 {
				files++
			}
		case sIFDIR, sIFLNK:
			in.u = n.blk
		case sIFCHR, sIFBLK:
			in.u = n.rdev
		}
		putInode(meta[off:off+inodeSize], &in)
		tailAt := off + inodeSize + int64(copy(meta[off+inodeSize:], xa))
		switch n.mode & sIFMT {
		case sIFDIR:
			list := b.dirs[n.aux]
			full := int(n.size / BlockSize)
			packDir(list, func(k, i, j, used int) {
				var blk []byte
				if k < full || !n.inline {
					at := (int64(n.blk) + int64(k)) * BlockSize
					blk = meta[at : at+BlockSize]
				} else {
					blk = scratch[:]
					clear(blk)
				}
				nameoff := direntSize * (j - i)
				for e := i; e < j; e++ {
					c := &b.nodes[list[e].node]
					putDirent(blk[direntSize*(e-i):], c.nid, uint16(nameoff), fileType(c.mode))
					nameoff += copy(blk[nameoff:], list[e].name)
				}
				if k >= full && n.inline {
					copy(meta[tailAt:], blk[:used])
				}
			})
		case sIFLNK:
			target := b.links[n.aux]
			if n.inline {
				copy(meta[tailAt:], target)
			} else {
				copy(meta[int64(n.blk)*BlockSize:], target)
			}
		}
	}
	im := &Image{
		fsys:   b.fsys,
		meta:   meta,
		blocks: b.totalBlocks,
		inodes: len(b.nodes),
		starts: make([]uint32, 0, files),
		inos:   make([]uint64, 0, files),
		sizes:  make([]int64, 0, files),
	}
	for i := range b.nodes {
		n := &b.nodes[i]
		if n.mode&sIFMT == sIFREG && n.size > 0 {
			im.starts = append(im.starts, n.blk)
			im.inos = append(im.inos, n.ino)
			im.sizes = append(im.sizes, n.size)
		}
	}
	return im
}
