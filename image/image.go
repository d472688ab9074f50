// Package image keeps OCI images in the host's store: it pulls them from
// registries and imports them from `docker save` tarballs and OCI image
// layouts, names them as users name them, lists, inspects, removes and
// converts them, and opens them for running, layer by layer.
//
// # Layout
//
// Under the images folder:
//
//	store/        an image/store.Store: manifests, indexes, configs, layer
//	              TOCs, and file chunks by their sha256
//	index.json    names -> manifest, config, layers (TOC digest, where the
//	              chunks are), repository, size, created
//	index.lock    flock(2)ed while index.json is rewritten
//
// index.json is replaced by a rename, so readers never see half of it;
// writers hold the lock, so two processes adding images at once both land.
// Every blob goes through store.PutSized, which checks its digest and size:
// content that does not match is refused.
//
// # Layers
//
// A layer is kept as a TOC (estargz's stargz.index.json form) and chunks,
// never as its compressed blob:
//
//   - An estargz layer of a pull (the manifest annotates it with
//     containerd.io/snapshot/stargz/toc.digest) is lazy: Pull reads only its
//     footer and TOC by HTTP range, checks the TOC against the annotation
//     and stores it. Chunks are fetched on first read (ChunkReader), checked
//     against their chunkDigest, and cached in the store; GC may evict them
//     under the store's cap, since they can be fetched again.
//   - Every other layer (plain gzip, zstd or uncompressed tar, and every
//     imported layer) is read whole once and indexed: each file is cut into
//     4 MiB chunks, as estargz cuts them, so a file stored by both kinds
//     of layer is stored once, and a TOC is written as estargz would write
//     it. GC keeps these chunks while the image is named: there is nothing
//     to refetch them from. The compressed blob is dropped: it would double
//     the storage, and Convert rebuilds the layer's tar from the TOC and
//     chunks instead.
//
// Chunks are shared by every image and layer, so two images sharing a base
// layer store its chunks once.
//
// Names are kept as the user typed them, for display, and matched by their
// canonical form (Normalize): "debian:bookworm" and
// "index.docker.io/library/debian:bookworm" are one image.
package image

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/google/go-containerregistry/pkg/authn"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/kilnvm/kiln/image/fetch"
	"github.com/kilnvm/kiln/image/store"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sync/singleflight"
)

// Errors that this package's errors wrap, for errors.Is.
var (
	// ErrInvalid: the input is malformed: a reference, a tarball, a layout,
	// a manifest, or a blob that does not match its digest in an import.
	ErrInvalid = errors.New("invalid image")
	// ErrNotFound: no image has that name, here or in the registry.
	ErrNotFound = errors.New("image not found")
)

// The platform picked from a multi-platform index.
const (
	wantOS   = "linux"
	wantArch = "amd64"
)

// Options configures Images.
type Options struct {
	Store store.Options
	// Transport carries registry requests; remote.DefaultTransport if nil.
	Transport http.RoundTripper
	// GCGrace: GC keeps unreferenced blobs used less than this long ago (a
	// pull in another process that has not yet named its image). 10 minutes
	// if zero; negative keeps none.
	GCGrace time.Duration
	// Keep, if set, keeps other blobs from GC (a sandbox's pins in another
	// process).
	Keep func(digest.Digest) bool
	// FetchTimeout bounds each request for a lazy layer's footer, TOC or
	// chunks (retries included): a registry that stalls fails the read
	// with an error wrapping context.DeadlineExceeded and syscall.EIO.
	// 30s if zero.
	FetchTimeout time.Duration
	// Fetcher, if set, fetches lazy layers' missing chunks into the store
	// instead of this process (a jailed VMM process's parent: see
	// ChunkFetcher); they are read from the store once it returns.
	Fetcher ChunkFetcher
	Logger  *slog.Logger
}

// maxConcurrentFetches bounds the range requests in flight per Images.
const maxConcurrentFetches = 8

