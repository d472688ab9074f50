package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	"github.com/containerd/stargz-snapshotter/estargz"
	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
	"github.com/opencontainers/go-digest"
)

// Convert's fixed estargz parameters: the same input gives the same
// digests on every machine (with the same Go release: compress/gzip's
// output is stable within one).
const (
	// convertLevel: BestSpeed. Measured on this project's 2-core build
	// machine with estargz.Build, one worker, 4 MiB chunks, on 67 MiB of
	// /usr/local/go (sources and binaries): BestSpeed 1.09 s to 26.1 MiB,
	// DefaultCompression 2.03 s to 23.5 MiB (BestCompression, estargz's
	// default, is slower still). Half the time for 11% more bytes; a lazy
	// root is read by chunk, so the time to convert matters more.
	convertLevel = gzip.BestSpeed
	// convertWorkers: estargz.Build's parallelism, which moves gzip member
	// boundaries and so digests: fixed, never GOMAXPROCS.
	convertWorkers = 1
)

// BuildOptions are the estargz.Build settings Convert uses (4 MiB chunks,
// convertLevel, convertWorkers), with ctx: the same tar gives the same
// blob, and so the same digests, on every machine. tools/testimage builds
// the tests' images with them.
func BuildOptions(ctx context.Context) []estargz.Option {
	return []estargz.Option{
		estargz.WithChunkSize(chunkSize),
		estargz.WithCompressionLevel(convertLevel),
		estargz.WithParallelism(convertWorkers),
		estargz.WithContext(ctx),
	}
}

// ConvertOptions configures a Convert.
type ConvertOptions struct {
	// Name names the result in the images folder; by default the pushed
	// reference, else the source's tag with "-esgz" appended
	// ("app:v1" -> "app:v1-esgz"), else its manifest digest.
	Name string
	// Push, if set, is a reference to push the result to (remote.Write).
	Push string
	// Insecure allows plain HTTP to Push's registry, and to the source's
	// if it has to be pulled first.
	Insecure bool
	Progress *Progress
}

