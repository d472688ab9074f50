package image

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	"github.com/kilnvm/kiln/image/store"
	"github.com/opencontainers/go-digest"
	"golang.org/x/sys/unix"
)

// indexVersion is the version of index.json this package writes. Version
// 1 (layers stored whole, no TOCs) is still read: its records load with
// no Layer.Chunks, list and inspect as before, and fail Layers with
// ErrStale until the image is pulled or imported again; the next write
// of the index makes it version 2. A newer version is refused.
const indexVersion = 2

// maxIndexBytes bounds index.json: it is read whole.
const maxIndexBytes = 64 << 20

// indexFile is index.json.
type indexFile struct {
	Version int     `json:"version"`
	Images  []Image `json:"images"`
}

// parseIndex parses and checks index.json. Every digest is checked with
// store.ParseDigest, since digests become paths.
func parseIndex(data []byte) ([]Image, error) {
	var f indexFile
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&f); err != nil {
		return nil, fmt.Errorf("parsing: %w", err)
	}
	if dec.More() {
		return nil, errors.New("parsing: data after the JSON object")
	}
	switch {
	case f.Version == 1:
		for i := range f.Images {
			for j := range f.Images[i].Layers {
				l := &f.Images[i].Layers[j]
				l.Chunks, l.TOC, l.TOCOffset = "", "", 0 // a version 1 record cannot have them
			}
		}
	case f.Version > indexVersion:
		return nil, fmt.Errorf("version %d, from a newer kiln (this one reads up to %d)", f.Version, indexVersion)
	case f.Version != indexVersion:
		return nil, fmt.Errorf("version %d, want %d", f.Version, indexVersion)
	}
	seen := map[string]bool{}
	for i, img := range f.Images {
		if err := img.check(); err != nil {
			return nil, fmt.Errorf("image %d: %w", i, err)
		}
		if seen[img.Ref] {
			return nil, fmt.Errorf("image %d: %q listed twice", i, img.Ref)
		}
		seen[img.Ref] = true
	}
	return f.Images, nil
}

// check validates an index entry.
func (img *Image) check() error {
	if img.Name == "" || len(img.Name) > maxRefLen {
		return fmt.Errorf("bad name %.80q", img.Name)
	}
	ref, err := Normalize(img.Ref)
	if err != nil {
		return fmt.Errorf("%q: %w", img.Name, err)
	}
	if ref != img.Ref {
		return fmt.Errorf("%q: reference %q is not canonical (%q)", img.Name, img.Ref, ref)
	}
	ds := []digest.Digest{img.Manifest, img.Config}
	if img.Index != "" {
		ds = append(ds, img.Index)
	}
	for _, l := range img.Layers {
		if l.Size < 0 {
			return fmt.Errorf("%q: layer %s has size %d", img.Name, l.Digest, l.Size)
		}
		ds = append(ds, l.Digest)
		switch l.Chunks {
		case "":
		case ChunksStore, ChunksRegistry:
			if l.TOC == "" {
				return fmt.Errorf("%q: layer %s has chunks in the %s but no TOC", img.Name, l.Digest, l.Chunks)
			}
			ds = append(ds, l.TOC)
		default:
			return fmt.Errorf("%q: layer %s: chunks from %q", img.Name, l.Digest, l.Chunks)
		}
		if l.Chunks == ChunksRegistry && (l.TOCOffset <= 0 || l.TOCOffset >= l.Size) {
			return fmt.Errorf("%q: layer %s: TOC offset %d in a blob of %d bytes", img.Name, l.Digest, l.TOCOffset, l.Size)
		}
	}
	if img.lazy() {
		if _, err := repoOf(img); err != nil {
			return fmt.Errorf("%q: %w", img.Name, err)
		}
	}
	for _, d := range ds {
		if _, err := store.ParseDigest(string(d)); err != nil {
			return fmt.Errorf("%q: %w", img.Name, err)
		}
	}
	if img.Size < 0 {
		return fmt.Errorf("%q: size %d", img.Name, img.Size)
	}
	return nil
}

// load reads index.json; a missing file is an empty index. It takes no
// lock: index.json is only ever replaced by a rename.
func (im *Images) load() ([]Image, error) {
	f, err := os.Open(im.indexPath())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	defer f.Close()
	var buf bytes.Buffer
	if _, err := buf.ReadFrom(io.LimitReader(f, maxIndexBytes+1)); err != nil {
		return nil, fmt.Errorf("image: reading %s: %w", im.indexPath(), err)
	}
	if buf.Len() > maxIndexBytes {
		return nil, fmt.Errorf("image: %s is over %d bytes", im.indexPath(), maxIndexBytes)
	}
	imgs, err := parseIndex(buf.Bytes())
	if err != nil {
		return nil, fmt.Errorf("image: %s: %w", im.indexPath(), err)
	}
	return imgs, nil
}

func (im *Images) indexPath() string { return filepath.Join(im.dir, "index.json") }

// update changes the index under a lock that other processes honour
// (flock on index.lock) and writes it atomically (temporary file, fsync,
// rename).
func (im *Images) update(fn func([]Image) ([]Image, error)) error {
	im.mu.Lock()
	defer im.mu.Unlock()
	unlock, err := im.lock()
	if err != nil {
		return err
	}
	defer unlock()
	imgs, err := im.load()
	if err != nil {
		return err
	}
	imgs, err = fn(imgs)
	if err != nil {
		return err
	}
	if imgs == nil {
		imgs = []Image{}
	}
	data, err := json.MarshalIndent(indexFile{Version: indexVersion, Images: imgs}, "", "\t")
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	tmp, err := os.CreateTemp(im.dir, ".index-*.json")
	if err != nil {
		return fmt.Errorf("image: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(append(data, '\n')); err != nil {
		tmp.Close()
		return fmt.Errorf("image: writing the index: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("image: writing the index: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("image: writing the index: %w", err)
	}
	if err := os.Rename(tmp.Name(), im.indexPath()); err != nil {
		return fmt.Errorf("image: %w", err)
	}
	if d, err := os.Open(im.dir); err == nil {
		_ = d.Sync()
		d.Close()
	}
	return nil
}

// lock takes the index lock: an exclusive flock on index.lock, which other
// processes (and other open files in this one) wait for.
func (im *Images) lock() (func(), error) {
	f, err := os.OpenFile(filepath.Join(im.dir, "index.lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return nil, fmt.Errorf("image: %w", err)
	}
	for {
		err = unix.Flock(int(f.Fd()), unix.LOCK_EX)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("image: locking the index: %w", err)
	}
	return func() { f.Close() }, nil
}

// now is time.Now, truncated to the second for a tidy index.
func now() time.Time { return time.Now().UTC().Truncate(time.Second) }
