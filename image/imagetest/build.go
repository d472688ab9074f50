package imagetest

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"fmt"
	"io"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
)

// ChunkSize is the estargz chunk size the builders use (estargz's default).
const ChunkSize = 4 << 20

// ModTime is the modification time of every File that gives none.
func ModTime() time.Time { return time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC) }

// File is one entry of a layer tar.
type File struct {
	Name     string
	Type     byte  // tar.TypeReg if zero
	Mode     int64 // 0644 (files) or 0755 (directories) if zero
	Body     []byte
	Linkname string
	UID, GID int
	Xattrs   map[string]string
	ModTime  time.Time // ModTime if zero
	Devmajor int64
	Devminor int64
}

// Tar writes files, in order, as a tar stream (PAX headers where needed).
func Tar(files ...File) []byte {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, f := range files {
		typ := f.Type
		if typ == 0 {
			typ = tar.TypeReg
		}
		mode := f.Mode
		if mode == 0 {
			mode = 0o644
			if typ == tar.TypeDir {
				mode = 0o755
			}
		}
		mt := f.ModTime
		if mt.IsZero() {
			mt = ModTime()
		}
		h := &tar.Header{
			Name: f.Name, Typeflag: typ, Mode: mode, Linkname: f.Linkname,
			Uid: f.UID, Gid: f.GID, ModTime: mt, Devmajor: f.Devmajor, Devminor: f.Devminor,
			Format: tar.FormatPAX,
		}
		if typ == tar.TypeReg {
			h.Size = int64(len(f.Body))
		}
		if len(f.Xattrs) > 0 {
			h.PAXRecords = map[string]string{}
			for k, v := range f.Xattrs {
				h.PAXRecords["SCHILY.xattr."+k] = v
			}
		}
		if err := tw.WriteHeader(h); err != nil {
			panic(fmt.Sprintf("imagetest: tar header %q: %v", f.Name, err)) // a bug in the test's files
		}
		if typ == tar.TypeReg {
			tw.Write(f.Body)
		}
	}
	tw.Close()
	return buf.Bytes()
}

// DirTar is a tar of the tree under dir (names relative to it), in sorted
// order, with modification times set to ModTime() so that it does not depend
// on when the files were written.
func DirTar(dir string) ([]byte, error) {
	var files []File
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, p)
		if err != nil || rel == "." {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		f := File{Name: filepath.ToSlash(rel), Mode: int64(fi.Mode().Perm())}
		switch {
		case d.IsDir():
			f.Type, f.Name = tar.TypeDir, f.Name+"/"
		case fi.Mode()&fs.ModeSymlink != 0:
			f.Type = tar.TypeSymlink
			if f.Linkname, err = os.Readlink(p); err != nil {
				return err
			}
		case fi.Mode().IsRegular():
			if f.Body, err = os.ReadFile(p); err != nil {
				return err
			}
		default:
			return nil // sockets, devices: not in test trees
		}
		files = append(files, f)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("imagetest: %w", err)
	}
	sort.Slice(files, func(i, j int) bool { return files[i].Name < files[j].Name })
	return Tar(files...), nil
}

// BaseFiles is a small root tree: directories, a few small files, a
// symlink, a hardlink and a setuid binary.
func BaseFiles() []File {
	return []File{
		{Name: "bin/", Type: tar.TypeDir},
		{Name: "bin/busybox", Mode: 0o4755, Body: bytes.Repeat([]byte("\x7fELF busybox "), 1000)},
		{Name: "bin/sh", Type: tar.TypeSymlink, Linkname: "busybox"},
		{Name: "bin/ls", Type: tar.TypeLink, Linkname: "bin/busybox"},
		{Name: "etc/", Type: tar.TypeDir},
		{Name: "etc/os-release", Body: []byte("NAME=kiln-test\nID=kiln\n")},
		{Name: "etc/hostname", Body: []byte("kiln\n")},
		{Name: "tmp/", Type: tar.TypeDir, Mode: 0o1777},
	}
}

