package sandbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/opencontainers/go-digest"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/hostfs"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/rofs"
	"github.com/kilnvm/kiln/virtio"
)

// An image root's device: the ID of its 9p device and its mount tag.
const (
	ImageDevice = "image"
	ImageTag    = "kilnroot"
)

// DefaultImagesDir is the images folder kiln uses when none is given:
// <kernel cache>/images.
func DefaultImagesDir() (string, error) {
	cache, err := guestkernel.CacheDir()
	if err != nil {
		return "", fmt.Errorf("sandbox: images folder: %w", err)
	}
	return filepath.Join(cache, "images"), nil
}

// The values of Options.Init.
const (
	InitAgent   = "agent"
	InitSystemd = "systemd"
)

// CheckInit refuses an Options.Init value that is not "", InitAgent or
// InitSystemd.
func CheckInit(v string) error {
	switch v {
	case "", InitAgent, InitSystemd:
		return nil
	}
	return fmt.Errorf("sandbox: init %q: want %q (the agent as process 1, the default) or %q (the image's /sbin/init, the agent a service)", v, InitAgent, InitSystemd)
}

// checkInit checks o.Init: a known value, and systemd only on an image root.
func (o Options) checkInit() error {
	if err := CheckInit(o.Init); err != nil {
		return err
	}
	if o.Init == InitSystemd && o.Image == "" && o.RootDir == "" {
		return errors.New("sandbox: Options.Init systemd boots an image's /sbin/init: it needs Options.Image or RootDir")
	}
	return nil
}

// initCmdline is the kernel command line parameter that tells the guest's
// pid1 what to become (guest/pid1's kiln.init), "" for the default.
func (o Options) initCmdline() string {
	if o.Init == InitSystemd {
		return " kiln.init=" + InitSystemd
	}
	return ""
}

// OpenImageFS returns the opener of the trees a VM needs for its fs
// devices (vmm.Config.OpenFS): image roots through roots (the devices of
// one image in one folder share one tree), and host directories (package
// hostfs: never following a symbolic link, never leaving the directory).
func OpenImageFS(roots *image.Roots) virtio.FSOpener {
	return func(spec virtio.FSSpec) (rofs.FS, io.Closer, error) {
		if spec.Dir != "" {
			f, err := hostfs.Open(spec.Dir)
			if err != nil {
				return nil, nil, err
			}
			return f, f, nil
		}
		if roots == nil {
			return nil, nil, errors.New("no image store here")
		}
		r, release, err := roots.Open(context.Background(), spec.Images, digest.Digest(spec.Image))
		if err != nil {
			return nil, nil, err
		}
		return r.Tree, closerFunc(release), nil
	}
}

type closerFunc func() error

func (f closerFunc) Close() error { return f() }

// imageRoot is what Start needs of Options.Image: the device, the image's
// config, and the roots to open it through.
type imageRoot struct {
	spec   virtio.DeviceSpec
	config image.Config
	roots  *image.Roots
}

// resolveImage finds the image o names in its images folder, for a guest
// of memMiB.
func (o Options) resolveImage(memMiB int) (*imageRoot, error) {
	if o.Disk != "" {
		return nil, errors.New("sandbox: Options.Image and Options.Disk both give a root: choose one")
	}
	if o.WritableMiB < 0 || o.WritableMiB > memMiB {
		return nil, fmt.Errorf("sandbox: Options.WritableMiB %d: want 0 (half the guest's memory) to MemoryMiB (%d): the writable layer is guest RAM", o.WritableMiB, memMiB)
	}
	dir := o.Images
	if dir == "" {
		var err error
		if dir, err = DefaultImagesDir(); err != nil {
			return nil, err
		}
	}
	dir, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: images folder: %w", err)
	}
	roots := o.ImageRoots
	if roots == nil {
		roots = image.NewRoots(image.Options{Logger: o.Logger})
	}
	im, err := roots.Images(dir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	d, err := im.Inspect(o.Image)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return &imageRoot{
		spec: virtio.DeviceSpec{ID: ImageDevice, Kind: virtio.KindFS,
			FS: &virtio.FSSpec{Tag: ImageTag, Image: string(d.Manifest), Images: dir}},
		config: d.Config,
		roots:  roots,
	}, nil
}

