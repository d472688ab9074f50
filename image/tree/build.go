package tree

import (
	_ "crypto/sha256" // digest.Parse checks that sha256 is available
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"

	"github.com/kilnvm/kiln/rofs"
)

// BuildError is a bad layer or TOC entry that Build refused.
type BuildError struct {
	Tree  string // Options.Name
	Layer int    // index in Build's layers, bottom first
	Entry int    // index in the layer's TOC entries; -1 for the layer as a whole
	Name  string // the entry's name as the TOC has it
	Err   error
}

func (e *BuildError) Error() string {
	var b strings.Builder
	b.WriteString("tree: ")
	if e.Tree != "" {
		b.WriteString(e.Tree)
		b.WriteString(": ")
	}
	fmt.Fprintf(&b, "layer %d", e.Layer)
	if e.Entry >= 0 {
		name := e.Name
		if len(name) > 128 {
			name = name[:128] + "..."
		}
		fmt.Fprintf(&b, ", entry %d %q", e.Entry, name)
	}
	b.WriteString(": ")
	b.WriteString(e.Err.Error())
	return b.String()
}

func (e *BuildError) Unwrap() error { return e.Err }

// Build merges layers, bottom first, into a tree, as the OCI image-spec
// applies layers:
//
//   - An entry replaces a lower layer's entry of the same path, except that
//     a directory over a directory merges them (attributes from the upper).
//     A non-directory over a directory drops its subtree.
//   - ".wh.NAME" removes NAME, and its subtree, from lower layers;
//     ".wh..wh..opq" hides everything lower layers had in its directory;
//     other ".wh..wh." names (AUFS metadata) are ignored. Whiteouts apply
//     to lower layers only and never appear in the tree.
//   - Parent directories a layer does not list are made (0755, owned by
//     root, mtime the Unix epoch), replacing a lower non-directory.
//   - A "hardlink" entry names the same file as its target (LinkName), in
//     the same layer or a lower one, looked up once the layer's other
//     entries are in place, so their order in the TOC does not matter.
//   - estargz's prefetch landmarks at the root are not part of the tree.
//
// Every entry is checked (names, types, chunk layout, owners, devices,
// times, xattrs, chunk digests); bad input gives a *BuildError naming the
// layer and entry. Build neither modifies nor copies the TOCs: the tree
// keeps their entries (and slices of their Entries) and passes them to the
// ChunkReaders, so the TOCs must not change while the tree is in use.
//
// Inode numbers follow the merged tree's paths sorted element by element
// (a depth-first walk, each directory's entries by name), the root 1; a
// file with hardlinks takes the number of its first path.
func Build(layers []Layer, opts Options) (*Tree, error) {
	start := time.Now()
	b := &builder{name: opts.Name, root: newDir()}
	entries := 0
	for i, l := range layers {
		if err := b.addLayer(i, l); err != nil {
			return nil, err
		}
		entries += len(l.TOC.Entries)
	}
	t := b.finish(layers)
	if opts.Logger != nil {
		opts.Logger.Debug("image tree built", "tree", opts.Name, "layers", len(layers),
			"entries", entries, "inodes", len(t.inodes), "ignored", b.ignored,
			"took", time.Since(start))
	}
	return t, nil
}

// bnode is a file while the tree is built.
type bnode struct {
	mode     uint32 // S_IF* | permission bits
	uid, gid uint32
	rdev     uint64
	size     int64
	mtime    time.Time
	link     string
	xattrs   []xattr
	layer    int32
	chunks   []*estargz.TOCEntry
	children map[string]*bnode // directories

	ino   uint64 // set by finish
	nlink uint32
}

func (n *bnode) isDir() bool { return n.mode&syscall.S_IFMT == syscall.S_IFDIR }

var epoch = time.Unix(0, 0).UTC()

func newDir() *bnode {
	return &bnode{mode: syscall.S_IFDIR | 0o755, mtime: epoch, children: map[string]*bnode{}}
}

type builder struct {
	name    string
	root    *bnode
	ignored int // entries not part of the tree: landmarks, AUFS metadata
}