// Convert rebuilds an image's layers as estargz, deterministically (4 MiB
// chunks, gzip level BestSpeed, one worker, timestamps from the layers),
// with the TOC digest annotation on each layer, and names the result: the
// same image converted twice, here or on another machine, has the same
// manifest digest. ref names an image in the folder; one that is not there
// is pulled first. Each layer's tar is rebuilt from its TOC and chunks
// (lazy chunks are fetched), so plain and estargz layers alike are
// converted. The result's chunks are the source's (the same 4 MiB cuts),
// so it takes only its TOCs in the store; pushed (opts.Push), its layers
// are lazy from there.
func (im *Images) Convert(ctx context.Context, ref string, opts ConvertOptions) (*Image, error) {
	src, err := im.Get(ref)
	if errors.Is(err, ErrNotFound) {
		opts.Progress.Printf("%s is not here: pulling it", ref)
		src, err = im.Pull(ctx, ref, PullOptions{Insecure: opts.Insecure, Progress: opts.Progress})
	}
	if err != nil {
		return nil, err
	}
	var dest name.Reference
	if opts.Push != "" {
		if dest, err = parseRef(opts.Push); err != nil {
			return nil, err
		}
		if opts.Insecure && !isLoopback(dest.Context().RegistryStr()) {
			if dest, err = parseInsecure(opts.Push); err != nil {
				return nil, err
			}
		}
	}
	if opts.Name != "" {
		if _, err := Normalize(opts.Name); err != nil {
			return nil, err
		}
	}
	layers, err := im.Layers(ctx, src)
	if err != nil {
		return nil, err
	}
	cf, err := im.configOf(src)
	if err != nil {
		return nil, err
	}
	work, err := os.MkdirTemp(im.dir, ".convert-*")
	if err != nil {
		return nil, fmt.Errorf("image: convert: %w", err)
	}
	defer os.RemoveAll(work)

	oci := src.MediaType != string(types.DockerManifestSchema2)
	layerMT, manifestMT, configMT := types.OCILayer, types.OCIManifestSchema1, types.OCIConfigJSON
	if !oci {
		layerMT, manifestMT, configMT = types.DockerLayer, types.DockerManifestSchema2, types.DockerConfigJSON
	}
	var adds []mutate.Addendum
	var recs []Layer
	for i, lr := range layers {
		l, rec, err := im.convertLayer(ctx, work, i, lr, layerMT, opts.Progress)
		if err != nil {
			return nil, fmt.Errorf("image: convert %s: layer %s: %w", ref, lr.Layer.Digest, err)
		}
		adds = append(adds, mutate.Addendum{
			Layer:       l,
			MediaType:   layerMT,
			Annotations: map[string]string{estargz.TOCJSONDigestAnnotation: rec.TOC.String()},
		})
		recs = append(recs, rec)
	}
	img := mutate.ConfigMediaType(mutate.MediaType(empty.Image, manifestMT), configMT)
	if img, err = mutate.Append(img, adds...); err != nil {
		return nil, fmt.Errorf("image: convert %s: %w", ref, err)
	}
	// The source's config, with the new layers' diff IDs; its history
	// stays as it was (Append would add entries of its own).
	ncf := cf.DeepCopy()
	ncf.RootFS.Type = "layers"
	ncf.RootFS.DiffIDs = nil
	for _, a := range adds {
		d, err := a.Layer.DiffID()
		if err != nil {
			return nil, fmt.Errorf("image: convert %s: %w", ref, err)
		}
		ncf.RootFS.DiffIDs = append(ncf.RootFS.DiffIDs, d)
	}
	if img, err = mutate.ConfigFile(img, ncf); err != nil {
		return nil, fmt.Errorf("image: convert %s: %w", ref, err)
	}
	rec, err := im.storeConverted(ctx, img, recs)
	if err != nil {
		return nil, fmt.Errorf("image: convert %s: %w", ref, err)
	}
	rec.Source = "convert " + src.Name
	if dest != nil {
		base := im.opts.Transport
		if base == nil {
			base = remote.DefaultTransport
		}
		plain := opts.Insecure || isLoopback(dest.Context().RegistryStr())
		opts.Progress.Printf("pushing %s", dest)
		err := remote.Write(dest, img,
			remote.WithContext(ctx),
			remote.WithTransport(&guard{base: base, plainOK: plain}),
			remote.WithAuthFromKeychain(authn.DefaultKeychain),
			remote.WithUserAgent("kiln"),
		)
		if err != nil {
			return nil, fmt.Errorf("image: convert %s: pushing to %s: %w", ref, opts.Push, err)
		}
		rec.Repo, rec.PlainHTTP = dest.Context().Name(), plain
		for i := range rec.Layers {
			rec.Layers[i].Chunks = ChunksRegistry
		}
	}
	rec.Name = opts.Name
	if rec.Name == "" {
		rec.Name = convertName(src, opts.Push, rec.Manifest)
	}
	if rec.Ref, err = Normalize(rec.Name); err != nil {
		return nil, err
	}
	if err := im.add(rec); err != nil {
		return nil, err
	}
	return rec, nil
}

// convertName is the default name of a converted image.
func convertName(src *Image, push string, manifest digest.Digest) string {
	if push != "" {
		return push
	}
	if r, err := name.ParseReference(src.Ref); err == nil {
		if t, ok := r.(name.Tag); ok {
			return t.Context().Name() + ":" + t.TagStr() + "-esgz"
		}
	}
	return string(manifest)
}

