package image

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"slices"
	"sync"
	"syscall"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/kilnvm/kiln/image/store"
	"github.com/opencontainers/go-digest"
)

// maxRunBytes caps one request for adjacent missing chunks.
const maxRunBytes = 8 << 20

// maxBatchBytes caps the inflated chunks of a run held in memory before
// they are stored (with one flush of the store for each batch).
const maxBatchBytes = 16 << 20

// Readahead over a lazy layer's blob. A miss that starts where the
// layer's last fetch ended (or a little past it) is a walk through the
// tree in the layer's order, as git status, grep -r or a first import
// make: it fetches the missing chunks after it too, in the same request,
// the window doubling from minReadahead to maxReadahead compressed bytes
// while the walk goes on. A miss anywhere else fetches what it needs
// only, so a sandbox that reads a few files fetches a few files.
const (
	minReadahead = 128 << 10
	maxReadahead = 4 << 20
	// maxReadaheadChunks bounds the chunks one miss reads ahead, well
	// under MaxChunkRequest (a jailed process asks its parent for them).
	maxReadaheadChunks = 256
)

// readahead is a layer's readahead state.
type readahead struct {
	mu     sync.Mutex
	next   int64 // where in the blob the last fetch ended; 0: none yet
	window int64 // compressed bytes the last sequential miss read ahead
}

// ChunkReader reads a layer's chunks: from the store, which checked them
// when they were put; on a miss (a lazy layer), from the registry, checked
// against their ChunkDigest and then stored. It satisfies image/tree's
// ChunkReader. Safe for concurrent use.
type ChunkReader struct {
	im       *Images
	img      string        // the image's name, for messages
	manifest digest.Digest // the image's manifest (ChunkRequest)
	layer    Layer
	ix       *tocIndex
	rr       remoteRepo // lazy layers

	bmu  sync.Mutex
	blob rangeReader // made on the first miss

	ra readahead
}

// flight is one chunk being fetched in this process.
type flight struct {
	done chan struct{}
	err  error
}

// ReadChunk copies into p the uncompressed bytes of chunk ce (a "reg" or
// "chunk" entry of this layer's TOC) from off within the chunk, fetching
// and checking the chunk first if it is not stored. Like io.ReaderAt, it
// returns io.EOF with n < len(p) when the chunk ends first. A chunk that
// cannot be fetched or fails its check gives an error wrapping
// syscall.EIO.
func (c *ChunkReader) ReadChunk(ctx context.Context, ce *estargz.TOCEntry, p []byte, off int64) (int, error) {
	ch, err := c.ix.lookup(ce)
	if err != nil {
		return 0, fmt.Errorf("image: layer %s: %w: %w", c.layer.Digest, syscall.EINVAL, err)
	}
	if off < 0 {
		return 0, fmt.Errorf("image: layer %s: %w: negative offset %d", c.layer.Digest, syscall.EINVAL, off)
	}
	if off >= ch.size {
		return 0, io.EOF
	}
	for try := 0; ; try++ {
		n, err := c.readStored(ch, p, off)
		if !errors.Is(err, fs.ErrNotExist) {
			return n, err
		}
		if try > 0 {
			// Fetched, then gone: another process's GC in between.
			return 0, c.eio(ch, fmt.Errorf("chunk removed from the store right after it was fetched"))
		}
		if err := c.fetch(ctx, []*chunk{ch}, true); err != nil {
			return 0, err
		}
	}
}