func (b *builder) errorf(layer, entry int, name string, format string, args ...any) error {
	return &BuildError{Tree: b.name, Layer: layer, Entry: entry, Name: name, Err: fmt.Errorf(format, args...)}
}

// lookup returns the node at clean path name, following no symlinks, or
// nil.
func (b *builder) lookup(name string) *bnode {
	n := b.root
	for rest := name; rest != ""; {
		var elem string
		elem, rest, _ = strings.Cut(rest, "/")
		if !n.isDir() {
			return nil
		}
		if n = n.children[elem]; n == nil {
			return nil
		}
	}
	return n
}

// mkdirAll returns the directory at clean path dir, making it and its
// parents where they are missing or not directories.
func (b *builder) mkdirAll(dir string) *bnode {
	d := b.root
	for rest := dir; rest != ""; {
		var elem string
		elem, rest, _ = strings.Cut(rest, "/")
		c := d.children[elem]
		if c == nil || !c.isDir() {
			c = newDir()
			d.children[elem] = c
		}
		d = c
	}
	return d
}

// place puts n at base in directory parent: a directory over a directory
// takes the new attributes and keeps its entries; anything else replaces.
func place(parent *bnode, base string, n *bnode) {
	if old := parent.children[base]; old != nil && old != n && old.isDir() && n.isDir() {
		old.setAttrs(n)
		return
	}
	parent.children[base] = n
}

// setAttrs gives directory d the attributes of directory n.
func (d *bnode) setAttrs(n *bnode) {
	d.mode, d.uid, d.gid, d.mtime, d.xattrs = n.mode, n.uid, n.gid, n.mtime, n.xattrs
}

func isWhiteout(base string) bool { return strings.HasPrefix(base, whiteoutPrefix) }

func isLandmark(name string) bool {
	return name == estargz.PrefetchLandmark || name == estargz.NoPrefetchLandmark
}