// Images is the images folder: a store and an index of names.
type Images struct {
	dir  string
	st   *store.Store
	opts Options
	mu   sync.Mutex         // serialises index updates in this process
	sf   singleflight.Group // one fetch per layer in this process

	open     *openFiles    // stored chunks kept open between reads
	fetched  fetch.Counter // lazy range requests
	fsem     chan struct{} // bounds them
	fmu      sync.Mutex
	inflight map[digest.Digest]*flight // chunks being fetched
	cmu      sync.Mutex
	clients  map[string]*http.Client // per repository

	wmu        sync.Mutex // rate-limits warnings a registry can trigger
	lastWarn   time.Time
	suppressed int

	pmu  sync.Mutex
	pins map[digest.Digest]*imagePin // by manifest digest
}

// imagePin is an image some holders (open roots) keep from GC in this
// process: GC keeps what the image needs while it has a holder.
type imagePin struct {
	img     *Image
	holders map[string]bool
}

// Layer is one layer of an image, as its manifest describes it, and where
// its files' bytes come from.
type Layer struct {
	Digest    digest.Digest `json:"digest"`
	Size      int64         `json:"size"`
	MediaType string        `json:"mediaType,omitempty"`
	// TOC is the digest of the layer's TOC JSON, kept in the store: the
	// estargz TOC of a lazy layer, the one indexing wrote for the others.
	TOC digest.Digest `json:"toc,omitempty"`
	// Chunks says where the chunks the TOC names are: ChunksRegistry or
	// ChunksStore. Empty in records of an older kiln, which stored layers
	// whole: such an image must be pulled again to run.
	Chunks string `json:"chunks,omitempty"`
	// TOCOffset is where the TOC starts in a lazy layer's blob: the end of
	// its last chunk's gzip member.
	TOCOffset int64 `json:"tocOffset,omitempty"`
}

// Where a layer's chunks come from.
const (
	// ChunksRegistry: an estargz layer; chunks are fetched from the
	// image's registry on first read and cached in the store, which may
	// evict them.
	ChunksRegistry = "registry"
	// ChunksStore: a layer indexed when it was pulled or imported; every
	// chunk is in the store and GC keeps them while the image is named.
	// The layer's blob itself is not kept.
	ChunksStore = "store"
)

// Image is an entry of the index.
type Image struct {
	Name      string        `json:"name"`            // as the user typed it
	Ref       string        `json:"ref"`             // canonical (Normalize)
	Index     digest.Digest `json:"index,omitempty"` // the multi-platform index it was picked from
	Manifest  digest.Digest `json:"manifest"`
	MediaType string        `json:"mediaType,omitempty"`
	Config    digest.Digest `json:"config"`
	Layers    []Layer       `json:"layers"`
	Size      int64         `json:"size"`             // manifest, config and layers (compressed)
	Created   time.Time     `json:"created,omitzero"` // from the config
	Added     time.Time     `json:"added"`
	Source    string        `json:"source,omitempty"` // registry or file it came from
	// Repo is the repository lazy layers are fetched from
	// ("registry/path/name"); PlainHTTP allows plain HTTP to it (--insecure
	// at pull time, or a loopback registry).
	Repo      string `json:"repo,omitempty"`
	PlainHTTP bool   `json:"plainHTTP,omitempty"`
}

// lazy reports whether some layer's chunks come from the registry.
func (img *Image) lazy() bool {
	for _, l := range img.Layers {
		if l.Chunks == ChunksRegistry {
			return true
		}
	}
	return false
}

// stale reports whether the record is from an older kiln (layers stored
// whole, no TOCs).
func (img *Image) stale() bool {
	for _, l := range img.Layers {
		if l.Chunks == "" {
			return true
		}
	}
	return false
}

// blobs lists the blobs the image's record names: manifest, config, index,
// TOCs, and the whole layers of an older kiln's records. (Chunks are named
// by the TOCs.)
func (img *Image) blobs() []digest.Digest {
	ds := []digest.Digest{img.Manifest, img.Config}
	if img.Index != "" {
		ds = append(ds, img.Index)
	}
	for _, l := range img.Layers {
		if l.Chunks == "" {
			ds = append(ds, l.Digest)
		}
		if l.TOC != "" {
			ds = append(ds, l.TOC)
		}
	}
	return ds
}

