package image

import (
	"context"
	"encoding/hex"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/kilnvm/kiln/erofs"
	"github.com/kilnvm/kiln/image/tree"
)

// Root is an image opened as a sandbox's root: its layers merged into one
// read-only tree (tree.Tree, which a 9p device serves), with what it needs
// pinned in this process's store until Close.
type Root struct {
	Image *Image
	Tree  *tree.Tree

	im     *Images
	layers []LayerReader // FetchChunks
	holder string
	once   sync.Once

	layoutMu sync.Mutex
	layout   *erofs.Image
}

// EROFS returns the root's tree laid out as an EROFS filesystem (package
// erofs: the metadata in memory, file data read from the tree), built on
// the first call that succeeds and shared by every disk that serves the
// root. It implements virtio.EROFSLayout. The layout depends only on the
// tree, so an image gives the same bytes in every process.
func (r *Root) EROFS(ctx context.Context) (*erofs.Image, error) {
	r.layoutMu.Lock()
	defer r.layoutMu.Unlock()
	if r.layout != nil {
		return r.layout, nil
	}
	var uuid [16]byte
	if b, err := hex.DecodeString(r.Image.Manifest.Encoded()); err == nil {
		copy(uuid[:], b)
	}
	start := time.Now()
	l, err := erofs.Build(ctx, r.Tree, erofs.Options{VolumeName: "kiln-image", UUID: uuid, Logger: r.im.opts.Logger})
	if err != nil {
		return nil, fmt.Errorf("image: %s: %w", r.Image.Name, err)
	}
	if log := r.im.opts.Logger; log != nil {
		log.Debug("image laid out as erofs", "image", r.Image.Name, "inodes", l.Inodes(),
			"metadata_bytes", l.MetadataSize(), "bytes", l.Size(), "took", time.Since(start))
	}
	r.layout = l
	return l, nil
}

// OpenRoot opens the image name (a name as Get takes it, or a manifest
// digest) for running: its layers' TOCs from the store, merged. It reads
// no registry: chunks are fetched on first read.
func (im *Images) OpenRoot(ctx context.Context, name string) (*Root, error) {
	img, err := im.Get(name)
	if err != nil {
		return nil, err
	}
	layers, err := im.Layers(ctx, img)
	if err != nil {
		return nil, err
	}
	tl := make([]tree.Layer, len(layers))
	for i, l := range layers {
		tl[i] = tree.Layer{TOC: l.TOC, Chunks: l.Chunks}
	}
	t, err := tree.Build(tl, tree.Options{Name: img.Name, Logger: im.opts.Logger})
	if err != nil {
		return nil, fmt.Errorf("image: %s: %w", img.Name, err)
	}
	// The tree holds what it needs of the TOCs: let the rest go (half of
	// the entries are directories, links and the like; each data entry
	// keeps only what reads and fetches use). Nothing else holds them.
	for i := range layers {
		layers[i].TOC = nil
		layers[i].Chunks.ix.slim()
	}
	holder := fmt.Sprintf("root-%p", t)
	if err := im.Pin(img, holder); err != nil {
		return nil, fmt.Errorf("image: %s: %w", img.Name, err)
	}
	return &Root{Image: img, Tree: t, im: im, layers: layers, holder: holder}, nil
}

// Close releases the root's pins. The tree stays readable (a device that
// still holds it reads what the store keeps).
func (r *Root) Close() error {
	r.once.Do(func() { r.im.Unpin(r.Image, r.holder) })
	return nil
}

// Roots shares opened roots: one tree per images folder and manifest
// digest, open while any sandbox holds it, so that a hundred clones of one
// sandbox merge its layers once. It opens each folder once, with the
// Options it was made with. Safe for concurrent use.
type Roots struct {
	opts Options
	mu   sync.Mutex
	ims  map[string]*Images
	open map[rootKey]*sharedRoot
}

type rootKey struct {
	dir      string
	manifest digest.Digest
}

type sharedRoot struct {
	root *Root
	refs int
}

// NewRoots returns an empty Roots whose folders open with opts.
func NewRoots(opts Options) *Roots {
	return &Roots{opts: opts, ims: map[string]*Images{}, open: map[rootKey]*sharedRoot{}}
}

// Images returns the images folder dir, opened once.
func (rs *Roots) Images(dir string) (*Images, error) {
	rs.mu.Lock()
	defer rs.mu.Unlock()
	return rs.images(dir)
}

func (rs *Roots) images(dir string) (*Images, error) {
	dir = filepath.Clean(dir)
	if im, ok := rs.ims[dir]; ok {
		return im, nil
	}
	im, err := Open(dir, rs.opts)
	if err != nil {
		return nil, err
	}
	rs.ims[dir] = im
	return im, nil
}

// Open returns the root of the image with manifest digest manifest in the
// images folder dir, and a closer that releases this hold on it; the
// root is closed when the last hold is released.
func (rs *Roots) Open(ctx context.Context, dir string, manifest digest.Digest) (*Root, func() error, error) {
	if err := manifest.Validate(); err != nil {
		return nil, nil, fmt.Errorf("image: manifest digest %q: %w", manifest, err)
	}
	rs.mu.Lock()
	defer rs.mu.Unlock()
	key := rootKey{filepath.Clean(dir), manifest}
	sr, ok := rs.open[key]
	if !ok {
		im, err := rs.images(dir)
		if err != nil {
			return nil, nil, err
		}
		r, err := im.OpenRoot(ctx, string(manifest))
		if err != nil {
			return nil, nil, err
		}
		if r.Image.Manifest != manifest {
			r.Close()
			return nil, nil, fmt.Errorf("image: %s is %s, not %s", r.Image.Name, r.Image.Manifest, manifest)
		}
		sr = &sharedRoot{root: r}
		rs.open[key] = sr
	}
	sr.refs++
	var once sync.Once
	release := func() error {
		once.Do(func() {
			rs.mu.Lock()
			defer rs.mu.Unlock()
			if sr.refs--; sr.refs == 0 {
				delete(rs.open, key)
				sr.root.Close()
			}
		})
		return nil
	}
	return sr.root, release, nil
}