// resolveRootDir checks o.RootDir and returns its device.
func (o Options) resolveRootDir(memMiB int) (*imageRoot, error) {
	switch {
	case o.Disk != "":
		return nil, errors.New("sandbox: Options.RootDir and Options.Disk both give a root: choose one")
	case o.Image != "":
		return nil, errors.New("sandbox: Options.RootDir and Options.Image both give a root: choose one")
	case o.WritableMiB < 0 || o.WritableMiB > memMiB:
		return nil, fmt.Errorf("sandbox: Options.WritableMiB %d: want 0 (half the guest's memory) to MemoryMiB (%d): the writable layer is guest RAM", o.WritableMiB, memMiB)
	}
	dir, err := filepath.Abs(o.RootDir)
	if err != nil {
		return nil, fmt.Errorf("sandbox: root directory: %w", err)
	}
	if fi, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("sandbox: root directory: %w", err)
	} else if !fi.IsDir() {
		return nil, fmt.Errorf("sandbox: root directory %s is not a directory", dir)
	}
	return &imageRoot{spec: virtio.DeviceSpec{ID: ImageDevice, Kind: virtio.KindFS,
		FS: &virtio.FSSpec{Tag: ImageTag, Dir: dir}}}, nil
}

// imageInitrd returns the agent's initramfs base with the image's config
// appended (initramfs.ImageConfigArchive), written once per base and
// config beside base (or under the temporary directory when that is
// read-only).
func imageInitrd(base string, cfg image.Config) (string, error) {
	js, err := json.Marshal(struct {
		Env        []string `json:"Env,omitempty"`
		WorkingDir string   `json:"WorkingDir,omitempty"`
		User       string   `json:"User,omitempty"`
	}{cfg.Env, cfg.WorkingDir, cfg.User})
	if err != nil {
		return "", err
	}
	tail, err := initramfs.ImageConfigArchive(js)
	if err != nil {
		return "", fmt.Errorf("sandbox: image config: %w", err)
	}
	f, err := os.Open(base)
	if err != nil {
		return "", fmt.Errorf("sandbox: initramfs: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return "", fmt.Errorf("sandbox: initramfs: %w", err)
	}
	// Keyed by the base's path, size and modification time, not its
	// bytes: every image-rooted start comes here, and the base (the agent,
	// busybox, the modules) is megabytes that change only when rebuilt.
	h := sha256.New()
	fmt.Fprintf(h, "%s\n%d\n%d\n", base, fi.Size(), fi.ModTime().UnixNano())
	h.Write(tail)
	name := "image-" + hex.EncodeToString(h.Sum(nil)[:12]) + ".cpio"
	var errs []error
	for _, dir := range []string{filepath.Dir(base), filepath.Join(os.TempDir(), "kiln-initramfs")} {
		p := filepath.Join(dir, name)
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		if err := writeConcat(p, f, tail); err != nil {
			errs = append(errs, err)
			continue
		}
		return p, nil
	}
	return "", fmt.Errorf("sandbox: writing the image's initramfs: %w", errors.Join(errs...))
}

// writeConcat writes base's content then tail to p, atomically.
func writeConcat(p string, base *os.File, tail []byte) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(p), ".image-*.cpio")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := base.Seek(0, io.SeekStart); err != nil {
		tmp.Close()
		return err
	}
	n, err := io.Copy(tmp, base)
	if err != nil {
		tmp.Close()
		return err
	}
	// The kernel wants each archive to start 4-byte aligned; zeros
	// between archives are skipped (a compressed base may end anywhere).
	if pad := (4 - n%4) % 4; pad > 0 {
		if _, err := tmp.Write(make([]byte, pad)); err != nil {
			tmp.Close()
			return err
		}
	}
	if _, err := tmp.Write(tail); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), p)
}