// Open opens (creating if needed) the images folder dir.
func Open(dir string, opts Options) (*Images, error) {
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	if opts.Store.Logger == nil {
		opts.Store.Logger = opts.Logger
	}
	if opts.GCGrace == 0 {
		opts.GCGrace = 10 * time.Minute
	}
	st, err := store.Open(filepath.Join(dir, "store"), opts.Store)
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	return &Images{
		dir: dir, st: st, opts: opts,
		open:     newOpenFiles(),
		fsem:     make(chan struct{}, maxConcurrentFetches),
		inflight: map[digest.Digest]*flight{},
		clients:  map[string]*http.Client{},
		pins:     map[digest.Digest]*imagePin{},
	}, nil
}

// Store is the blob store under the images folder.
func (im *Images) Store() *store.Store { return im.st }

// Dir is the images folder.
func (im *Images) Dir() string { return im.dir }

// PullOptions configures a Pull.
type PullOptions struct {
	// Insecure allows plain HTTP (and HTTPS without a verified certificate
	// is still refused). Loopback registries are always plain HTTP.
	Insecure bool
	Progress *Progress // nil: no progress
}

// Pull fetches ref from its registry (linux/amd64 from a multi-platform
// index) into the store and names it ref. Layers already stored are not
// fetched.
func (im *Images) Pull(ctx context.Context, ref string, opts PullOptions) (*Image, error) {
	r, err := parseRef(ref)
	if err != nil {
		return nil, err
	}
	if opts.Insecure && !isLoopback(r.Context().RegistryStr()) {
		r, err = parseInsecure(ref)
		if err != nil {
			return nil, err
		}
	}
	loop := isLoopback(r.Context().RegistryStr())
	base := im.opts.Transport
	if base == nil {
		base = remote.DefaultTransport
	}
	rt := &guard{base: base, plainOK: opts.Insecure || loop}
	ropts := []remote.Option{
		remote.WithContext(ctx),
		remote.WithTransport(rt),
		remote.WithAuthFromKeychain(authn.DefaultKeychain),
		remote.WithPlatform(v1.Platform{OS: wantOS, Architecture: wantArch}),
		remote.WithUserAgent("kiln"),
	}
	desc, err := remote.Get(r, ropts...)
	if err != nil {
		return nil, pullError(ref, err)
	}
	var img v1.Image
	var want v1.Descriptor
	var indexes []rawBlob
	if desc.MediaType.IsIndex() {
		idx, err := desc.ImageIndex()
		if err != nil {
			return nil, pullError(ref, err)
		}
		img, want, indexes, err = fromIndex(idx, desc.Digest, true, 0)
		if err != nil {
			return nil, fmt.Errorf("image: %s: %w", ref, err)
		}
	} else {
		img, err = desc.Image()
		if err != nil {
			return nil, pullError(ref, err)
		}
		want = desc.Descriptor
	}
	rr := &remoteRepo{repo: r.Context(), plain: opts.Insecure || loop}
	rec, err := im.put(ctx, img, want, indexes, opts.Progress, "pulling", rr)
	if err != nil {
		return nil, fmt.Errorf("image: pulling %s: %w", ref, err)
	}
	rec.Name, rec.Ref, rec.Source = ref, r.Name(), r.Context().RegistryStr()
	rec.Repo, rec.PlainHTTP = r.Context().Name(), rr.plain
	if err := im.add(rec); err != nil {
		return nil, err
	}
	return rec, nil
}

// pullError says what a registry error means: an unknown name or tag is
// ErrNotFound; the rest is a failed pull.
func pullError(ref string, err error) error {
	var te *transport.Error
	if errors.As(err, &te) {
		if te.StatusCode == http.StatusNotFound {
			return fmt.Errorf("image: %s: %w in its registry: %v", ref, ErrNotFound, err)
		}
		for _, d := range te.Errors {
			if d.Code == transport.ManifestUnknownErrorCode || d.Code == transport.NameUnknownErrorCode {
				return fmt.Errorf("image: %s: %w in its registry: %v", ref, ErrNotFound, err)
			}
		}
	}
	return fmt.Errorf("image: pulling %s: %w", ref, err)
}