// readStored preads a chunk's bytes from the store, through the Images'
// open files.
func (c *ChunkReader) readStored(ch *chunk, p []byte, off int64) (int, error) {
	of := c.im.open.get(ch.digest)
	if of == nil {
		f, size, err := c.im.st.Open(ch.digest)
		if err != nil {
			return 0, err
		}
		of = c.im.open.add(ch.digest, f, size)
	}
	defer c.im.open.release(of)
	if of.size != ch.size {
		return 0, c.eio(ch, fmt.Errorf("stored chunk has %d bytes, the TOC says %d", of.size, ch.size))
	}
	want := min(int64(len(p)), ch.size-off)
	n, err := of.f.ReadAt(p[:want], off)
	if int64(n) < want {
		return n, c.eio(ch, fmt.Errorf("reading the stored chunk: %v", err))
	}
	if want < int64(len(p)) {
		return n, io.EOF
	}
	return n, nil
}

// Fetch makes chunks ces available: consecutive chunks of one file, in
// file order. Missing ones are fetched, adjacent ones in one request of up
// to 8 MiB, and checked against their ChunkDigest; a miss that continues
// a walk through the blob reads ahead (maxReadahead). A chunk this process
// is fetching already is waited for, not fetched twice.
func (c *ChunkReader) Fetch(ctx context.Context, ces []*estargz.TOCEntry) error {
	chs := make([]*chunk, 0, len(ces))
	for _, ce := range ces {
		ch, err := c.ix.lookup(ce)
		if err != nil {
			return fmt.Errorf("image: layer %s: %w: %w", c.layer.Digest, syscall.EINVAL, err)
		}
		chs = append(chs, ch)
	}
	return c.fetch(ctx, chs, true)
}

// fetch makes chs available, fetching the missing ones; with ahead, a
// miss that continues a walk through the blob fetches the chunks after
// it too (readahead), without waiting for them.
func (c *ChunkReader) fetch(ctx context.Context, chs []*chunk, ahead bool) error {
	var missing []*chunk
	seen := map[digest.Digest]bool{}
	for _, ch := range chs {
		if seen[ch.digest] || c.im.st.Has(ch.digest) {
			continue
		}
		seen[ch.digest] = true
		missing = append(missing, ch)
	}
	if len(missing) == 0 {
		return nil
	}
	if c.layer.Chunks != ChunksRegistry {
		return c.eio(missing[0], fmt.Errorf("chunk missing from the store; the layer was indexed and cannot be refetched: pull or import %s again", c.img))
	}
	var extra []*chunk
	if ahead {
		extra = c.readAhead(missing[0], missing[len(missing)-1], seen)
	}
	// Claim the chunks no one in this process is fetching; wait for the
	// ones asked for, not for those read ahead.
	var mine []*chunk
	var waits []*flight
	c.im.fmu.Lock()
	for i, ch := range append(missing, extra...) {
		wanted := i < len(missing)
		if f := c.im.inflight[ch.digest]; f != nil {
			if wanted {
				waits = append(waits, f)
			}
			continue
		}
		f := &flight{done: make(chan struct{})}
		c.im.inflight[ch.digest] = f
		if wanted {
			waits = append(waits, f)
		}
		mine = append(mine, ch)
	}
	c.im.fmu.Unlock()
	// The fetches run on their own, under the fetch deadline: a reader that
	// gives up does not fail the others waiting for the same chunks.
	fctx := context.WithoutCancel(ctx)
	for _, run := range runs(mine) {
		if c.im.opts.Fetcher != nil {
			go c.delegateRun(fctx, run)
		} else {
			go c.fetchRun(fctx, run)
		}
	}
	for _, f := range waits {
		select {
		case <-f.done:
			if f.err != nil {
				return f.err
			}
		case <-ctx.Done():
			return fmt.Errorf("image: layer %s: %w: %w", c.layer.Digest, syscall.EIO, ctx.Err())
		}
	}
	return nil
}

