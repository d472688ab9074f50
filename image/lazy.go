package image

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	"github.com/kilnvm/kiln/image/fetch"
	"github.com/opencontainers/go-digest"
)

// FetchStats counts the range requests an Images sent to registries for
// lazy layers (footers, TOCs and chunks; retries included) and the body
// bytes they brought.
type FetchStats = fetch.Stats

// Fetched returns what this Images has fetched lazily so far.
func (im *Images) Fetched() FetchStats { return im.fetched.Stats() }

// remoteRepo is a repository lazy layers come from.
type remoteRepo struct {
	repo  name.Repository
	plain bool // plain HTTP allowed
}

// repoOf is the repository an image's lazy layers come from.
func repoOf(img *Image) (remoteRepo, error) {
	if img.Repo == "" {
		return remoteRepo{}, fmt.Errorf("image: %s has lazy layers but no repository recorded", img.Name)
	}
	var opts []name.Option
	if img.PlainHTTP {
		opts = append(opts, name.Insecure)
	}
	r, err := name.NewRepository(img.Repo, opts...)
	if err != nil {
		return remoteRepo{}, fmt.Errorf("image: %s: repository %q: %w", img.Name, img.Repo, err)
	}
	return remoteRepo{repo: r, plain: img.PlainHTTP}, nil
}

// client returns the HTTP client for a repository, made once per Images:
// go-containerregistry's transport (auth from the default keychain, as
// Pull uses, and a pull-scoped token) inside an http.Client, so redirects
// to a CDN are followed.
func (im *Images) client(ctx context.Context, rr remoteRepo) (*http.Client, error) {
	key := fmt.Sprintf("%s plain=%v", rr.repo.Name(), rr.plain)
	im.cmu.Lock()
	defer im.cmu.Unlock()
	if c := im.clients[key]; c != nil {
		return c, nil
	}
	base := im.opts.Transport
	if base == nil {
		base = remote.DefaultTransport
	}
	rt := &guard{base: base, plainOK: rr.plain || isLoopback(rr.repo.RegistryStr())}
	auth, err := authn.DefaultKeychain.Resolve(rr.repo)
	if err != nil {
		return nil, fmt.Errorf("image: credentials for %s: %w", rr.repo, err)
	}
	// The ping under a deadline of its own: a dead registry must not hang
	// a read.
	pctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), im.fetchTimeout())
	defer cancel()
	tr, err := transport.NewWithContext(pctx, rr.repo.Registry, auth, rt, []string{rr.repo.Scope(transport.PullScope)})
	if err != nil {
		return nil, fmt.Errorf("image: registry %s: %w", rr.repo.RegistryStr(), err)
	}
	c := &http.Client{Transport: tr}
	im.clients[key] = c
	return c, nil
}

func (im *Images) fetchTimeout() time.Duration {
	if im.opts.FetchTimeout > 0 {
		return im.opts.FetchTimeout
	}
	return fetch.DefaultTimeout
}

// blob is the fetcher of one layer blob of rr.
func (im *Images) blob(ctx context.Context, rr remoteRepo, d digest.Digest, size int64) (*fetch.Blob, error) {
	c, err := im.client(ctx, rr)
	if err != nil {
		return nil, err
	}
	scheme := "https"
	if rr.plain || isLoopback(rr.repo.RegistryStr()) {
		scheme = rr.repo.Registry.Scheme()
	}
	return &fetch.Blob{
		Client:  c,
		URL:     fmt.Sprintf("%s://%s/v2/%s/blobs/%s", scheme, rr.repo.RegistryStr(), rr.repo.RepositoryStr(), d),
		Size:    size,
		Timeout: im.fetchTimeout(),
		Counter: &im.fetched,
	}, nil
}

// rangeReader reads byte ranges of a blob: a registry (fetch.Blob) or a
// local file.
type rangeReader interface {
	Range(ctx context.Context, off, n int64) ([]byte, error)
}

// tailBytes is how much of a blob's end the first request of openTOC
// fetches: the footer, and the whole TOC if it is small.
const tailBytes = 32 << 10

