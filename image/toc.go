package image

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"path"
	"slices"
	"sort"
	"strings"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/kilnvm/kiln/image/store"
	"github.com/opencontainers/go-digest"
)

// Bounds on TOCs, which come from registries and so are hostile input.
const (
	// maxTOCBytes bounds a TOC's JSON: it is read and parsed whole. A
	// TOC entry is ~250 bytes, so this is ~250k files and chunks.
	maxTOCBytes = 64 << 20
	// maxTOCEntries bounds the entries of one TOC.
	maxTOCEntries = 1 << 20
	// maxChunkSize bounds one chunk: a chunk is fetched, checked and stored
	// whole, in memory.
	maxChunkSize = 32 << 20
	// maxMemberBytes bounds the compressed range fetched for one chunk.
	maxMemberBytes = 48 << 20
)

// chunk is what the reader knows of one data entry ("reg" with data, or
// "chunk") of a TOC.
type chunk struct {
	ent    *estargz.TOCEntry
	file   string        // the file's (cleaned) name
	digest digest.Digest // sha256 of the chunk's uncompressed bytes
	size   int64         // its uncompressed size
	// end is where the gzip member holding the chunk ends in the blob:
	// the next greater Offset of a data entry, or the TOC's offset for
	// the last one. Only lazy layers use it.
	end int64
	// pos is the chunk's place in its layer's blob order
	// (tocIndex.inBlob); lazy layers only.
	pos int
}

// chunkKey identifies a data entry within its layer.
type chunkKey struct{ off, inner int64 }

// tocIndex maps a parsed TOC's data entries to their chunks.
type tocIndex struct {
	chunks []*chunk // in TOC order
	inBlob []*chunk // a lazy layer's, by blob offset (and inner offset)
	byEnt  map[*estargz.TOCEntry]*chunk
	byKey  map[chunkKey]*chunk
}

// slim drops what no read or fetch of the index's chunks uses from their
// TOC entries (owner names, times, link targets, xattrs, the whole file's
// digest), once a tree has taken its own copy: a root keeps its index's
// entries for as long as it runs. What identifies a chunk (Offset,
// InnerOffset, ChunkOffset, ChunkSize, ChunkDigest, Name, Size) stays.
func (ix *tocIndex) slim() {
	for _, c := range ix.chunks {
		e := c.ent
		e.ChunkDigest = string(c.digest) // a file of one chunk may have given only Digest
		e.Uname, e.Gname, e.ModTime3339, e.LinkName, e.Digest = "", "", "", "", ""
		e.Xattrs = nil
	}
}

// lookup finds the chunk of a data entry: by pointer (an entry of the JTOC
// that Layers returned), else by its Offset and InnerOffset (a copy).
func (ix *tocIndex) lookup(ce *estargz.TOCEntry) (*chunk, error) {
	if ce == nil {
		return nil, errors.New("nil TOC entry")
	}
	if c := ix.byEnt[ce]; c != nil {
		return c, nil
	}
	if c := ix.byKey[chunkKey{ce.Offset, ce.InnerOffset}]; c != nil && (ce.ChunkDigest == "" || ce.ChunkDigest == string(c.digest)) {
		return c, nil
	}
	return nil, fmt.Errorf("%q (offset %d) is not a chunk of this layer's TOC", ce.Name, ce.Offset)
}