// configOf reads an image's config from the store, checked.
func (im *Images) configOf(img *Image) (*v1.ConfigFile, error) {
	f, size, err := im.st.OpenVerified(img.Config)
	if err != nil {
		return nil, fmt.Errorf("image: %s: config: %w", img.Name, err)
	}
	defer f.Close()
	if size > maxConfigBytes {
		return nil, fmt.Errorf("image: %s: config of %d bytes", img.Name, size)
	}
	cf, err := v1.ParseConfigFile(io.LimitReader(f, maxConfigBytes))
	if err != nil {
		return nil, fmt.Errorf("image: %s: config %s: %w", img.Name, img.Config, err)
	}
	return cf, nil
}

// convertLayer rebuilds one layer as estargz in work and returns it with
// its record (chunks in the store, TOC stored).
func (im *Images) convertLayer(ctx context.Context, work string, i int, lr LayerReader, mt types.MediaType, p *Progress) (v1.Layer, Layer, error) {
	short := lr.Layer.Digest.Encoded()[:12]
	tf, err := os.Create(filepath.Join(work, fmt.Sprintf("layer%d.tar", i)))
	if err != nil {
		return nil, Layer{}, err
	}
	defer tf.Close()
	if err := writeTar(ctx, lr, tf); err != nil {
		return nil, Layer{}, err
	}
	size, err := tf.Seek(0, io.SeekEnd)
	if err != nil {
		return nil, Layer{}, err
	}
	t := p.start("converting", short, -1)
	blob, err := estargz.Build(io.NewSectionReader(tf, 0, size), BuildOptions(ctx)...)
	if err != nil {
		t.done(err)
		return nil, Layer{}, fmt.Errorf("estargz: %w", err)
	}
	outPath := filepath.Join(work, fmt.Sprintf("layer%d.esgz", i))
	out, err := os.Create(outPath)
	if err == nil {
		_, err = io.Copy(out, t.reader(blob))
		if cerr := out.Close(); err == nil {
			err = cerr
		}
	}
	if cerr := blob.Close(); err == nil {
		err = cerr
	}
	t.done(err)
	if err != nil {
		return nil, Layer{}, fmt.Errorf("estargz: %w", err)
	}
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return os.Open(outPath) }, tarball.WithMediaType(mt))
	if err != nil {
		return nil, Layer{}, err
	}
	h, err := l.Digest()
	if err != nil {
		return nil, Layer{}, err
	}
	n, err := l.Size()
	if err != nil {
		return nil, Layer{}, err
	}
	rec := Layer{Digest: digest.Digest(h.String()), Size: n, MediaType: string(mt), Chunks: ChunksStore}
	// The TOC, read back as a pull would, and stored.
	fr := &fileRange{path: outPath, size: n}
	data, off, err := openTOC(ctx, fr, n, blob.TOCDigest())
	if err != nil {
		return nil, Layer{}, err
	}
	_, ix, err := parseTOC(data, off)
	if err != nil {
		return nil, Layer{}, err
	}
	if _, err := im.st.PutSized(ctx, blob.TOCDigest(), int64(len(data)), bytes.NewReader(data)); err != nil {
		return nil, Layer{}, err
	}
	rec.TOC, rec.TOCOffset = blob.TOCDigest(), off
	// Chunks are cut where the source's were, so they are stored already;
	// any that are not are taken from the new blob, checked.
	cr := &ChunkReader{im: im, img: "convert", layer: Layer{Digest: rec.Digest, Size: n, Chunks: ChunksRegistry}, ix: ix, blob: fr}
	if err := cr.fetch(ctx, ix.chunks, false); err != nil {
		return nil, Layer{}, err
	}
	return l, rec, nil
}

