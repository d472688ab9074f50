package image

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/kilnvm/kiln/image/store"
	"github.com/opencontainers/go-digest"
)

// ErrStale: the image's record is from an older kiln, which stored layers
// whole and no TOCs; pull or import it again to run it.
var ErrStale = errors.New("image stored by an older kiln")

// LayerReader is one layer opened for running: its record, its parsed TOC
// and the reader of its chunks.
type LayerReader struct {
	Layer Layer
	// TOC is the layer's TOC, normalised as estargz's reader does (see
	// parseTOC): names relative to the root, "chunk" entries named after
	// their file, ChunkSize set on every data entry. Its entries are the
	// ones Chunks knows; copies are found by Offset and InnerOffset.
	TOC    *estargz.JTOC
	Chunks *ChunkReader
}

// Layers opens an image for running: bottom layer first, each layer's TOC,
// read from the store and checked, and a ChunkReader for its chunks. It
// reads no registry: lazy layers fetch on the first read that misses, so a
// second Images on the same folder (another process) reads what the first
// fetched without fetching it again.
func (im *Images) Layers(ctx context.Context, img *Image) ([]LayerReader, error) {
	if img.stale() {
		return nil, fmt.Errorf("image: %s: %w, which kept layers whole: pull or import it again", img.Name, ErrStale)
	}
	var rr remoteRepo
	if img.lazy() {
		var err error
		if rr, err = repoOf(img); err != nil {
			return nil, err
		}
	}
	out := make([]LayerReader, 0, len(img.Layers))
	for _, l := range img.Layers {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		toc, ix, err := im.readTOC(l)
		if err != nil {
			return nil, fmt.Errorf("image: %s: %w", img.Name, err)
		}
		out = append(out, LayerReader{Layer: l, TOC: toc, Chunks: &ChunkReader{im: im, img: img.Name, manifest: img.Manifest, layer: l, ix: ix, rr: rr}})
	}
	return out, nil
}

// readTOC reads, checks and parses a layer's TOC from the store.
func (im *Images) readTOC(l Layer) (*estargz.JTOC, *tocIndex, error) {
	if l.TOC == "" {
		return nil, nil, fmt.Errorf("layer %s: %w: no TOC recorded", l.Digest, ErrStale)
	}
	f, size, err := im.st.OpenVerified(l.TOC)
	if err != nil {
		return nil, nil, fmt.Errorf("layer %s: TOC: %w", l.Digest, err)
	}
	defer f.Close()
	if size > maxTOCBytes {
		return nil, nil, fmt.Errorf("layer %s: TOC of %d bytes (at most %d)", l.Digest, size, maxTOCBytes)
	}
	data, err := io.ReadAll(io.LimitReader(f, maxTOCBytes+1))
	if err != nil {
		return nil, nil, fmt.Errorf("layer %s: TOC: %w", l.Digest, err)
	}
	limit := int64(-1)
	if l.Chunks == ChunksRegistry {
		limit = l.TOCOffset
	}
	toc, ix, err := parseTOC(data, limit)
	if err != nil {
		return nil, nil, fmt.Errorf("layer %s: TOC %s: %w", l.Digest, l.TOC, err)
	}
	return toc, ix, nil
}

// needs lists what the store must keep for img to run: the record's blobs
// (manifest, config, index, TOCs) and the chunks of its indexed layers,
// which cannot be fetched again; and, apart, the chunks of its lazy
// layers, a cache.
func (im *Images) needs(img *Image) (must, cache []digest.Digest, err error) {
	must = img.blobs()
	for _, l := range img.Layers {
		if l.Chunks == "" {
			continue
		}
		_, ix, err := im.readTOC(l)
		if err != nil {
			return nil, nil, fmt.Errorf("image: %s: %w", img.Name, err)
		}
		for _, c := range ix.chunks {
			if l.Chunks == ChunksStore {
				must = append(must, c.digest)
			} else {
				cache = append(cache, c.digest)
			}
		}
	}
	return must, cache, nil
}

// Pin keeps what img needs to run (see needs; lazily fetched chunks too)
// from GC in this process until Unpin with the same holder (a sandbox ID,
// an open root). The pin is the image's, not one per chunk: GC reads what
// a pinned image needs when it runs. Other processes' GCs do not see pins:
// they keep a running sandbox's image through Options.Keep, or because
// the image stays named.
func (im *Images) Pin(img *Image, holder string) error {
	if img == nil || img.Manifest == "" {
		return errors.New("image: pin of no image")
	}
	im.pmu.Lock()
	defer im.pmu.Unlock()
	p := im.pins[img.Manifest]
	if p == nil {
		p = &imagePin{img: img, holders: map[string]bool{}}
		im.pins[img.Manifest] = p
	}
	p.holders[holder] = true
	return nil
}

