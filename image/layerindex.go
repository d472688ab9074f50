package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/kilnvm/kiln/image/store"
	"github.com/klauspost/compress/zstd"
	"github.com/opencontainers/go-digest"
)

// chunkSize is the size files are cut into when a plain layer is indexed:
// estargz's default, so a file in an estargz layer and the same file in an
// indexed layer have the same chunk digests and are stored once.
const chunkSize = 4 << 20

// indexed is what indexing a layer produced.
type indexed struct {
	toc    []byte        // the TOC JSON, as stored
	tocDgt digest.Digest // its digest
	diffID digest.Digest // sha256 of the uncompressed tar
	chunks int           // chunks stored (or found stored)
	bytes  int64         // uncompressed file bytes
}

// indexTar walks an uncompressed layer tar, stores every regular file's
// bytes in 4 MiB chunks by their sha256, and builds the TOC estargz would
// write for the same tar: the same entry fields (name as in the tar, type,
// size, mode with setuid/setgid/sticky bits, uid/gid, user and group
// names on the first entry of each id, modtime, link target, device
// numbers, PAX SCHILY.xattr.* extended attributes, chunkOffset/chunkSize/
// chunkDigest, the file's digest). There is no compressed blob behind it,
// so a data entry's Offset is where the chunk's bytes start in the
// uncompressed tar: unique in the layer, which is all a reader needs of it.
// The JSON is marshalled as estargz marshals it, so the same tar always
// gives the same TOC digest.
func indexTar(ctx context.Context, st *store.Store, r io.Reader) (*indexed, error) {
	diff := sha256.New()
	cr := &posReader{r: io.TeeReader(r, diff)}
	tr := tar.NewReader(cr)
	toc := &estargz.JTOC{Version: 1}
	var lastUser, lastGroup map[int]string
	nameIfChanged := func(mp *map[int]string, id int, name string) string {
		if name == "" {
			return ""
		}
		if *mp == nil {
			*mp = map[int]string{}
		}
		if (*mp)[id] == name {
			return ""
		}
		(*mp)[id] = name
		return name
	}
	res := &indexed{}
	buf := make([]byte, chunkSize)
	for {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: layer tar: %v", ErrInvalid, err)
		}
		if cleanName(h.Name) == estargz.TOCTarName {
			continue // as estargz does: a TOC of a layer indexed before
		}
		xattrs := map[string][]byte{}
		for k, v := range h.PAXRecords {
			if x, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
				xattrs[x] = []byte(v)
			}
		}
		ent := &estargz.TOCEntry{
			Name:        h.Name,
			Mode:        h.Mode,
			UID:         h.Uid,
			GID:         h.Gid,
			Uname:       nameIfChanged(&lastUser, h.Uid, h.Uname),
			Gname:       nameIfChanged(&lastGroup, h.Gid, h.Gname),
			ModTime3339: formatModtime(h.ModTime),
			Xattrs:      xattrs,
		}
		switch h.Typeflag {
		case tar.TypeLink:
			ent.Type, ent.LinkName = "hardlink", h.Linkname
		case tar.TypeSymlink:
			ent.Type, ent.LinkName = "symlink", h.Linkname
		case tar.TypeDir:
			ent.Type = "dir"
		case tar.TypeReg, tar.TypeRegA: //nolint:staticcheck // TypeRegA: old tars
			ent.Type, ent.Size = "reg", h.Size
		case tar.TypeChar:
			ent.Type, ent.DevMajor, ent.DevMinor = "char", int(h.Devmajor), int(h.Devminor)
		case tar.TypeBlock:
			ent.Type, ent.DevMajor, ent.DevMinor = "block", int(h.Devmajor), int(h.Devminor)
		case tar.TypeFifo:
			ent.Type = "fifo"
		default:
			return nil, fmt.Errorf("%w: layer tar: entry %q has unsupported type %q", ErrInvalid, h.Name, h.Typeflag)
		}
		if ent.Type != "reg" || ent.Size == 0 {
			if ent.Type == "reg" {
				ent.Digest = digest.FromBytes(nil).String()
			}
			toc.Entries = append(toc.Entries, ent)
			continue
		}
		file := sha256.New()
		reg := ent
		var written int64
		for written < reg.Size {
			n := int64(chunkSize)
			if remain := reg.Size - written; remain < n {
				n = remain
			} else {
				ent.ChunkSize = n
			}
			ent.Offset = cr.n
			ent.ChunkOffset = written
			b := buf[:n]
			if _, err := io.ReadFull(tr, b); err != nil {
				return nil, fmt.Errorf("%w: layer tar: %q: %v", ErrInvalid, h.Name, err)
			}
			file.Write(b)
			sum := sha256.Sum256(b)
			d := digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(sum[:]))
			if _, err := st.PutSized(ctx, d, n, bytes.NewReader(b)); err != nil {
				return nil, fmt.Errorf("storing a chunk of %q: %w", h.Name, err)
			}
			ent.ChunkDigest = d.String()
			toc.Entries = append(toc.Entries, ent)
			res.chunks++
			res.bytes += n
			written += n
			ent = &estargz.TOCEntry{Name: h.Name, Type: "chunk"}
		}
		reg.Digest = digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(file.Sum(nil))).String()
	}
	// The rest of the stream (tar padding) is part of the diff ID.
	if _, err := io.Copy(io.Discard, cr); err != nil {
		return nil, fmt.Errorf("%w: layer tar: %v", ErrInvalid, err)
	}
	data, err := marshalTOC(toc)
	if err != nil {
		return nil, err
	}
	res.toc = data
	res.tocDgt = digest.FromBytes(data)
	res.diffID = digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(diff.Sum(nil)))
	return res, nil
}

// marshalTOC marshals a TOC exactly as estargz's gzip compressor does, so
// that its digest is the one estargz would compute.
func marshalTOC(toc *estargz.JTOC) ([]byte, error) {
	data, err := json.MarshalIndent(toc, "", "\t")
	if err != nil {
		return nil, fmt.Errorf("image: marshalling a TOC: %w", err)
	}
	return data, nil
}

// formatModtime is estargz's: UTC, to the second, empty for zero or the
// epoch.
func formatModtime(t time.Time) string {
	if t.IsZero() || t.Unix() == 0 {
		return ""
	}
	return t.UTC().Round(time.Second).Format(time.RFC3339)
}

// posReader counts the bytes read through it.
type posReader struct {
	r io.Reader
	n int64
}

func (p *posReader) Read(b []byte) (int, error) {
	n, err := p.r.Read(b)
	p.n += int64(n)
	return n, err
}

// decompress returns the uncompressed stream of a layer blob: gzip and
// zstd are recognised by their magic numbers, anything else is taken to
// be a tar.
func decompress(r io.Reader) (io.ReadCloser, error) {
	br := bufio.NewReaderSize(r, 64<<10)
	magic, err := br.Peek(4)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: layer: %v", ErrInvalid, err)
	}
	switch {
	case len(magic) >= 2 && magic[0] == 0x1f && magic[1] == 0x8b:
		zr, err := gzip.NewReader(br)
		if err != nil {
			return nil, fmt.Errorf("%w: layer: gzip: %v", ErrInvalid, err)
		}
		return zr, nil
	case len(magic) == 4 && bytes.Equal(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br, zstd.WithDecoderConcurrency(1))
		if err != nil {
			return nil, fmt.Errorf("%w: layer: zstd: %v", ErrInvalid, err)
		}
		return zr.IOReadCloser(), nil
	}
	return io.NopCloser(br), nil
}