// readAhead returns the chunks to fetch after a miss of first to last (in
// blob order): none unless the miss starts where the layer's last fetch
// ended or within a window past it; then the missing chunks that follow
// last in the blob, adjacent to it and to each other, up to the window
// (doubled each time, minReadahead to maxReadahead bytes) and
// maxReadaheadChunks. It stops at a chunk stored already or in seen.
func (c *ChunkReader) readAhead(first, last *chunk, seen map[digest.Digest]bool) []*chunk {
	c.ra.mu.Lock()
	defer c.ra.mu.Unlock()
	off, next := first.ent.Offset, c.ra.next
	sequential := next > 0 && off >= next && off-next <= max(c.ra.window, minReadahead)
	c.ra.next = last.end // where this fetch ends, without readahead
	if !sequential {
		c.ra.window = 0
		return nil
	}
	c.ra.window = min(max(2*c.ra.window, minReadahead), maxReadahead)
	blob := c.ix.inBlob
	if last.pos >= len(blob) || blob[last.pos] != last {
		return nil // not this layer's chunk (a copy of the TOC entry)
	}
	var out []*chunk
	end := last.end
	for i := last.pos + 1; i < len(blob) && len(out) < maxReadaheadChunks; i++ {
		ch := blob[i]
		if ch.ent.Offset != end && ch.ent.Offset != blob[i-1].ent.Offset {
			break // a gap in the blob: not one request
		}
		if ch.end-last.end > c.ra.window || seen[ch.digest] || c.im.st.Has(ch.digest) {
			break
		}
		seen[ch.digest] = true
		out = append(out, ch)
		end = max(end, ch.end)
	}
	c.ra.next = end
	return out
}

// runs groups chunks into requests: a run is chunks whose gzip members
// are adjacent in the blob, at most maxRunBytes in all (a single chunk
// bigger than that is a run of its own).
func runs(chs []*chunk) [][]*chunk {
	var out [][]*chunk
	var cur []*chunk
	for _, ch := range chs {
		if len(cur) > 0 {
			first, last := cur[0], cur[len(cur)-1]
			adjacent := ch.ent.Offset == last.end || ch.ent.Offset == last.ent.Offset
			if !adjacent || max(ch.end, last.end)-first.ent.Offset > maxRunBytes {
				out = append(out, cur)
				cur = nil
			}
		}
		cur = append(cur, ch)
	}
	if len(cur) > 0 {
		out = append(out, cur)
	}
	return out
}

// endFlights ends the flights of run's chunks, chunk i's with errs[i].
func (c *ChunkReader) endFlights(run []*chunk, errs []error) {
	c.im.fmu.Lock()
	for i, ch := range run {
		f := c.im.inflight[ch.digest]
		delete(c.im.inflight, ch.digest)
		f.err = errs[i]
		close(f.done)
	}
	c.im.fmu.Unlock()
}

// delegateRun has Options.Fetcher fetch one run into the store (a jailed
// VMM process's parent: this process can neither reach the registry nor
// write the store), then checks that each chunk is there, and ends the
// chunks' flights. What the fetcher stored was checked by its store.
func (c *ChunkReader) delegateRun(ctx context.Context, run []*chunk) {
	errs := make([]error, len(run))
	defer c.endFlights(run, errs)
	req := ChunkRequest{Manifest: c.manifest, Layer: c.layer.Digest, Chunks: make([]ChunkRef, len(run))}
	for i, ch := range run {
		req.Chunks[i] = ChunkRef{Offset: ch.ent.Offset, InnerOffset: ch.ent.InnerOffset, Digest: ch.digest}
	}
	// The fetcher's own fetch is bounded by its FetchTimeout; this one
	// allows for that and for the round trip.
	dctx, cancel := context.WithTimeout(ctx, c.im.fetchTimeout()+10*time.Second)
	defer cancel()
	if err := c.im.opts.Fetcher.FetchChunks(dctx, req); err != nil {
		for i, ch := range run {
			errs[i] = c.eio(ch, fmt.Errorf("fetching through the parent: %w", err))
		}
		return
	}
	for i, ch := range run {
		if !c.im.st.Has(ch.digest) {
			errs[i] = c.eio(ch, errors.New("the parent fetched the chunk but it is not in the store"))
		}
	}
}

