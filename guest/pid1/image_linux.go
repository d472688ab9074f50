package pid1

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"time"

	"golang.org/x/sys/unix"
)

// Where an image-rooted sandbox's initramfs carries what only such a
// sandbox needs: the modules for erofs, virtio-9p and overlayfs, loaded
// only when kiln.root names an image root (so a disk-rooted boot loads
// none of them), and the image's config.
const (
	ImageModulesDir = "/lib/kiln/image-modules"
	ImageConfigPath = "/kiln/image.json"
)

// The image root's layout inside the initramfs, before SwitchRootImage
// moves the overlay onto /: the image's tree (read-only, the overlay's
// lower layer) and the tmpfs that holds the overlay's upper and work
// directories, in guest RAM so that snapshots and forks capture them.
const (
	ImageLower = "/kiln/lower"
	ImageRW    = "/kiln/rw"
	// ImageTree is where the tree stays reachable in the final root (a
	// bind of ImageLower under /run, which moves along): a virtio-9p
	// device takes one mount, so what else the host serves on it (a
	// pod's further containers, hostfs.TreesDir) is reached through
	// this one.
	ImageTree = "/run/kiln/image"
	// ImageRWView is where the tmpfs of the root's writes (ImageRW) stays
	// reachable, for the agent's ExportWritable and ImportWritable (a pause
	// that keeps files, not memory).
	ImageRWView = "/run/kiln/rw"
)

// ImageMountOptions are the 9p mount options of an image root: read-only,
// 9P2000.L, the largest message the 6.1 virtio transport allows, and the
// guest page cache kept for the tree (it never changes under the guest).
const ImageMountOptions = "trans=virtio,version=9p2000.L,msize=512000,cache=loose,access=client"

// imageMountWait bounds the wait for the 9p device or the erofs disk:
// their drivers probe them asynchronously, and a mount before that fails
// with ENOENT.
const imageMountWait = 10 * time.Second

// ImageConfig is the part of an OCI image's config the guest applies, in
// the OCI config's own JSON names: the host writes it at ImageConfigPath.
type ImageConfig struct {
	Env        []string `json:"Env,omitempty"`
	WorkingDir string   `json:"WorkingDir,omitempty"`
	User       string   `json:"User,omitempty"`
}

// maxImageConfig bounds ImageConfigPath's size.
const maxImageConfig = 1 << 20

// ReadImageConfig reads ImageConfigPath; a missing file is an empty config.
func (s *Sys) ReadImageConfig() (*ImageConfig, error) {
	return s.readImageConfigAt(ImageConfigPath)
}

// readImageConfigAt reads an image config from p; a missing file is an
// empty config.
func (s *Sys) readImageConfigAt(p string) (*ImageConfig, error) {
	data, err := s.ReadFile(p)
	if errors.Is(err, fs.ErrNotExist) {
		return &ImageConfig{}, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the image config: %w", err)
	}
	if len(data) > maxImageConfig {
		return nil, fmt.Errorf("image config %s: %d bytes, at most %d", p, len(data), maxImageConfig)
	}
	var c ImageConfig
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, fmt.Errorf("image config %s: %w", p, err)
	}
	return &c, nil
}