func (b *builder) addLayer(li int, l Layer) error {
	if l.TOC == nil {
		return b.errorf(li, -1, "", "no TOC")
	}
	es := l.TOC.Entries
	names := make([]string, len(es))
	skip := make([]bool, len(es))

	// Check every name and type first, so that whiteouts below see only
	// clean names.
	for i, e := range es {
		if e == nil {
			return b.errorf(li, i, "", "null entry")
		}
		switch e.Type {
		case "dir", "reg", "symlink", "hardlink", "char", "block", "fifo", "chunk":
		default:
			return b.errorf(li, i, e.Name, "unknown entry type %q", e.Type)
		}
		if e.Type == "chunk" && e.Name == "" {
			continue // estargz writes the name, but its reader does not need it
		}
		name, err := cleanName(e.Name)
		if err != nil {
			return b.errorf(li, i, e.Name, "bad name: %v", err)
		}
		names[i] = name
		if dir, _ := splitName(name); dir != "" {
			if top, _, _ := strings.Cut(dir, "/"); strings.HasPrefix(top, whiteoutMeta) && top != whiteoutOpaque {
				skip[i] = true // AUFS metadata (/.wh..wh.plnk/...): never part of the tree
				continue
			}
			for _, elem := range strings.Split(dir, "/") {
				if isWhiteout(elem) {
					return b.errorf(li, i, e.Name, "whiteout %q as a directory", elem)
				}
			}
		}
	}

	// Whiteouts apply to the layers below, whatever their place in this
	// layer's TOC: before anything of this layer is placed.
	for i, e := range es {
		if e.Type == "chunk" || names[i] == "" || skip[i] {
			continue
		}
		dir, base := splitName(names[i])
		if !isWhiteout(base) {
			continue
		}
		switch {
		case base == whiteoutOpaque:
			if d := b.lookup(dir); d != nil && d.isDir() {
				clear(d.children)
			}
		case strings.HasPrefix(base, whiteoutMeta):
		default:
			target := base[len(whiteoutPrefix):]
			if err := checkElem(target); err != nil {
				return b.errorf(li, i, e.Name, "whiteout of %q: %v", target, err)
			}
			if d := b.lookup(dir); d != nil && d.isDir() {
				delete(d.children, target)
			}
		}
	}

	// Everything but hardlinks, in TOC order (a later entry of a path
	// replaces an earlier one, as tar extraction does).
	type link struct {
		entry  int
		target string
	}
	var links []link
	last := map[string]int{} // path -> index of this layer's last entry of it
	for i := 0; i < len(es); {
		e := es[i]
		j := i + 1
		for j < len(es) && es[j].Type == "chunk" {
			j++
		}
		if e.Type == "chunk" {
			return b.errorf(li, i, e.Name, "chunk entry with no reg entry before it")
		}
		if e.Type != "reg" && j > i+1 {
			return b.errorf(li, i+1, es[i+1].Name, "chunk entry after a %s entry", e.Type)
		}
		at, group, name := i, es[i:j], names[i]
		i = j

		dir, base := splitName(name)
		switch {
		case skip[at]:
			b.ignored++
			continue
		case name == "":
			if e.Type != "dir" {
				return b.errorf(li, at, e.Name, "root is a %s entry, not a dir", e.Type)
			}
			n, err := b.newNode(li, l, group, names[at:j])
			if err != nil {
				return b.wrap(li, at, e.Name, err)
			}
			b.root.setAttrs(n)
			continue
		case isWhiteout(base):
			b.mkdirAll(dir) // the whiteout's directory is part of this layer
			if strings.HasPrefix(base, whiteoutMeta) && base != whiteoutOpaque {
				b.ignored++
			}
			continue
		case dir == "" && isLandmark(base) && e.Type == "reg":
			b.ignored++
			continue
		}
		last[name] = at
		if e.Type == "hardlink" {
			target, err := cleanName(e.LinkName)
			if err != nil {
				return b.errorf(li, at, e.Name, "bad hardlink target %q: %v", e.LinkName, err)
			}
			if target == "" {
				return b.errorf(li, at, e.Name, "hardlink to the root directory")
			}
			links = append(links, link{at, target})
			continue
		}
		n, err := b.newNode(li, l, group, names[at:j])
		if err != nil {
			return b.wrap(li, at, e.Name, err)
		}
		place(b.mkdirAll(dir), base, n)
	}

	// Hardlinks last, so a link may come before its target in the TOC. A
	// link to a path that is itself a link of this layer follows that one
	// first (a chain is walked once, so this stays linear); a cycle of
	// links never resolves and is refused.
	pending := map[string]link{}
	for _, k := range links {
		if name := names[k.entry]; last[name] == k.entry { // not replaced later in this layer
			pending[name] = k
		}
	}
	const active, done = 1, 2
	state := map[string]uint8{}
	var chain []link
	for _, k := range links {
		chain = chain[:0]
		for cur := k; ; {
			name := names[cur.entry]
			if pending[name] != cur || state[name] == done {
				break
			}
			if state[name] == active {
				return b.errorf(li, cur.entry, es[cur.entry].Name, "hardlink cycle through %q", cur.target)
			}
			state[name] = active
			chain = append(chain, cur)
			next, ok := pending[cur.target]
			if !ok || cur.target == name {
				break
			}
			cur = next
		}
		for _, k := range slices.Backward(chain) {
			name := names[k.entry]
			target := b.lookup(k.target)
			switch {
			case target == nil:
				return b.errorf(li, k.entry, es[k.entry].Name, "hardlink to %q: no such file", k.target)
			case target.isDir():
				return b.errorf(li, k.entry, es[k.entry].Name, "hardlink to directory %q", k.target)
			}
			dir, base := splitName(name)
			place(b.mkdirAll(dir), base, target)
			state[name] = done
		}
	}
	return nil
}

func (b *builder) wrap(layer, entry int, name string, err error) error {
	return &BuildError{Tree: b.name, Layer: layer, Entry: entry, Name: name, Err: err}
}