// guard refuses plain HTTP unless it is allowed (go-containerregistry
// would otherwise fall back to it for private addresses).
type guard struct {
	base    http.RoundTripper
	plainOK bool
}

func (g *guard) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Scheme == "http" && !g.plainOK && !isLoopback(req.URL.Host) {
		return nil, fmt.Errorf("refusing plain HTTP to %s (use --insecure)", req.URL.Host)
	}
	return g.base.RoundTrip(req)
}

// rawBlob is a manifest stored as it is (an index an image was picked
// from).
type rawBlob struct {
	desc v1.Descriptor
	data []byte
}

// fromIndex picks linux/amd64 from idx (recursing into nested indexes) and
// returns it with its descriptor and the indexes to store (store: whether
// idx itself is a blob; an OCI layout's index.json is not).
func fromIndex(idx v1.ImageIndex, d v1.Hash, storeIt bool, depth int) (v1.Image, v1.Descriptor, []rawBlob, error) {
	if depth > 4 {
		return nil, v1.Descriptor{}, nil, fmt.Errorf("%w: indexes nested more than 4 deep", ErrInvalid)
	}
	raw, err := idx.RawManifest()
	if err != nil {
		return nil, v1.Descriptor{}, nil, err
	}
	m, err := v1.ParseIndexManifest(bytes.NewReader(raw))
	if err != nil {
		return nil, v1.Descriptor{}, nil, fmt.Errorf("%w: index %s: %v", ErrInvalid, d, err)
	}
	var blobs []rawBlob
	if storeIt {
		blobs = append(blobs, rawBlob{desc: v1.Descriptor{Digest: d, Size: int64(len(raw))}, data: raw})
	}
	child, err := pickPlatform(m)
	if err != nil {
		return nil, v1.Descriptor{}, nil, fmt.Errorf("index %s: %w", d, err)
	}
	if child.MediaType.IsIndex() {
		sub, err := idx.ImageIndex(child.Digest)
		if err != nil {
			return nil, v1.Descriptor{}, nil, err
		}
		img, desc, more, err := fromIndex(sub, child.Digest, true, depth+1)
		return img, desc, append(blobs, more...), err
	}
	img, err := idx.Image(child.Digest)
	if err != nil {
		return nil, v1.Descriptor{}, nil, err
	}
	return img, child, blobs, nil
}

// pickPlatform chooses linux/amd64 among an index's manifests; an index of
// one manifest without a platform (common in OCI layouts) gives that one.
func pickPlatform(m *v1.IndexManifest) (v1.Descriptor, error) {
	var cands []v1.Descriptor
	for _, d := range m.Manifests {
		if d.MediaType.IsImage() || d.MediaType.IsIndex() {
			cands = append(cands, d)
		}
	}
	for _, d := range cands {
		if d.Platform != nil && d.Platform.OS == wantOS && d.Platform.Architecture == wantArch {
			return d, nil
		}
	}
	if len(cands) == 1 && cands[0].Platform == nil {
		return cands[0], nil
	}
	var have []string
	for _, d := range cands {
		if d.Platform != nil {
			have = append(have, d.Platform.String())
		}
	}
	if len(cands) == 0 {
		return v1.Descriptor{}, fmt.Errorf("%w: the index lists no image manifests", ErrInvalid)
	}
	return v1.Descriptor{}, fmt.Errorf("%w: no %s/%s image in the index (it has %s)", ErrNotFound, wantOS, wantArch, strings.Join(have, ", "))
}

