// Package layoutblobs serves the blobs of an OCI image layout to
// go-containerregistry's pkg/registry from their files: the blob handler
// of the tests' and benchmarks' loopback registries.
package layoutblobs

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// Handler serves the blobs of an OCI image layout (Dir is its
// blobs/ folder: Dir/<alg>/<hex>) to go-containerregistry's pkg/registry,
// read-only and from their files: a push finds them present and uploads
// nothing, and a file is an io.ReaderAt, so a range is served without
// reading what precedes it. The tests' and benchmarks' loopback registries
// serve the test images so.
type Handler struct{ Dir string }

var (
	_ registry.BlobHandler     = Handler{}
	_ registry.BlobStatHandler = Handler{}
)

func (b Handler) path(h v1.Hash) (string, error) {
	if h.Algorithm != "sha256" || len(h.Hex) != 64 || strings.ContainsAny(h.Hex, "./") {
		return "", registry.ErrNotFound
	}
	return filepath.Join(b.Dir, h.Algorithm, h.Hex), nil
}

// Stat implements registry.BlobStatHandler.
func (b Handler) Stat(_ context.Context, _ string, h v1.Hash) (int64, error) {
	p, err := b.path(h)
	if err != nil {
		return 0, err
	}
	fi, err := os.Stat(p)
	if errors.Is(err, fs.ErrNotExist) {
		return 0, registry.ErrNotFound
	}
	if err != nil {
		return 0, err
	}
	return fi.Size(), nil
}

// Get implements registry.BlobHandler.
func (b Handler) Get(_ context.Context, _ string, h v1.Hash) (io.ReadCloser, error) {
	p, err := b.path(h)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(p)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, registry.ErrNotFound
	}
	return f, err
}
