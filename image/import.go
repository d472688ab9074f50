package image

import (
	"archive/tar"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// ImportOptions configures an Import.
type ImportOptions struct {
	// Name names the image; by default the tarball's first RepoTag or the
	// layout's image name annotation, else its manifest digest.
	Name     string
	Progress *Progress
}

// OCI annotations naming an image in a layout.
const (
	annotRefName        = "org.opencontainers.image.ref.name"
	annotContainerdName = "io.containerd.image.name"
)

// Import adds the image at path: a `docker save` tarball, or an OCI image
// layout as a directory or a tar. From a multi-platform layout it takes
// linux/amd64. Anything malformed gives an error wrapping ErrInvalid that
// names the problem.
func (im *Images) Import(ctx context.Context, path string, opts ImportOptions) (*Image, error) {
	if opts.Name != "" {
		if _, err := Normalize(opts.Name); err != nil {
			return nil, err
		}
	}
	fi, err := os.Stat(path)
	if err != nil {
		return nil, fmt.Errorf("image: import: %w", err)
	}
	var rec *Image
	var named string
	if fi.IsDir() {
		rec, named, err = im.importLayout(ctx, path, opts)
	} else {
		rec, named, err = im.importTar(ctx, path, opts)
	}
	if err != nil {
		if !errors.Is(err, ErrInvalid) && !errors.Is(err, ErrNotFound) && ctx.Err() == nil && !isStoreIO(err) {
			err = fmt.Errorf("%w: %w", ErrInvalid, err)
		}
		return nil, fmt.Errorf("image: import %s: %w", path, err)
	}
	name := opts.Name
	if name == "" {
		name = named
	}
	if name == "" {
		name = string(rec.Manifest)
	}
	ref, err := Normalize(name)
	if err != nil {
		// A name in the file that is not a reference: fall back to the digest.
		name, ref = string(rec.Manifest), string(rec.Manifest)
	}
	rec.Name, rec.Ref = name, ref
	if abs, err := filepath.Abs(path); err == nil {
		rec.Source = abs
	}
	if err := im.add(rec); err != nil {
		return nil, err
	}
	return rec, nil
}

// isStoreIO reports an error of the host, not of the input (a full disk).
func isStoreIO(err error) bool {
	var pe *fs.PathError
	return errors.As(err, &pe) && strings.Contains(pe.Path, string(filepath.Separator)+"store"+string(filepath.Separator))
}

func (im *Images) importLayout(ctx context.Context, dir string, opts ImportOptions) (*Image, string, error) {
	if _, err := os.Stat(filepath.Join(dir, "oci-layout")); err != nil {
		return nil, "", fmt.Errorf("%w: %s is not an OCI image layout (no oci-layout file)", ErrInvalid, dir)
	}
	lp, err := layout.FromPath(dir)
	if err != nil {
		return nil, "", fmt.Errorf("%w: OCI layout: %v", ErrInvalid, err)
	}
	idx, err := lp.ImageIndex()
	if err != nil {
		return nil, "", fmt.Errorf("%w: OCI layout index.json: %v", ErrInvalid, err)
	}
	m, err := idx.IndexManifest()
	if err != nil {
		return nil, "", fmt.Errorf("%w: OCI layout index.json: %v", ErrInvalid, err)
	}
	named := ""
	if len(m.Manifests) == 1 {
		a := m.Manifests[0].Annotations
		named = a[annotContainerdName]
		if named == "" && strings.ContainsAny(a[annotRefName], "/:") {
			named = a[annotRefName]
		}
	}
	h, _ := idx.Digest()
	img, want, indexes, err := fromIndex(idx, h, false, 0)
	if err != nil {
		return nil, "", err
	}
	rec, err := im.put(ctx, img, want, indexes, opts.Progress, "importing", nil)
	return rec, named, err
}

// importTar imports a docker save tarball, or an OCI layout in a tar
// (which `docker save` writes too since Docker 25: the layout is preferred,
// since its digests are the registry's).
func (im *Images) importTar(ctx context.Context, file string, opts ImportOptions) (*Image, string, error) {
	names, err := tarNames(file)
	if err != nil {
		return nil, "", err
	}
	var dockerTags string
	if names["manifest.json"] {
		m, err := tarball.LoadManifest(func() (io.ReadCloser, error) { return os.Open(file) })
		if err != nil {
			return nil, "", fmt.Errorf("%w: docker save manifest.json: %v", ErrInvalid, err)
		}
		if len(m) == 0 {
			return nil, "", fmt.Errorf("%w: docker save manifest.json lists no image", ErrInvalid)
		}
		if len(m) > 1 {
			return nil, "", fmt.Errorf("%w: the tarball holds %d images; import one at a time", ErrInvalid, len(m))
		}
		if len(m[0].RepoTags) > 0 {
			dockerTags = m[0].RepoTags[0]
		}
	}
	if names["oci-layout"] {
		tmp, err := os.MkdirTemp(im.dir, ".import-*")
		if err != nil {
			return nil, "", fmt.Errorf("image: %w", err)
		}
		defer os.RemoveAll(tmp)
		if err := untar(ctx, file, tmp); err != nil {
			return nil, "", err
		}
		rec, named, err := im.importLayout(ctx, tmp, opts)
		if named == "" {
			named = dockerTags
		}
		return rec, named, err
	}
	if !names["manifest.json"] {
		return nil, "", fmt.Errorf("%w: %s is neither a docker save tarball nor an OCI layout (no manifest.json or oci-layout in it)", ErrInvalid, file)
	}
	img, err := tarball.ImageFromPath(file, nil)
	if err != nil {
		return nil, "", fmt.Errorf("%w: docker save tarball: %v", ErrInvalid, err)
	}
	h, err := img.Digest()
	if err != nil {
		return nil, "", fmt.Errorf("%w: docker save tarball: %v", ErrInvalid, err)
	}
	mt, _ := img.MediaType()
	rec, err := im.put(ctx, img, v1.Descriptor{Digest: h, MediaType: mt}, nil, opts.Progress, "importing", nil)
	return rec, dockerTags, err
}

// tarNames lists a tar's regular files (cleaned names).
func tarNames(file string) (map[string]bool, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	names := map[string]bool{}
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("%w: %s is not a tar archive: %v", ErrInvalid, file, err)
		}
		if h.Typeflag == tar.TypeReg {
			names[path.Clean(strings.TrimPrefix(h.Name, "./"))] = true
		}
	}
	if len(names) == 0 {
		return nil, fmt.Errorf("%w: %s is not a tar archive with files in it", ErrInvalid, file)
	}
	return names, nil
}

// untar extracts a tar's directories and regular files under dst, refusing
// names that leave it; links and devices are skipped (a layout has none).
func untar(ctx context.Context, file, dst string) error {
	f, err := os.Open(file)
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	defer f.Close()
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%w: tar: %v", ErrInvalid, err)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		if !filepath.IsLocal(h.Name) {
			return fmt.Errorf("%w: tar entry %q leaves the archive", ErrInvalid, h.Name)
		}
		p := filepath.Join(dst, h.Name)
		switch h.Typeflag {
		case tar.TypeDir:
			if err := os.MkdirAll(p, 0o755); err != nil {
				return fmt.Errorf("image: %w", err)
			}
		case tar.TypeReg:
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return fmt.Errorf("image: %w", err)
			}
			out, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o644)
			if err != nil {
				return fmt.Errorf("image: %w", err)
			}
			_, err = io.Copy(out, tr)
			if cerr := out.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				return fmt.Errorf("%w: tar entry %q: %v", ErrInvalid, h.Name, err)
			}
		}
	}
}