// put stores an image's blobs: indexes, the manifest (checked against want),
// its config, and its layers (each checked against its descriptor): an
// estargz layer of a pull (rr set) by its TOC only, every other layer
// indexed into chunks. Layers already indexed or TOCs already stored are
// not fetched again.
func (im *Images) put(ctx context.Context, img v1.Image, want v1.Descriptor, indexes []rawBlob, p *Progress, verb string, rr *remoteRepo) (*Image, error) {
	for _, b := range indexes {
		if err := im.putBytes(ctx, b.desc.Digest.String(), b.desc.Size, b.data, "index"); err != nil {
			return nil, err
		}
	}
	raw, err := img.RawManifest()
	if err != nil {
		return nil, err
	}
	if err := im.putBytes(ctx, want.Digest.String(), int64(len(raw)), raw, "manifest"); err != nil {
		return nil, err
	}
	m, err := v1.ParseManifest(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("%w: manifest %s: %v", ErrInvalid, want.Digest, err)
	}
	mt := m.MediaType
	if mt == "" {
		mt = want.MediaType
	}
	if mt != "" && !mt.IsImage() {
		return nil, fmt.Errorf("%w: manifest %s has media type %q, not an image manifest", ErrInvalid, want.Digest, mt)
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", m.Config.Digest, err)
	}
	if err := im.putBytes(ctx, m.Config.Digest.String(), m.Config.Size, cfg, "config"); err != nil {
		return nil, err
	}
	cf, err := v1.ParseConfigFile(bytes.NewReader(cfg))
	if err != nil {
		return nil, fmt.Errorf("%w: config %s: %v", ErrInvalid, m.Config.Digest, err)
	}
	rec := &Image{
		Manifest:  digest.Digest(want.Digest.String()),
		MediaType: string(mt),
		Config:    digest.Digest(m.Config.Digest.String()),
		Size:      int64(len(raw)) + m.Config.Size,
		Created:   cf.Created.UTC(),
		Added:     now(),
	}
	if len(indexes) > 0 {
		rec.Index = digest.Digest(indexes[0].desc.Digest.String())
	}
	for i, l := range m.Layers {
		d, err := store.ParseDigest(l.Digest.String())
		if err != nil {
			return nil, fmt.Errorf("%w: manifest %s: layer: %v", ErrInvalid, want.Digest, err)
		}
		if l.Size < 0 {
			return nil, fmt.Errorf("%w: manifest %s: layer %s has size %d", ErrInvalid, want.Digest, d, l.Size)
		}
		var diffID digest.Digest
		if len(cf.RootFS.DiffIDs) == len(m.Layers) {
			diffID = digest.Digest(cf.RootFS.DiffIDs[i].String())
		}
		lr := Layer{Digest: d, Size: l.Size, MediaType: string(l.MediaType)}
		if err := im.putLayer(ctx, img, l, &lr, diffID, p, verb, rr); err != nil {
			return nil, err
		}
		rec.Layers = append(rec.Layers, lr)
		rec.Size += l.Size
	}
	return rec, nil
}

// putBytes stores a small blob held in memory.
func (im *Images) putBytes(ctx context.Context, dgst string, size int64, data []byte, what string) error {
	d, err := store.ParseDigest(dgst)
	if err != nil {
		return fmt.Errorf("%w: %s: %v", ErrInvalid, what, err)
	}
	if _, err := im.st.PutSized(ctx, d, size, bytes.NewReader(data)); err != nil {
		return fmt.Errorf("%s %s: %w", what, d, err)
	}
	return nil
}