// RandomFiles is mib MiB of incompressible files under dir ("big/"): one
// file of half the size and the rest in 1 MiB files, from seed.
func RandomFiles(seed uint64, dir string, mib int) []File {
	rng := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	random := func(n int) []byte {
		b := make([]byte, n)
		for i := 0; i+8 <= n; i += 8 {
			v := rng.Uint64()
			for k := range 8 {
				b[i+k] = byte(v >> (8 * k))
			}
		}
		return b
	}
	files := []File{{Name: dir + "/", Type: tar.TypeDir}}
	big := mib / 2
	if big > 0 {
		files = append(files, File{Name: dir + "/big.bin", Body: random(big << 20)})
	}
	for i := range mib - big {
		files = append(files, File{Name: fmt.Sprintf("%s/f%03d.bin", dir, i), Body: random(1 << 20)})
	}
	return files
}

// Layer is a built layer; TOC is its estargz TOC digest (empty for a plain
// layer).
type Layer struct {
	v1.Layer
	TOC  digest.Digest
	Blob []byte // the compressed bytes
}

// Estargz builds an estargz layer from a tar: 4 MiB chunks, gzip level
// BestSpeed, one worker, so the same tar always gives the same bytes.
func Estargz(tarball []byte) (Layer, error) {
	b, err := estargz.Build(io.NewSectionReader(bytes.NewReader(tarball), 0, int64(len(tarball))),
		estargz.WithChunkSize(ChunkSize),
		estargz.WithCompressionLevel(gzip.BestSpeed),
		estargz.WithParallelism(1),
	)
	if err != nil {
		return Layer{}, fmt.Errorf("imagetest: estargz: %w", err)
	}
	defer b.Close()
	blob, err := io.ReadAll(b)
	if err != nil {
		return Layer{}, fmt.Errorf("imagetest: estargz: %w", err)
	}
	l, err := layerOf(blob)
	if err != nil {
		return Layer{}, err
	}
	return Layer{Layer: l, TOC: b.TOCDigest(), Blob: blob}, nil
}

// Gzip builds a plain gzip layer (no TOC) from a tar.
func Gzip(tarball []byte) (Layer, error) {
	blob := gzipBytes(tarball)
	l, err := layerOf(blob)
	if err != nil {
		return Layer{}, err
	}
	return Layer{Layer: l, Blob: blob}, nil
}

func layerOf(blob []byte) (v1.Layer, error) {
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(blob)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return nil, fmt.Errorf("imagetest: layer: %w", err)
	}
	return l, nil
}

// Image is an OCI linux/amd64 image of layers, bottom first; estargz
// layers carry their TOC digest annotation.
func Image(layers ...Layer) (v1.Image, error) {
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, fmt.Errorf("imagetest: %w", err)
	}
	cf = cf.DeepCopy()
	cf.OS, cf.Architecture = "linux", "amd64"
	cf.Config.Env = []string{"PATH=/bin"}
	cf.Config.Cmd = []string{"/bin/sh"}
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return nil, fmt.Errorf("imagetest: %w", err)
	}
	var adds []mutate.Addendum
	for _, l := range layers {
		a := mutate.Addendum{Layer: l.Layer, MediaType: types.OCILayer}
		if l.TOC != "" {
			a.Annotations = map[string]string{estargz.TOCJSONDigestAnnotation: l.TOC.String()}
		}
		adds = append(adds, a)
	}
	img, err = mutate.Append(img, adds...)
	if err != nil {
		return nil, fmt.Errorf("imagetest: %w", err)
	}
	return img, nil
}

// EstargzImage builds an image of estargz layers, one per tar.
func EstargzImage(tars ...[]byte) (v1.Image, []Layer, error) {
	var ls []Layer
	for _, t := range tars {
		l, err := Estargz(t)
		if err != nil {
			return nil, nil, err
		}
		ls = append(ls, l)
	}
	img, err := Image(ls...)
	return img, ls, err
}

// RandomImage is an estargz image of two layers: BaseFiles, then mib MiB
// of RandomFiles(seed) under "data". Two images with different seeds share
// the base layer.
func RandomImage(seed uint64, mib int) (v1.Image, []Layer, error) {
	return EstargzImage(Tar(BaseFiles()...), Tar(RandomFiles(seed, "data", mib)...))
}