// newNode makes the node of a non-hardlink entry, group[0]; for a regular
// file, group[1:] are its further chunks and names their clean names.
func (b *builder) newNode(li int, l Layer, group []*estargz.TOCEntry, names []string) (*bnode, error) {
	e := group[0]
	n := &bnode{layer: int32(li)}
	if e.Mode < 0 {
		return nil, fmt.Errorf("negative mode %d", e.Mode)
	}
	// Mode is tar's: permission bits and c_ISUID, c_ISGID, c_ISVTX (the
	// S_IS* values). Some writers add the type bits too; the type comes
	// from Type.
	n.mode = uint32(e.Mode & 0o7777)
	if e.UID < 0 || e.UID > math.MaxUint32 || e.GID < 0 || e.GID > math.MaxUint32 {
		return nil, fmt.Errorf("owner %d:%d out of range", e.UID, e.GID)
	}
	n.uid, n.gid = uint32(e.UID), uint32(e.GID)
	n.mtime = epoch
	if e.ModTime3339 != "" {
		t, err := time.Parse(time.RFC3339, e.ModTime3339)
		if err != nil {
			return nil, fmt.Errorf("bad modtime %q: %w", e.ModTime3339, err)
		}
		n.mtime = t
	}
	xs, err := xattrsOf(e.Xattrs)
	if err != nil {
		return nil, err
	}
	n.xattrs = xs

	switch e.Type {
	case "dir":
		n.mode |= syscall.S_IFDIR
		n.children = map[string]*bnode{}
	case "reg":
		n.mode |= syscall.S_IFREG
		if err := n.setChunks(l, group, names); err != nil {
			return nil, err
		}
	case "symlink":
		n.mode |= syscall.S_IFLNK
		switch {
		case e.LinkName == "":
			return nil, errors.New("symlink with no target")
		case len(e.LinkName) > MaxPathLen:
			return nil, fmt.Errorf("symlink target is %d bytes, over %d", len(e.LinkName), MaxPathLen)
		case strings.IndexByte(e.LinkName, 0) >= 0:
			return nil, errors.New("NUL in symlink target")
		}
		n.link = e.LinkName
		n.size = int64(len(e.LinkName))
	case "char", "block":
		if e.Type == "char" {
			n.mode |= syscall.S_IFCHR
		} else {
			n.mode |= syscall.S_IFBLK
		}
		if e.DevMajor < 0 || e.DevMajor > math.MaxUint32 || e.DevMinor < 0 || e.DevMinor > math.MaxUint32 {
			return nil, fmt.Errorf("device %d:%d out of range", e.DevMajor, e.DevMinor)
		}
		n.rdev = unix.Mkdev(uint32(e.DevMajor), uint32(e.DevMinor))
	case "fifo":
		n.mode |= syscall.S_IFIFO
	}
	return n, nil
}

// setChunks checks a regular file's chunks: in order, from offset 0, without
// gaps or overlaps, ending at the file's size, each with a sha256 chunk
// digest. A ChunkSize of 0 is the rest of the file.
func (n *bnode) setChunks(l Layer, group []*estargz.TOCEntry, names []string) error {
	e := group[0]
	size := e.Size
	if size < 0 || size > MaxFileSize {
		return fmt.Errorf("size %d out of range [0, %d]", size, int64(MaxFileSize))
	}
	n.size = size
	if size == 0 {
		if len(group) > 1 {
			return fmt.Errorf("empty file with %d chunk entries", len(group)-1)
		}
		return nil
	}
	if l.Chunks == nil {
		return errors.New("file data in a layer with no chunk reader")
	}
	var at int64
	for k, c := range group {
		if k > 0 && c.Name != "" && names[k] != names[0] {
			return fmt.Errorf("chunk %d is named %q, not the file's", k, c.Name)
		}
		if at == size {
			return fmt.Errorf("chunk %d at %d is past the end of the %d-byte file", k, c.ChunkOffset, size)
		}
		if c.ChunkOffset != at {
			return fmt.Errorf("chunk %d at %d, want %d (chunks must follow each other without gaps or overlaps)", k, c.ChunkOffset, at)
		}
		if c.ChunkSize < 0 || c.Offset < 0 || c.InnerOffset < 0 {
			return fmt.Errorf("chunk %d: negative size or offset", k)
		}
		sz := c.ChunkSize
		if sz == 0 {
			sz = size - at
		}
		if sz > size-at {
			return fmt.Errorf("chunk %d [%d, +%d) runs past the end of the %d-byte file", k, at, sz, size)
		}
		d, err := digest.Parse(c.ChunkDigest)
		if err != nil {
			return fmt.Errorf("chunk %d: bad chunk digest %q: %w", k, c.ChunkDigest, err)
		}
		if d.Algorithm() != digest.SHA256 {
			return fmt.Errorf("chunk %d: chunk digest %q is not sha256", k, c.ChunkDigest)
		}
		at += sz
	}
	if at != size {
		return fmt.Errorf("chunks cover %d of the file's %d bytes", at, size)
	}
	n.chunks = group
	return nil
}

