// Package guestkernel finds the stock Debian kernel that Kiln boots as a
// guest, and its loadable modules, in the user's kernel cache.
//
// The cache is filled by `make kernel` (tools/fetch-kernel.sh). Its layout is
//
//	<root>/kernel/<version>/vmlinuz
//	<root>/kernel/<version>/vmlinux    optional: vmlinuz uncompressed (ELF, PVH entry)
//	<root>/kernel/<version>/modules/   the lib/modules/<version> tree
//	<root>/kernel/current               symlink to <version>, or a file naming it
//
// where <root> is $KILN_CACHE, else $XDG_CACHE_HOME/kiln, else
// $HOME/.cache/kiln.
package guestkernel

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// ErrNotCached is returned (wrapped) by Find when the cache holds no usable
// kernel.
var ErrNotCached = errors.New("guest kernel not cached: run `make kernel`")

// Kernel is one cached guest kernel.
type Kernel struct {
	// Version is the kernel release, e.g. "6.1.0-57-amd64".
	Version string
	// Image is the path of the bzImage (vmlinuz).
	Image string
	// ModulesDir is the path of the kernel's lib/modules/<version> tree.
	ModulesDir string
	// Vmlinux is the path of the uncompressed ELF kernel, which boots
	// through its PVH entry point without decompressing itself (much faster
	// under emulation), or "" when the cache has none.
	Vmlinux string
	// Cache is the cache root the kernel was found in (FindIn's root),
	// where its modules disk is kept (ModulesDisk); "" for a kernel not
	// from a cache.
	Cache string
}

// CacheDir returns Kiln's cache root: $KILN_CACHE if set, else
// $XDG_CACHE_HOME/kiln when that is an absolute path, else $HOME/.cache/kiln.
// The result is absolute.
func CacheDir() (string, error) {
	if dir := os.Getenv("KILN_CACHE"); dir != "" {
		abs, err := filepath.Abs(dir)
		if err != nil {
			return "", fmt.Errorf("resolving KILN_CACHE %q: %w", dir, err)
		}
		return abs, nil
	}
	if dir := os.Getenv("XDG_CACHE_HOME"); filepath.IsAbs(dir) {
		return filepath.Join(dir, "kiln"), nil
	}
	home := os.Getenv("HOME")
	if !filepath.IsAbs(home) {
		return "", errors.New("cannot locate Kiln's cache: set KILN_CACHE, XDG_CACHE_HOME or HOME to an absolute path")
	}
	return filepath.Join(home, ".cache", "kiln"), nil
}

// Find returns the current kernel of the cache at CacheDir.
func Find() (*Kernel, error) {
	root, err := CacheDir()
	if err != nil {
		return nil, err
	}
	return FindIn(root)
}

// FindIn returns the current kernel of the cache rooted at root.
func FindIn(root string) (*Kernel, error) {
	kdir := filepath.Join(root, "kernel")
	version, err := currentVersion(filepath.Join(kdir, "current"))
	if err != nil {
		return nil, err
	}
	k := &Kernel{
		Version:    version,
		Image:      filepath.Join(kdir, version, "vmlinuz"),
		ModulesDir: filepath.Join(kdir, version, "modules"),
		Cache:      root,
	}
	if err := wantKind(k.Image, false); err != nil {
		return nil, fmt.Errorf("kernel %s: %w", version, err)
	}
	if err := wantKind(k.ModulesDir, true); err != nil {
		return nil, fmt.Errorf("kernel %s: %w", version, err)
	}
	if vmlinux := filepath.Join(kdir, version, "vmlinux"); wantKind(vmlinux, false) == nil {
		k.Vmlinux = vmlinux
	}
	return k, nil
}

// currentVersion reads the version named by the "current" symlink or file.
func currentVersion(current string) (string, error) {
	fi, err := os.Lstat(current)
	if errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("%w (no %s)", ErrNotCached, current)
	}
	if err != nil {
		return "", fmt.Errorf("reading the current kernel: %w", err)
	}
	var version string
	switch {
	case fi.Mode()&fs.ModeSymlink != 0:
		target, err := os.Readlink(current)
		if err != nil {
			return "", fmt.Errorf("reading the current kernel: %w", err)
		}
		version = filepath.Base(filepath.Clean(target))
	case fi.Mode().IsRegular():
		data, err := os.ReadFile(current)
		if err != nil {
			return "", fmt.Errorf("reading the current kernel: %w", err)
		}
		version = strings.TrimSpace(string(data))
	default:
		return "", fmt.Errorf("%s is neither a symlink nor a file naming a kernel version", current)
	}
	if err := validVersion(version); err != nil {
		return "", fmt.Errorf("%s: %w", current, err)
	}
	return version, nil
}

// validVersion rejects version strings that would escape the cache.
func validVersion(v string) error {
	switch {
	case v == "":
		return errors.New("empty kernel version")
	case v == "." || v == ".." || strings.ContainsAny(v, "/\\\x00\n"):
		return fmt.Errorf("invalid kernel version %q", v)
	}
	return nil
}

func wantKind(path string, dir bool) error {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w (missing %s)", ErrNotCached, path)
	}
	if err != nil {
		return err
	}
	if fi.IsDir() != dir {
		kind := "a file"
		if dir {
			kind = "a directory"
		}
		return fmt.Errorf("%s is not %s: run `make kernel`", path, kind)
	}
	return nil
}