// fetchRun fetches one run in one range request, checks and stores each
// chunk, and ends the chunks' flights.
func (c *ChunkReader) fetchRun(ctx context.Context, run []*chunk) {
	errs := make([]error, len(run))
	defer c.endFlights(run, errs)
	fail := func(err error) {
		for i := range errs {
			if errs[i] == nil {
				errs[i] = err
			}
		}
	}
	ra, err := c.remote(ctx)
	if err != nil {
		fail(c.eio(run[0], err))
		return
	}
	start, end := run[0].ent.Offset, run[0].end
	for _, ch := range run {
		end = max(end, ch.end)
	}
	if end-start > maxMemberBytes || end <= start {
		fail(c.eio(run[0], fmt.Errorf("compressed range [%d, %d) of a chunk is implausible", start, end)))
		return
	}
	select {
	case c.im.fsem <- struct{}{}:
	case <-ctx.Done():
		fail(c.eio(run[0], ctx.Err()))
		return
	}
	t0 := time.Now()
	data, err := ra.Range(ctx, start, end-start)
	<-c.im.fsem
	if err != nil {
		fail(c.eio(run[0], err))
		return
	}
	// Inflated chunks are stored in batches (one flush each), at most
	// maxBatchBytes of them held at once.
	var batch []store.Blob
	var idx []int
	held := int64(0)
	flush := func() {
		if len(batch) == 0 {
			return
		}
		perr, err := c.im.st.PutMany(ctx, batch)
		for k, i := range idx {
			switch {
			case err != nil:
				errs[i] = c.eio(run[i], err)
			case perr[k] != nil:
				c.im.warnBadChunk(c.layer.Digest, run[i].digest, perr[k])
				errs[i] = c.eio(run[i], perr[k])
			}
		}
		batch, idx, held = batch[:0], idx[:0], 0
	}
	for i, ch := range run {
		buf, err := c.inflate(ch, data[ch.ent.Offset-start:ch.end-start])
		if err != nil {
			errs[i] = err
			continue
		}
		if held+int64(len(buf)) > maxBatchBytes {
			flush()
		}
		batch, idx, held = append(batch, store.Blob{Digest: ch.digest, Data: buf}), append(idx, i), held+int64(len(buf))
	}
	flush()
	c.im.opts.Logger.Debug("image: fetched chunks", "layer", c.layer.Digest.Encoded()[:12],
		"chunks", len(run), "bytes", end-start, "took", time.Since(t0))
}

// inflate returns one chunk's bytes out of its gzip member, unchecked
// (the store checks them against the chunk's digest).
func (c *ChunkReader) inflate(ch *chunk, member []byte) ([]byte, error) {
	zr, err := gzip.NewReader(bytes.NewReader(member))
	if err != nil {
		return nil, c.eio(ch, fmt.Errorf("chunk's gzip member: %v", err))
	}
	zr.Multistream(false)
	if _, err := io.CopyN(io.Discard, zr, ch.ent.InnerOffset); err != nil {
		return nil, c.eio(ch, fmt.Errorf("chunk's gzip member: %v", err))
	}
	buf := make([]byte, ch.size)
	if _, err := io.ReadFull(zr, buf); err != nil {
		// A corrupt member may fail to inflate before its digest is known.
		return nil, c.eio(ch, &store.DigestError{Want: ch.digest, WantSize: ch.size, GotSize: -1})
	}
	return buf, nil
}

// remote returns the layer's blob fetcher, made on first use.
func (c *ChunkReader) remote(ctx context.Context) (rangeReader, error) {
	c.bmu.Lock()
	defer c.bmu.Unlock()
	if c.blob != nil {
		return c.blob, nil
	}
	b, err := c.im.blob(ctx, c.rr, c.layer.Digest, c.layer.Size)
	if err != nil {
		return nil, err
	}
	c.blob = b
	return b, nil
}