// Unpin drops holder's pin on img.
func (im *Images) Unpin(img *Image, holder string) {
	im.pmu.Lock()
	defer im.pmu.Unlock()
	if p := im.pins[img.Manifest]; p != nil {
		delete(p.holders, holder)
		if len(p.holders) == 0 {
			delete(im.pins, img.Manifest)
		}
	}
}

// pinned returns the blobs the pinned images need.
func (im *Images) pinned() (map[digest.Digest]bool, error) {
	im.pmu.Lock()
	imgs := make([]*Image, 0, len(im.pins))
	for _, p := range im.pins {
		imgs = append(imgs, p.img)
	}
	im.pmu.Unlock()
	keep := map[digest.Digest]bool{}
	for _, img := range imgs {
		must, cache, err := im.needs(img)
		if err != nil {
			return nil, fmt.Errorf("image %s, pinned: %w", img.Name, err)
		}
		for _, d := range append(must, cache...) {
			keep[d] = true
		}
	}
	return keep, nil
}

// GC removes what no named image needs, then holds lazily fetched chunks
// under the store's cap (Options.Store.MaxBytes), least recently used
// first. It keeps every blob a named image's record names, every chunk of
// its indexed layers (they cannot be fetched again), what Options.Keep
// keeps, what images this process pinned need, and what was used within
// Options.GCGrace. A TOC that cannot be read stops GC with an error
// rather than let it drop chunks it would have named. It holds the index
// lock, so no image is named meanwhile.
func (im *Images) GC(ctx context.Context) (store.GCResult, error) {
	im.mu.Lock()
	defer im.mu.Unlock()
	unlock, err := im.lock()
	if err != nil {
		return store.GCResult{}, err
	}
	defer unlock()
	imgs, err := im.load()
	if err != nil {
		return store.GCResult{}, err
	}
	must, cache := map[digest.Digest]bool{}, map[digest.Digest]bool{}
	for i := range imgs {
		m, c, err := im.needs(&imgs[i])
		if err != nil {
			return store.GCResult{}, fmt.Errorf("image: gc: %w", err)
		}
		for _, d := range m {
			must[d] = true
		}
		for _, d := range c {
			cache[d] = true
		}
	}
	pinned, err := im.pinned()
	if err != nil {
		return store.GCResult{}, fmt.Errorf("image: gc: %w", err)
	}
	keep := func(d digest.Digest) bool { return pinned[d] || (im.opts.Keep != nil && im.opts.Keep(d)) }
	cutoff := time.Now().Add(-im.opts.GCGrace)
	res, err := im.st.GCTo(ctx, 0, func(d digest.Digest) bool {
		if must[d] || cache[d] || keep(d) {
			return true
		}
		if im.opts.GCGrace > 0 {
			if info, err := im.st.Stat(d); err == nil && info.LastUsed.After(cutoff) {
				return true
			}
		}
		return false
	})
	im.open.forget(res.Removed...)
	if err != nil || im.opts.Store.MaxBytes == 0 {
		return res, err
	}
	// The cache of lazily fetched chunks, under the cap.
	res2, err := im.st.GCTo(ctx, im.opts.Store.MaxBytes, func(d digest.Digest) bool {
		return !cache[d] || must[d] || keep(d)
	})
	im.open.forget(res2.Removed...)
	res2.Removed = append(res.Removed, res2.Removed...)
	res2.FreedBytes += res.FreedBytes
	res2.TempRemoved += res.TempRemoved
	res2.TempBytes += res.TempBytes
	return res2, err
}

// digestCounter hashes and counts what is written to it.
type digestCounter struct {
	h hash.Hash
	n int64
}

func newDigestCounter() *digestCounter { return &digestCounter{h: sha256.New()} }

func (d *digestCounter) Write(p []byte) (int, error) {
	d.n += int64(len(p))
	return d.h.Write(p)
}

func (d *digestCounter) sum() (digest.Digest, int64) {
	return digest.NewDigestFromEncoded(digest.SHA256, hex.EncodeToString(d.h.Sum(nil))), d.n
}