// putLayer fills in rec for one layer: lazily (an estargz layer of a pull)
// or by indexing it. Concurrent calls for one layer in this process do the
// work once.
func (im *Images) putLayer(ctx context.Context, img v1.Image, l v1.Descriptor, rec *Layer, diffID digest.Digest, p *Progress, verb string, rr *remoteRepo) error {
	if ann, ok := l.Annotations[estargz.TOCJSONDigestAnnotation]; ok && rr != nil {
		toc, err := store.ParseDigest(ann)
		if err != nil {
			return fmt.Errorf("%w: layer %s: %s annotation: %v", ErrInvalid, rec.Digest, estargz.TOCJSONDigestAnnotation, err)
		}
		v, err, _ := im.sf.Do("lazy "+string(rec.Digest)+" "+string(toc), func() (any, error) {
			r := *rec
			err := im.putLazy(ctx, *rr, &r, toc, p, verb)
			return r, err
		})
		if err != nil {
			return err
		}
		*rec = v.(Layer)
		return nil
	}
	short := rec.Digest.Encoded()[:12]
	if got, ok := im.knownIndexed(rec.Digest); ok {
		rec.TOC, rec.Chunks = got.TOC, ChunksStore
		p.Printf("%s %s: already stored", verb, short)
		return nil
	}
	v, err, _ := im.sf.Do("index "+string(rec.Digest), func() (any, error) {
		if got, ok := im.knownIndexed(rec.Digest); ok {
			return got.TOC, nil
		}
		layer, err := img.LayerByDigest(l.Digest)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", rec.Digest, err)
		}
		t := p.start(verb, short, l.Size)
		ix, err := im.indexLayer(ctx, layer, rec, diffID, t, rr != nil)
		t.done(err)
		if err != nil {
			return nil, fmt.Errorf("layer %s: %w", rec.Digest, err)
		}
		return ix.tocDgt, nil
	})
	if err != nil {
		return err
	}
	rec.TOC, rec.Chunks = v.(digest.Digest), ChunksStore
	return nil
}

// indexLayer reads a layer whole, once, and indexes it (indexTar). From a
// registry (compressed true) the compressed bytes are read and checked
// against the layer's digest and size; from a file, the uncompressed
// stream is read and checked against the config's diff ID, which the
// manifest's checked config names.
func (im *Images) indexLayer(ctx context.Context, layer v1.Layer, rec *Layer, diffID digest.Digest, t *transfer, compressed bool) (*indexed, error) {
	var src io.ReadCloser
	var err error
	var hash *digestCounter
	var tee io.Reader
	if compressed {
		var rc io.ReadCloser
		if rc, err = layer.Compressed(); err != nil {
			return nil, err
		}
		defer rc.Close()
		hash = newDigestCounter()
		tee = io.TeeReader(t.reader(rc), hash)
		src, err = decompress(tee)
	} else {
		if diffID == "" {
			return nil, fmt.Errorf("%w: the config gives no diff ID for it", ErrInvalid)
		}
		var rc io.ReadCloser
		if rc, err = layer.Uncompressed(); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		defer rc.Close()
		src = io.NopCloser(t.reader(rc))
	}
	if err != nil {
		return nil, err
	}
	defer src.Close()
	ix, err := indexTar(ctx, im.st, src)
	if err != nil {
		return nil, err
	}
	if hash != nil {
		// The rest of the blob (gzip trailer, padding) is part of its digest.
		if _, err := io.Copy(io.Discard, src); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
		if _, err := io.Copy(io.Discard, tee); err != nil {
			return nil, err
		}
		if got, n := hash.sum(); got != rec.Digest || n != rec.Size {
			return nil, &store.DigestError{Want: rec.Digest, Got: got, WantSize: rec.Size, GotSize: n}
		}
	}
	if diffID != "" && ix.diffID != diffID {
		return nil, fmt.Errorf("%w: uncompressed content has digest %s, the config's diff ID is %s", ErrInvalid, ix.diffID, diffID)
	}
	if _, err := im.st.PutSized(ctx, ix.tocDgt, int64(len(ix.toc)), bytes.NewReader(ix.toc)); err != nil {
		return nil, fmt.Errorf("storing its TOC: %w", err)
	}
	return ix, nil
}

// knownIndexed finds a record of layer d indexed into the store whose TOC
// and chunks are all still there.
func (im *Images) knownIndexed(d digest.Digest) (Layer, bool) {
	imgs, err := im.load()
	if err != nil {
		return Layer{}, false
	}
	for _, img := range imgs {
		for _, l := range img.Layers {
			if l.Digest != d || l.Chunks != ChunksStore || !im.st.Has(l.TOC) {
				continue
			}
			_, ix, err := im.readTOC(l)
			if err != nil {
				continue
			}
			all := true
			for _, c := range ix.chunks {
				if !im.st.Has(c.digest) {
					all = false
					break
				}
			}
			if all {
				return l, true
			}
		}
	}
	return Layer{}, false
}