// openTOC reads an estargz blob's footer and TOC through ra and returns
// the TOC JSON and the TOC's offset in the blob, checked against want (the
// manifest's annotation). It reads at most two ranges: the blob's tail,
// then what of the TOC the tail did not hold.
func openTOC(ctx context.Context, ra rangeReader, size int64, want digest.Digest) ([]byte, int64, error) {
	if size < estargz.FooterSize {
		return nil, 0, fmt.Errorf("%w: blob of %d bytes is too small for an estargz footer", ErrInvalid, size)
	}
	tail := min(size, tailBytes)
	tb, err := ra.Range(ctx, size-tail, tail)
	if err != nil {
		return nil, 0, fmt.Errorf("reading the estargz footer: %w", err)
	}
	footer := int64(estargz.FooterSize)
	_, tocOff, _, err := (&estargz.GzipDecompressor{}).ParseFooter(tb[len(tb)-estargz.FooterSize:])
	if err != nil {
		// The legacy stargz footer is 47 bytes.
		const legacy = 47
		var lerr error
		_, tocOff, _, lerr = (&estargz.LegacyGzipDecompressor{}).ParseFooter(tb[len(tb)-legacy:])
		if lerr != nil {
			return nil, 0, fmt.Errorf("%w: not an estargz blob: footer: %v", ErrInvalid, errors.Join(err, lerr))
		}
		footer = legacy
	}
	if tocOff < 0 || tocOff >= size-footer {
		return nil, 0, fmt.Errorf("%w: estargz footer puts the TOC at %d in a blob of %d bytes", ErrInvalid, tocOff, size)
	}
	compLen := size - footer - tocOff
	if compLen > maxTOCBytes {
		return nil, 0, fmt.Errorf("%w: compressed TOC of %d bytes (at most %d)", ErrInvalid, compLen, maxTOCBytes)
	}
	var comp []byte
	if tailStart := size - tail; tocOff >= tailStart {
		comp = tb[tocOff-tailStart : int64(len(tb))-footer]
	} else {
		head, err := ra.Range(ctx, tocOff, tailStart-tocOff)
		if err != nil {
			return nil, 0, fmt.Errorf("reading the estargz TOC: %w", err)
		}
		comp = append(head, tb[:int64(len(tb))-footer]...)
	}
	rc, err := (&estargz.GzipDecompressor{}).DecompressTOC(bytes.NewReader(comp))
	if err != nil {
		return nil, 0, fmt.Errorf("%w: estargz TOC: %v", ErrInvalid, err)
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, maxTOCBytes+1))
	if err != nil {
		return nil, 0, fmt.Errorf("%w: estargz TOC: %v", ErrInvalid, err)
	}
	if len(data) > maxTOCBytes {
		return nil, 0, fmt.Errorf("%w: TOC JSON over %d bytes", ErrInvalid, maxTOCBytes)
	}
	if got := digest.FromBytes(data); got != want {
		return nil, 0, &TOCMismatchError{Want: want, Got: got}
	}
	return data, tocOff, nil
}

// TOCMismatchError: a layer's TOC does not hash to the digest its
// manifest annotation gives. It wraps ErrInvalid.
type TOCMismatchError struct {
	Layer     digest.Digest
	Want, Got digest.Digest
}

func (e *TOCMismatchError) Error() string {
	return fmt.Sprintf("layer %s: its TOC has digest %s, but the manifest's %s annotation says %s",
		e.Layer, e.Got, estargz.TOCJSONDigestAnnotation, e.Want)
}

func (e *TOCMismatchError) Unwrap() error { return ErrInvalid }

// putLazy records an estargz layer without fetching its blob: the footer
// and the TOC are read by range (the TOC only if the store lacks it),
// checked against the annotation, parsed and stored.
func (im *Images) putLazy(ctx context.Context, rr remoteRepo, rec *Layer, want digest.Digest, p *Progress, verb string) error {
	b, err := im.blob(ctx, rr, rec.Digest, rec.Size)
	if err != nil {
		return err
	}
	short := rec.Digest.Encoded()[:12]
	if off, ok := im.knownTOC(rec.Digest, want); ok {
		rec.TOC, rec.TOCOffset, rec.Chunks = want, off, ChunksRegistry
		p.Printf("%s %s: estargz, TOC already stored", verb, short)
		return nil
	}
	data, off, err := openTOC(ctx, b, rec.Size, want)
	if err != nil {
		var me *TOCMismatchError
		if errors.As(err, &me) {
			me.Layer = rec.Digest
			return err
		}
		return fmt.Errorf("layer %s: %w", rec.Digest, err)
	}
	if _, _, err := parseTOC(data, off); err != nil {
		return fmt.Errorf("%w: layer %s: %v", ErrInvalid, rec.Digest, err)
	}
	if _, err := im.st.PutSized(ctx, want, int64(len(data)), bytes.NewReader(data)); err != nil {
		return fmt.Errorf("layer %s: TOC: %w", rec.Digest, err)
	}
	rec.TOC, rec.TOCOffset, rec.Chunks = want, off, ChunksRegistry
	p.Printf("%s %s: estargz, TOC of %s; chunks on demand", verb, short, mib(int64(len(data))))
	return nil
}

// knownTOC finds the TOC offset of a lazy layer another record has, if its
// TOC is stored.
func (im *Images) knownTOC(layer, toc digest.Digest) (int64, bool) {
	if !im.st.Has(toc) {
		return 0, false
	}
	imgs, err := im.load()
	if err != nil {
		return 0, false
	}
	for _, img := range imgs {
		for _, l := range img.Layers {
			if l.Digest == layer && l.TOC == toc && l.Chunks == ChunksRegistry && l.TOCOffset > 0 {
				return l.TOCOffset, true
			}
		}
	}
	return 0, false
}