// Limits on extended attributes, as Linux has them (XATTR_NAME_MAX,
// XATTR_SIZE_MAX).
const (
	maxXattrName  = 255
	maxXattrValue = 64 << 10
)

func xattrsOf(m map[string][]byte) ([]xattr, error) {
	if len(m) == 0 {
		return nil, nil
	}
	xs := make([]xattr, 0, len(m))
	for name, v := range m {
		switch {
		case name == "":
			return nil, errors.New("xattr with an empty name")
		case len(name) > maxXattrName:
			return nil, fmt.Errorf("xattr name is %d bytes, over %d", len(name), maxXattrName)
		case strings.IndexByte(name, 0) >= 0:
			return nil, fmt.Errorf("NUL in xattr name %q", name)
		case len(v) > maxXattrValue:
			return nil, fmt.Errorf("xattr %q is %d bytes, over %d", name, len(v), maxXattrValue)
		}
		xs = append(xs, xattr{name, v})
	}
	slices.SortFunc(xs, func(a, b xattr) int { return strings.Compare(a.name, b.name) })
	return xs, nil
}

// finish numbers the merged tree's inodes in sorted path order (each
// directory's entries by name, depth first, the root 1; a hardlinked file
// takes the number of its first path) and lays them out.
func (b *builder) finish(layers []Layer) *Tree {
	t := &Tree{layers: make([]ChunkReader, len(layers))}
	for i, l := range layers {
		t.layers[i] = l.Chunks
	}
	var nodes []*bnode
	var number func(n *bnode, name string, parent uint64) uint64
	number = func(n *bnode, name string, parent uint64) uint64 {
		if n.ino != 0 {
			n.nlink++
			return n.ino
		}
		t.inodes = append(t.inodes, inode{
			name: name, parent: parent,
			mode: n.mode, uid: n.uid, gid: n.gid, layer: n.layer, rdev: n.rdev, size: n.size,
			mtimeSec: n.mtime.Unix(), mtimeNs: int32(n.mtime.Nanosecond()),
			link: n.link, xattrs: n.xattrs, chunks: n.chunks,
		})
		nodes = append(nodes, n)
		ino := uint64(len(t.inodes))
		if parent == 0 {
			parent = ino
			t.inodes[ino-1].parent = ino
		}
		n.ino, n.nlink = ino, 1
		if !n.isDir() {
			return ino
		}
		names := make([]string, 0, len(n.children))
		for name := range n.children {
			names = append(names, name)
		}
		slices.Sort(names)
		ents := make([]rofs.Dirent, len(names))
		subdirs := uint32(0)
		for k, name := range names {
			c := n.children[name]
			ents[k] = rofs.Dirent{Name: name, Ino: number(c, name, ino), Mode: c.mode & syscall.S_IFMT}
			if c.isDir() {
				subdirs++
			}
		}
		d := &t.inodes[ino-1]
		d.children, d.size = ents, BlockSize
		n.nlink = 2 + subdirs
		return ino
	}
	number(b.root, "", 0)
	for i, n := range nodes {
		in := &t.inodes[i]
		in.nlink = n.nlink
		blocks := (uint64(in.size) + BlockSize - 1) / BlockSize
		if t.blocks > math.MaxUint64-blocks {
			t.blocks = math.MaxUint64
		} else {
			t.blocks += blocks
		}
	}
	return t
}