// add names an image in the index, replacing what the name meant before.
func (im *Images) add(rec *Image) error {
	if err := rec.check(); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	return im.update(func(imgs []Image) ([]Image, error) {
		imgs = slices.DeleteFunc(imgs, func(i Image) bool { return i.Ref == rec.Ref })
		return append(imgs, *rec), nil
	})
}

// List returns the images, sorted by name.
func (im *Images) List() ([]Image, error) {
	imgs, err := im.load()
	if err != nil {
		return nil, err
	}
	sort.Slice(imgs, func(i, j int) bool { return imgs[i].Name < imgs[j].Name })
	return imgs, nil
}

// Get returns the image with this name: matched by canonical form, then as
// typed, then by manifest digest.
func (im *Images) Get(name string) (*Image, error) {
	imgs, err := im.load()
	if err != nil {
		return nil, err
	}
	i, err := find(imgs, name)
	if err != nil {
		return nil, err
	}
	return &imgs[i], nil
}

func find(imgs []Image, name string) (int, error) {
	ref, nerr := Normalize(name)
	for i := range imgs {
		if nerr == nil && imgs[i].Ref == ref {
			return i, nil
		}
	}
	for i := range imgs {
		if imgs[i].Name == name {
			return i, nil
		}
	}
	if _, err := store.ParseDigest(name); err == nil {
		for i := range imgs {
			if string(imgs[i].Manifest) == name {
				return i, nil
			}
		}
	}
	if nerr != nil {
		return -1, fmt.Errorf("image: %w", nerr)
	}
	return -1, fmt.Errorf("image: %w: no image named %q (kiln image ls lists them)", ErrNotFound, name)
}

// Remove drops name from the index. Its blobs stay in the store until GC,
// which removes those no other image references.
func (im *Images) Remove(name string) (*Image, error) {
	var gone Image
	err := im.update(func(imgs []Image) ([]Image, error) {
		i, err := find(imgs, name)
		if err != nil {
			return nil, err
		}
		gone = imgs[i]
		return slices.Delete(imgs, i, i+1), nil
	})
	if err != nil {
		return nil, err
	}
	return &gone, nil
}

// Details is what Inspect shows.
type Details struct {
	Image
	Platform string `json:"platform,omitempty"`
	Config   Config `json:"config"`
}

// Config is the part of an image's config a sandbox uses.
type Config struct {
	Env        []string          `json:"env,omitempty"`
	WorkingDir string            `json:"workingDir,omitempty"`
	User       string            `json:"user,omitempty"`
	Entrypoint []string          `json:"entrypoint,omitempty"`
	Cmd        []string          `json:"cmd,omitempty"`
	Labels     map[string]string `json:"labels,omitempty"`
}

// maxConfigBytes bounds a config read back from the store.
const maxConfigBytes = 16 << 20

// Inspect returns an image's index entry and its config, read from the
// store and checked against its digest.
func (im *Images) Inspect(name string) (*Details, error) {
	img, err := im.Get(name)
	if err != nil {
		return nil, err
	}
	f, size, err := im.st.OpenVerified(img.Config)
	if err != nil {
		return nil, fmt.Errorf("image: %s: config: %w", name, err)
	}
	defer f.Close()
	if size > maxConfigBytes {
		return nil, fmt.Errorf("image: %s: config of %d bytes", name, size)
	}
	cf, err := v1.ParseConfigFile(io.LimitReader(f, maxConfigBytes))
	if err != nil {
		return nil, fmt.Errorf("image: %s: config %s: %w", name, img.Config, err)
	}
	d := &Details{Image: *img, Config: Config{
		Env:        cf.Config.Env,
		WorkingDir: cf.Config.WorkingDir,
		User:       cf.Config.User,
		Entrypoint: cf.Config.Entrypoint,
		Cmd:        cf.Config.Cmd,
		Labels:     cf.Config.Labels,
	}}
	if cf.OS != "" {
		d.Platform = cf.OS + "/" + cf.Architecture
	}
	return d, nil
}