// storeConverted stores a converted image's manifest and config and makes
// its record.
func (im *Images) storeConverted(ctx context.Context, img v1.Image, layers []Layer) (*Image, error) {
	raw, err := img.RawManifest()
	if err != nil {
		return nil, err
	}
	h, err := img.Digest()
	if err != nil {
		return nil, err
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		return nil, err
	}
	ch, err := img.ConfigName()
	if err != nil {
		return nil, err
	}
	if err := im.putBytes(ctx, h.String(), int64(len(raw)), raw, "manifest"); err != nil {
		return nil, err
	}
	if err := im.putBytes(ctx, ch.String(), int64(len(cfg)), cfg, "config"); err != nil {
		return nil, err
	}
	mt, _ := img.MediaType()
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	rec := &Image{
		Manifest:  digest.Digest(h.String()),
		MediaType: string(mt),
		Config:    digest.Digest(ch.String()),
		Layers:    layers,
		Size:      int64(len(raw)) + int64(len(cfg)),
		Created:   cf.Created.UTC(),
		Added:     now(),
	}
	for _, l := range layers {
		rec.Size += l.Size
	}
	return rec, nil
}

// writeTar writes a layer's tar, rebuilt from its TOC and chunks: the
// entry fields a TOC keeps (what estargz.Build reads back), in TOC order.
func writeTar(ctx context.Context, lr LayerReader, w io.Writer) error {
	tw := tar.NewWriter(w)
	ents := lr.TOC.Entries
	for i := 0; i < len(ents); i++ {
		e := ents[i]
		if e.Type == "chunk" || e.Name == "" {
			continue
		}
		h := &tar.Header{
			Name: e.Name, Mode: e.Mode, Uid: e.UID, Gid: e.GID, Uname: e.Uname, Gname: e.Gname,
			Linkname: e.LinkName, Devmajor: int64(e.DevMajor), Devminor: int64(e.DevMinor),
		}
		if e.ModTime3339 != "" {
			mt, err := time.Parse(time.RFC3339, e.ModTime3339)
			if err != nil {
				return fmt.Errorf("%q: modtime %q: %w", e.Name, e.ModTime3339, err)
			}
			h.ModTime = mt
		} else {
			h.ModTime = time.Unix(0, 0).UTC()
		}
		switch e.Type {
		case "dir":
			h.Typeflag, h.Name = tar.TypeDir, e.Name+"/"
		case "reg":
			h.Typeflag, h.Size = tar.TypeReg, e.Size
		case "symlink":
			h.Typeflag = tar.TypeSymlink
		case "hardlink":
			h.Typeflag = tar.TypeLink
		case "char":
			h.Typeflag = tar.TypeChar
		case "block":
			h.Typeflag = tar.TypeBlock
		case "fifo":
			h.Typeflag = tar.TypeFifo
		}
		if len(e.Xattrs) > 0 {
			h.Format = tar.FormatPAX
			h.PAXRecords = map[string]string{}
			for k, v := range e.Xattrs {
				h.PAXRecords["SCHILY.xattr."+k] = string(v)
			}
		}
		if err := tw.WriteHeader(h); err != nil {
			return fmt.Errorf("%q: %w", e.Name, err)
		}
		if e.Type != "reg" || e.Size == 0 {
			continue
		}
		// The file's chunks: this entry and the "chunk" entries after it.
		j := i + 1
		for j < len(ents) && ents[j].Type == "chunk" {
			j++
		}
		chunks := ents[i:j]
		if err := lr.Chunks.Fetch(ctx, chunks); err != nil {
			return err
		}
		for _, ce := range chunks {
			buf := make([]byte, ce.ChunkSize)
			if _, err := lr.Chunks.ReadChunk(ctx, ce, buf, 0); err != nil {
				return err
			}
			if _, err := tw.Write(buf); err != nil {
				return fmt.Errorf("%q: %w", e.Name, err)
			}
		}
		i = j - 1
	}
	return tw.Close()
}

// fileRange reads ranges of a local file.
type fileRange struct {
	path string
	size int64
}

func (f *fileRange) Range(_ context.Context, off, n int64) ([]byte, error) {
	fh, err := os.Open(f.path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	buf := make([]byte, n)
	if _, err := fh.ReadAt(buf, off); err != nil {
		return nil, fmt.Errorf("reading %s at %d: %w", filepath.Base(f.path), off, err)
	}
	return buf, nil
}
