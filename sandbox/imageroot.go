package sandbox

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/kilnvm/kiln/guestkernel"
	"github.com/kilnvm/kiln/hostfs"
	"github.com/kilnvm/kiln/image"
	"github.com/kilnvm/kiln/initramfs"
	"github.com/kilnvm/kiln/rofs"
	"github.com/kilnvm/kiln/virtio"
)

// An image root's device: its ID, and its tag (the erofs disk's serial,
// or the 9p mount tag).
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

// keepTrees wraps open so that the *hostfs.Trees it first opens for the
// root directory's device (tag ImageTag) become the sandbox's, for
// ServeDir. Later opens (a fork's children, which open through their
// parent's opener) leave them be.
func (s *Sandbox) keepTrees(open virtio.FSOpener) virtio.FSOpener {
	return func(spec virtio.FSSpec) (rofs.FS, io.Closer, error) {
		fs, closer, err := open(spec)
		if err != nil {
			return nil, nil, err
		}
		if t, ok := fs.(*hostfs.Trees); ok && spec.Tag == ImageTag {
			s.treesMu.Lock()
			if s.trees == nil {
				s.trees = t
			}
			s.treesMu.Unlock()
		}
		return fs, closer, nil
	}
}

// rootTrees returns the trees of the sandbox's root directory's device,
// for ServeDir and StopServingDir (op).
func (s *Sandbox) rootTrees(op string) (*hostfs.Trees, error) {
	s.treesMu.Lock()
	t := s.trees
	s.treesMu.Unlock()
	if t != nil {
		return t, nil
	}
	dirRoot := false
	if s.m != nil {
		for _, d := range s.m.devices() {
			if d.ID == ImageDevice && d.Kind == virtio.KindFS && d.FS != nil && d.FS.Dir != "" {
				dirRoot = true
			}
		}
	}
	switch _, local := s.m.(*localVM); {
	case !dirRoot:
		return nil, fmt.Errorf("sandbox: %s needs a sandbox rooted at a host directory (Options.RootDir)", op)
	case !local:
		return nil, fmt.Errorf("sandbox: %s: the sandbox's VM runs in a VMM process of its own (ProcessOptions), which serves its root directory", op)
	}
	return nil, fmt.Errorf("sandbox: %s: this sandbox did not open its root directory's device (a fork's child shares its parent's)", op)
}

// ServeDir serves the host directory dir, read-only, as the named tree
// name of the sandbox's root device (Options.RootDir), while the sandbox
// runs: the guest reaches it under its image root's 9p mount, at
// hostfs.TreesDir/NAME (guest/pid1 keeps that mount at /run/kiln/image;
// a virtio-9p device takes one mount), or attaches it by 9P aname. A name is 1 to
// 128 of [A-Za-z0-9_.-]; one served already is refused, and a sandbox
// serves at most hostfs.MaxTrees directories in its life (a name served
// again takes a new tree). It needs the VM in this process, not in a VMM
// process (ProcessOptions). A snapshot or fork taken while the guest has
// such a tree mounted does not restore: the restored device serves only
// the root directory.
func (s *Sandbox) ServeDir(name, dir string) error {
	t, err := s.rootTrees("ServeDir")
	if err != nil {
		return err
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return fmt.Errorf("sandbox: ServeDir %q: %w", name, err)
	}
	if err := t.Add(name, abs); err != nil {
		return fmt.Errorf("sandbox: ServeDir %q (%s): %w", name, abs, err)
	}
	return nil
}

// StopServingDir stops serving the tree name that ServeDir added, once the
// guest's requests in flight on it have ended, and closes it. The guest
// should unmount it first: its later requests on the tree fail with
// ESTALE.
func (s *Sandbox) StopServingDir(name string) error {
	t, err := s.rootTrees("StopServingDir")
	if err != nil {
		return err
	}
	if err := t.Remove(name); err != nil {
		return fmt.Errorf("sandbox: StopServingDir %q: %w", name, err)
	}
	return nil
}

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
	transport := o.ImageTransport
	switch transport {
	case "":
		transport = virtio.TransportEROFS
	case virtio.TransportEROFS, virtio.Transport9P:
	default:
		return nil, fmt.Errorf("sandbox: Options.ImageTransport %q: want %q (the default) or %q", transport, virtio.TransportEROFS, virtio.Transport9P)
	}
	return &imageRoot{
		spec: virtio.DeviceSpec{ID: ImageDevice, Kind: virtio.KindFS,
			FS: &virtio.FSSpec{Tag: ImageTag, Transport: transport, Image: string(d.Manifest), Images: dir}},
		config: d.Config,
		roots:  roots,
	}, nil
}

// cmdlineRoot is the value of kiln.root= that tells the guest's pid1
// where its root is (pid1.Options.ImageRoot).
func (r *imageRoot) cmdlineRoot() string {
	if r.spec.FS.EROFS() {
		return "erofs:" + r.spec.FS.Tag
	}
	return "9p:" + r.spec.FS.Tag
}

// resolveRootDir checks o.RootDir and returns its device.
func (o Options) resolveRootDir(memMiB int) (*imageRoot, error) {
	switch {
	case o.Disk != "":
		return nil, errors.New("sandbox: Options.RootDir and Options.Disk both give a root: choose one")
	case o.Image != "":
		return nil, errors.New("sandbox: Options.RootDir and Options.Image both give a root: choose one")
	case o.ImageTransport != "" && o.ImageTransport != virtio.Transport9P:
		return nil, fmt.Errorf("sandbox: Options.ImageTransport %q: a host directory (Options.RootDir) is served over %q only", o.ImageTransport, virtio.Transport9P)
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