// SwitchRootImage makes an image the root: it loads the modules in
// modulesDir, mounts the image's tree read-only on ImageLower (transport
// ImageEROFS: the erofs filesystem on the virtio disk whose serial is tag;
// Image9P: virtio-9p mount tag tag with ImageMountOptions), then flags, a
// tmpfs on ImageRW, an overlay of the two on NewRoot, and enters it as
// SwitchRoot does. Writes and deletes land in the tmpfs and vanish with
// the sandbox; upperMiB, when positive, caps the tmpfs (ENOSPC beyond
// it). The ContainerStorageDirs the image has room for are bound from the
// same tmpfs (bindContainerStorage), so container engines' overlays work.
func (s *Sys) SwitchRootImage(transport, tag, flags string, upperMiB int, modulesDir string, log *slog.Logger) error {
	if tag == "" {
		return errors.New("switching root: no image tag")
	}
	if transport != ImageEROFS && transport != Image9P {
		return fmt.Errorf("switching root: image transport %q: want %q or %q", transport, ImageEROFS, Image9P)
	}
	if err := s.LoadModules(modulesDir, log); err != nil {
		return fmt.Errorf("switching root: image modules: %w", err)
	}
	for _, d := range []string{ImageLower, ImageRW, NewRoot} {
		if err := s.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("switching root: creating %s: %w", d, err)
		}
	}
	mflags, data := parseMountOptions(flags)
	if transport == ImageEROFS {
		if err := s.mountEROFS(tag, mflags, data); err != nil {
			return err
		}
	} else if err := s.mount9P(tag, mflags, data); err != nil {
		return err
	}
	rw := "mode=0755"
	if upperMiB > 0 {
		rw += fmt.Sprintf(",size=%dm", upperMiB)
	}
	if err := s.Mount("tmpfs", ImageRW, "tmpfs", 0, rw); err != nil {
		return fmt.Errorf("switching root: mounting tmpfs on %s: %w", ImageRW, err)
	}
	for _, d := range []string{ImageRW + "/upper", ImageRW + "/work"} {
		if err := s.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("switching root: creating %s: %w", d, err)
		}
	}
	ov := "lowerdir=" + ImageLower + ",upperdir=" + ImageRW + "/upper,workdir=" + ImageRW + "/work"
	if err := s.Mount("overlay", NewRoot, "overlay", 0, ov); err != nil {
		return fmt.Errorf("switching root: mounting the overlay (%s) on %s: %w", ov, NewRoot, err)
	}
	if err := s.MkdirAll(ImageTree, 0o755); err != nil {
		return fmt.Errorf("switching root: creating %s: %w", ImageTree, err)
	}
	if err := s.Mount(ImageLower, ImageTree, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("switching root: binding %s on %s: %w", ImageLower, ImageTree, err)
	}
	if err := s.MkdirAll(ImageRWView, 0o700); err != nil {
		return fmt.Errorf("switching root: creating %s: %w", ImageRWView, err)
	}
	if err := s.Mount(ImageRW, ImageRWView, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("switching root: binding %s on %s: %w", ImageRW, ImageRWView, err)
	}
	if err := s.bindContainerStorage(ContainerStorageDirs, log); err != nil {
		return fmt.Errorf("switching root: %w", err)
	}
	return s.enterNewRoot()
}

// mountEROFS mounts the erofs filesystem on the virtio disk whose serial
// is serial on ImageLower, read-only.
func (s *Sys) mountEROFS(serial string, mflags uintptr, data string) error {
	name, err := s.findDiskBySerialWithin(serial, imageMountWait)
	if err != nil {
		return fmt.Errorf("switching root: image disk: %w", err)
	}
	dev := "/dev/" + name
	if err := s.waitForPath(dev, imageMountWait, rootPoll); err != nil {
		return fmt.Errorf("switching root: image disk: %w", err)
	}
	if err := s.Mount(dev, ImageLower, "erofs", mflags|unix.MS_RDONLY, data); err != nil {
		return fmt.Errorf("switching root: mounting the image's erofs disk %s (serial %q, options %q) on %s: %w", dev, serial, data, ImageLower, err)
	}
	return nil
}

// mount9P mounts virtio-9p mount tag tag on ImageLower, read-only, with
// ImageMountOptions and data.
func (s *Sys) mount9P(tag string, mflags uintptr, data string) error {
	opts := ImageMountOptions
	if data != "" {
		opts += "," + data
	}
	for waited := time.Duration(0); ; waited += rootPoll {
		err := s.Mount(tag, ImageLower, "9p", mflags|unix.MS_RDONLY, opts)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.ENOENT) || waited >= imageMountWait {
			return fmt.Errorf("switching root: mounting 9p tag %q (options %q) on %s: %w", tag, opts, ImageLower, err)
		}
		s.Sleep(rootPoll)
	}
}