// parseTOC parses and checks a TOC's JSON (estargz's stargz.index.json, or
// one that indexing a plain layer wrote) and normalises it as estargz's own
// reader does: names cleaned to be relative to the root, "chunk" entries
// named after their file, ChunkSize filled in for every data entry (0 in
// the JSON means "to the end of the file"), and Uname/Gname repeated on
// every entry of the same UID/GID. limit, if positive, is the TOC's offset
// in its blob: every chunk lies before it. Anything malformed is an error
// naming the entry.
func parseTOC(data []byte, limit int64) (*estargz.JTOC, *tocIndex, error) {
	if len(data) > maxTOCBytes {
		return nil, nil, fmt.Errorf("TOC of %d bytes (at most %d)", len(data), maxTOCBytes)
	}
	var toc estargz.JTOC
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&toc); err != nil {
		return nil, nil, fmt.Errorf("TOC JSON: %w", err)
	}
	if dec.More() {
		return nil, nil, errors.New("TOC JSON: data after the object")
	}
	if toc.Version != 1 {
		return nil, nil, fmt.Errorf("TOC version %d, want 1", toc.Version)
	}
	if len(toc.Entries) > maxTOCEntries {
		return nil, nil, fmt.Errorf("TOC of %d entries (at most %d)", len(toc.Entries), maxTOCEntries)
	}
	ix := &tocIndex{byEnt: map[*estargz.TOCEntry]*chunk{}, byKey: map[chunkKey]*chunk{}}
	uname, gname := map[int]string{}, map[int]string{}
	var cur *estargz.TOCEntry // the "reg" whose chunks follow
	var next int64            // the ChunkOffset the next chunk of cur must have
	endFile := func() error {
		if cur != nil && next != cur.Size {
			return fmt.Errorf("TOC: %q: chunks cover %d of its %d bytes", cur.Name, next, cur.Size)
		}
		cur = nil
		return nil
	}
	for i, e := range toc.Entries {
		if e == nil {
			return nil, nil, fmt.Errorf("TOC entry %d: null", i)
		}
		bad := func(format string, args ...any) error {
			return fmt.Errorf("TOC entry %d (%.200q): %s", i, e.Name, fmt.Sprintf(format, args...))
		}
		if e.Offset < 0 || e.InnerOffset < 0 || e.Size < 0 || e.ChunkOffset < 0 || e.ChunkSize < 0 ||
			e.DevMajor < 0 || e.DevMinor < 0 || e.UID < 0 || e.GID < 0 || e.Mode < 0 || e.Mode > 0o7777777 {
			return nil, nil, bad("negative or out-of-range number")
		}
		if strings.IndexByte(e.Name, 0) >= 0 || strings.IndexByte(e.LinkName, 0) >= 0 {
			return nil, nil, bad("NUL in a name")
		}
		if e.Type != "chunk" {
			if err := endFile(); err != nil {
				return nil, nil, err
			}
			e.Name = cleanName(e.Name)
			if e.Uname != "" {
				uname[e.UID] = e.Uname
			} else {
				e.Uname = uname[e.UID]
			}
			if e.Gname != "" {
				gname[e.GID] = e.Gname
			} else {
				e.Gname = gname[e.GID]
			}
			for k := range e.Xattrs {
				if k == "" || strings.IndexByte(k, 0) >= 0 {
					return nil, nil, bad("bad xattr name %q", k)
				}
			}
		}
		switch e.Type {
		case "dir", "fifo":
		case "symlink", "hardlink":
			if e.LinkName == "" {
				return nil, nil, bad("%s without a target", e.Type)
			}
		case "char", "block":
		case "reg":
			if e.ChunkOffset != 0 {
				return nil, nil, bad("a file's first chunk at offset %d", e.ChunkOffset)
			}
			if e.Size == 0 {
				e.ChunkSize = 0
				continue
			}
			cur, next = e, 0
		case "chunk":
			if cur == nil {
				return nil, nil, bad("a chunk that follows no file")
			}
			e.Name = cur.Name
		default:
			return nil, nil, bad("unknown type %q", e.Type)
		}
		if e.Type != "reg" && e.Type != "chunk" {
			continue
		}
		// A data entry.
		if e.ChunkOffset != next {
			return nil, nil, bad("chunk at offset %d, want %d", e.ChunkOffset, next)
		}
		if e.ChunkSize == 0 {
			e.ChunkSize = cur.Size - e.ChunkOffset
		}
		if e.ChunkSize <= 0 || e.ChunkOffset+e.ChunkSize > cur.Size || e.ChunkSize > maxChunkSize {
			return nil, nil, bad("chunk of %d bytes at %d in a file of %d (chunks of at most %d)", e.ChunkSize, e.ChunkOffset, cur.Size, maxChunkSize)
		}
		next = e.ChunkOffset + e.ChunkSize
		ds := e.ChunkDigest
		if ds == "" && e.Type == "reg" && e.ChunkSize == e.Size {
			ds = e.Digest // a file of one chunk may give only its digest
		}
		d, err := store.ParseDigest(ds)
		if err != nil {
			return nil, nil, bad("chunk digest: %v", err)
		}
		if limit > 0 && e.Offset >= limit {
			return nil, nil, bad("chunk at blob offset %d, past the TOC at %d", e.Offset, limit)
		}
		k := chunkKey{e.Offset, e.InnerOffset}
		if ix.byKey[k] != nil {
			return nil, nil, bad("blob offset %d+%d used twice", e.Offset, e.InnerOffset)
		}
		c := &chunk{ent: e, file: cur.Name, digest: d, size: e.ChunkSize}
		ix.chunks = append(ix.chunks, c)
		ix.byEnt[e] = c
		ix.byKey[k] = c
	}
	if err := endFile(); err != nil {
		return nil, nil, err
	}
	if limit > 0 {
		setEnds(ix.chunks, limit)
		ix.inBlob = slices.Clone(ix.chunks)
		slices.SortStableFunc(ix.inBlob, func(a, b *chunk) int {
			return cmp.Or(cmp.Compare(a.ent.Offset, b.ent.Offset), cmp.Compare(a.ent.InnerOffset, b.ent.InnerOffset))
		})
		for i, c := range ix.inBlob {
			c.pos = i
		}
	}
	return &toc, ix, nil
}

// setEnds sets each chunk's end: the next greater Offset of a data entry,
// or limit.
func setEnds(cs []*chunk, limit int64) {
	offs := make([]int64, 0, len(cs))
	for _, c := range cs {
		offs = append(offs, c.ent.Offset)
	}
	sort.Slice(offs, func(i, j int) bool { return offs[i] < offs[j] })
	for _, c := range cs {
		i := sort.Search(len(offs), func(i int) bool { return offs[i] > c.ent.Offset })
		c.end = limit
		if i < len(offs) {
			c.end = offs[i]
		}
	}
}

// cleanName is estargz's name normalisation: relative to the root, no
// "..", no trailing slash; the root is "".
func cleanName(name string) string {
	return strings.TrimPrefix(path.Clean("/"+name), "/")
}
