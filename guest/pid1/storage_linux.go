package pid1

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// ContainerStorageDirs are the folders where container engines keep their
// layers as overlayfs mounts: Docker's overlay2 (/var/lib/docker),
// containerd's overlayfs snapshotter (/var/lib/containerd) and
// podman's (/var/lib/containers). An image root is itself an overlay,
// and overlayfs refuses to stack its upper layer on another overlay, so
// SwitchRootImage gives each of these folders a place in the root's
// tmpfs (ImageStorage), bound over the overlay: the same writable cap
// (kiln.overlaysize) covers the root's writes and the engines' layers,
// and snapshots and forks keep both.
var ContainerStorageDirs = []string{"/var/lib/docker", "/var/lib/containerd", "/var/lib/containers"}

// ImageStorage is where, in an image root's tmpfs (ImageRW), the
// ContainerStorageDirs live.
const ImageStorage = ImageRW + "/storage"

// bindContainerStorage binds a folder of ImageStorage over each of dirs
// in the overlay mounted on NewRoot, where the image has the folder's
// parent (/var/lib) as a real directory: a root without one (busybox)
// gets nothing. A path with a symbolic link or a non-directory in it is
// left alone (logged): the mount must land inside the image root, never
// where a link points from the initramfs. What the image itself has in
// such a folder is hidden.
func (s *Sys) bindContainerStorage(dirs []string, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	for _, d := range dirs {
		ok, err := s.realDirs(NewRoot, path.Dir(d), true)
		if err != nil {
			return fmt.Errorf("container storage %s: %w", d, err)
		}
		if !ok {
			continue
		}
		if ok, err = s.realDirs(NewRoot, d, false); err != nil {
			return fmt.Errorf("container storage %s: %w", d, err)
		}
		if !ok {
			log.Warn("container storage: not a directory in the image, left alone", "dir", d)
			continue
		}
		src, target := ImageStorage+d, NewRoot+d
		for _, p := range []string{src, target} {
			if err := s.MkdirAll(p, 0o711); err != nil {
				return fmt.Errorf("container storage: creating %s: %w", p, err)
			}
		}
		if err := s.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("container storage: binding %s on %s: %w", src, target, err)
		}
		log.Debug("container storage in the writable layer's tmpfs", "dir", d)
	}
	return nil
}

// realDirs reports whether every component of dir (absolute) under root
// is a directory, not a symbolic link; the last one may be missing unless
// mustExist. A missing component before the last, or a missing last one
// with mustExist, is false with no error; so is a link or a non-directory.
func (s *Sys) realDirs(root, dir string, mustExist bool) (bool, error) {
	parts := strings.Split(strings.Trim(dir, "/"), "/")
	p := root
	for i, c := range parts {
		p += "/" + c
		fi, err := s.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			return i == len(parts)-1 && !mustExist, nil
		}
		if err != nil {
			return false, err
		}
		if !fi.IsDir() {
			return false, nil
		}
	}
	return true, nil
}