// eio wraps err as the guest must see it: EIO, naming the file and chunk.
func (c *ChunkReader) eio(ch *chunk, err error) error {
	return fmt.Errorf("image: layer %s: %q chunk at %d (%s): %w: %w",
		c.layer.Digest.Encoded()[:12], ch.file, ch.ent.ChunkOffset, ch.digest, syscall.EIO, err)
}

// warnBadChunk logs a chunk that failed its check, at most once a second:
// a registry (or a guest reading in a loop) can trigger it at will.
func (im *Images) warnBadChunk(layer, chunk digest.Digest, err error) {
	im.wmu.Lock()
	now := time.Now()
	if now.Sub(im.lastWarn) < time.Second {
		im.suppressed++
		im.wmu.Unlock()
		return
	}
	n := im.suppressed
	im.lastWarn, im.suppressed = now, 0
	im.wmu.Unlock()
	im.opts.Logger.Warn("image: chunk failed its check", "layer", layer, "chunk", chunk, "err", err, slog.Int("suppressed", n))
}

// ChunkFetcher fetches chunks of a lazy layer into the store on an Images'
// behalf (Options.Fetcher). A jailed VMM process has one: it reads the
// store through a read-only bind but can neither reach the registry nor
// write there, so its parent fetches for it (package image/chunkrpc; the
// parent's Root is a ChunkFetcher).
type ChunkFetcher interface {
	FetchChunks(ctx context.Context, req ChunkRequest) error
}

// MaxChunkRequest is the most chunks one ChunkRequest names.
const MaxChunkRequest = 1024

// ChunkRequest names chunks of one layer of one image, to be fetched into
// the store: plain data, as it crosses from a VMM process to its parent.
type ChunkRequest struct {
	Manifest digest.Digest `json:"manifest"`
	Layer    digest.Digest `json:"layer"`
	Chunks   []ChunkRef    `json:"chunks"`
}

// ChunkRef is one data entry of a layer's TOC: its gzip member's Offset
// and the InnerOffset of the chunk within it, and the chunk's digest.
type ChunkRef struct {
	Offset      int64         `json:"offset"`
	InnerOffset int64         `json:"innerOffset"`
	Digest      digest.Digest `json:"digest"`
}

// FetchChunks fetches the chunks req names into the store, as a read of
// them would: the request comes from a process that may be hostile (a
// jailed VMM process a guest took over), so it must name this root's
// image, one of its lazy layers and chunks of that layer's TOC, at most
// MaxChunkRequest of them; anything else is an error naming what is
// wrong. Chunks stored already cost nothing.
func (r *Root) FetchChunks(ctx context.Context, req ChunkRequest) error {
	if req.Manifest != r.Image.Manifest {
		return fmt.Errorf("image: chunk request for image %q: this root is %s", req.Manifest, r.Image.Manifest)
	}
	if n := len(req.Chunks); n == 0 || n > MaxChunkRequest {
		return fmt.Errorf("image: chunk request names %d chunks: want 1 to %d", n, MaxChunkRequest)
	}
	i := slices.IndexFunc(r.layers, func(l LayerReader) bool { return l.Layer.Digest == req.Layer })
	if i < 0 {
		return fmt.Errorf("image: chunk request: %q is not a layer of %s", req.Layer, r.Image.Name)
	}
	cr := r.layers[i].Chunks
	chs := make([]*chunk, 0, len(req.Chunks))
	for _, ref := range req.Chunks {
		ch := cr.ix.byKey[chunkKey{ref.Offset, ref.InnerOffset}]
		if ch == nil || ch.digest != ref.Digest {
			return fmt.Errorf("image: chunk request: offset %d+%d (%q) is not a chunk of layer %s", ref.Offset, ref.InnerOffset, ref.Digest, req.Layer.Encoded()[:12])
		}
		chs = append(chs, ch)
	}
	// The requester read ahead already, as far as it meant to.
	return cr.fetch(ctx, chs, false)
}
