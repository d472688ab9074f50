package initramfs

import (
	"bytes"
	"debug/elf"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"sort"

	"github.com/kilnvm/kiln/guestkernel"
)

// AgentModulesDir is where an AgentImage puts its kernel modules, as
// uncompressed <name>.ko files; the agent loads every module there.
const AgentModulesDir = "lib/modules"

// DefaultAgentModules returns the kernel modules an AgentImage carries by
// default: the virtio-mmio transport, the block, network, entropy and vsock
// devices, and ext4 with crc32c_generic, the checksum ext4 asks the crypto
// API for at mount time without naming it in its depends=.
func DefaultAgentModules() []string {
	return []string{
		"virtio_mmio", "virtio_blk", "virtio_net", "virtio_rng",
		"vmw_vsock_virtio_transport", "ext4", "crc32c_generic",
	}
}

// AgentImageModulesDir is where an AgentImage puts the modules only an
// image-rooted sandbox needs (ImageModules); the agent loads them only when
// its root is an image, as pid1.ImageModulesDir.
const AgentImageModulesDir = "lib/kiln/image-modules"

// ImageModules returns the kernel modules an image root needs: erofs (an
// image's default root), virtio-9p (9pnet_virtio, 9p, and their netfs and
// fscache: an image served over 9p, a host directory) and overlayfs.
func ImageModules() []string {
	return []string{"erofs", "9pnet_virtio", "9p", "overlay"}
}

// ImageConfigPath is where ImageConfigArchive puts an image's config, as
// pid1.ImageConfigPath.
const ImageConfigPath = "kiln/image.json"

// AgentImage describes the initramfs of a sandbox VM whose /init is the Kiln
// guest agent (cmd/kiln-agent).
type AgentImage struct {
	// Agent is the host path of the agent binary, statically linked
	// (CGO_ENABLED=0). It becomes /init.
	Agent string
	// Kernel is the kernel whose modules the image carries; nil: none.
	Kernel *guestkernel.Kernel
	// Modules names the modules to carry, with all their dependencies;
	// empty means DefaultAgentModules. Modules built into Kernel are left
	// out.
	Modules []string
	// NoImageModules leaves out ImageModules (they go under
	// AgentImageModulesDir by default, when Kernel is set).
	NoImageModules bool
	// Busybox adds Debian's busybox-static (HostBusybox) as /bin/busybox
	// with symbolic links for BusyboxApplets, /bin/sh among them.
	Busybox bool
	// Files maps archive paths to host paths of further regular files to
	// add, with the host files' permissions. A path that the image has
	// already is an error.
	Files map[string]string
}

// Build returns a Builder holding the image: the agent as /init (mode
// 0755); the modules, decompressed, as /lib/modules/<name>.ko; busybox when
// asked for; the empty directories /proc, /sys, /dev, /tmp, /run, /newroot,
// /etc and /root; /etc/passwd and /etc/group with root; and Files. The same
// inputs give the same archive bytes.
func (a AgentImage) Build() (*Builder, error) {
	return a.build(HostBusybox)
}

func (a AgentImage) build(hostBusybox string) (*Builder, error) {
	if a.Agent == "" {
		return nil, errors.New("initramfs: agent image: no agent binary")
	}
	if err := checkStatic(a.Agent); err != nil {
		return nil, err
	}
	b := New()
	if err := b.AddHostFile("init", a.Agent, 0o755); err != nil {
		return nil, err
	}
	for _, d := range []struct {
		path string
		mode fs.FileMode
	}{
		{"proc", 0o555}, {"sys", 0o555}, {"dev", 0o755}, {"tmp", 0o777 | fs.ModeSticky},
		{"run", 0o755}, {"newroot", 0o755}, {"etc", 0o755}, {"root", 0o700},
	} {
		if err := b.AddDir(d.path, d.mode); err != nil {
			return nil, err
		}
	}
	if err := b.AddFile("etc/passwd", []byte("root:x:0:0:root:/root:/bin/sh\n"), 0o644); err != nil {
		return nil, err
	}
	if err := b.AddFile("etc/group", []byte("root:x:0:\n"), 0o644); err != nil {
		return nil, err
	}
	if a.Kernel != nil {
		if err := a.addModules(b); err != nil {
			return nil, err
		}
	}
	if a.Busybox {
		if err := addBusybox(b, hostBusybox); err != nil {
			return nil, err
		}
	}
	paths := make([]string, 0, len(a.Files))
	for p := range a.Files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		if err := b.AddHostFile(p, a.Files[p], 0); err != nil {
			return nil, fmt.Errorf("initramfs: agent image: extra file: %w", err)
		}
	}
	return b, nil
}

// addModules adds the image's modules and their dependencies, decompressed.
func (a AgentImage) addModules(b *Builder) error {
	names := a.Modules
	if len(names) == 0 {
		names = DefaultAgentModules()
	}
	order, err := a.Kernel.ModuleLoadOrder(names...)
	if err != nil {
		return fmt.Errorf("initramfs: agent image modules: %w", err)
	}
	if err := b.AddDir("lib", 0o755); err != nil {
		return err
	}
	if err := addModuleFiles(b, AgentModulesDir, order); err != nil {
		return err
	}
	if a.NoImageModules {
		return nil
	}
	imgOrder, err := a.Kernel.ModuleLoadOrder(ImageModules()...)
	if err != nil {
		return fmt.Errorf("initramfs: agent image: modules for image roots: %w", err)
	}
	have := map[string]bool{}
	for _, m := range order {
		have[m.Name] = true
	}
	imgOrder = slices.DeleteFunc(imgOrder, func(m guestkernel.Module) bool { return have[m.Name] })
	if err := b.AddDir("lib/kiln", 0o755); err != nil {
		return err
	}
	return addModuleFiles(b, AgentImageModulesDir, imgOrder)
}

// addModuleFiles adds the modules, decompressed, to dir.
func addModuleFiles(b *Builder, dir string, order []guestkernel.Module) error {
	if err := b.AddDir(dir, 0o755); err != nil {
		return err
	}
	for _, m := range order {
		ko, err := guestkernel.ReadModule(m.Path)
		if err != nil {
			return fmt.Errorf("initramfs: agent image: %w", err)
		}
		if err := b.AddFile(dir+"/"+m.Name+".ko", ko, 0o644); err != nil {
			return err
		}
	}
	return nil
}

// addBusybox adds hostBusybox as bin/busybox and its applets' links.
func addBusybox(b *Builder, hostBusybox string) error {
	fi, err := os.Stat(hostBusybox)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("initramfs: %s not found: install Debian's busybox-static package (make deps)", hostBusybox)
	}
	if err != nil {
		return fmt.Errorf("initramfs: %w", err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return fmt.Errorf("initramfs: %s is not an executable file", hostBusybox)
	}
	if err := checkStatic(hostBusybox); err != nil {
		return err
	}
	if err := b.AddHostFile("bin/busybox", hostBusybox, 0o755); err != nil {
		return err
	}
	for _, applet := range BusyboxApplets() {
		if err := b.AddSymlink("bin/"+applet, "busybox"); err != nil {
			return err
		}
	}
	return nil
}

// checkStatic checks that path is an ELF executable without a program
// interpreter, which is all that can run from a bare initramfs.
func checkStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("initramfs: %s is not an ELF executable: %w", path, err)
	}
	defer f.Close()
	if f.Type != elf.ET_EXEC && f.Type != elf.ET_DYN {
		return fmt.Errorf("initramfs: %s is not an executable (ELF type %v)", path, f.Type)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("initramfs: %s is dynamically linked: it cannot run from the initramfs (build it with CGO_ENABLED=0)", path)
		}
	}
	return nil
}

// ImageConfigArchive returns a cpio archive that holds config (JSON in the
// form of pid1.ImageConfig) at ImageConfigPath. Appended to an agent
// initramfs it gives an image-rooted sandbox its image's config: the kernel
// unpacks concatenated archives in order.
func ImageConfigArchive(config []byte) ([]byte, error) {
	b := New()
	if err := b.AddDir("kiln", 0o755); err != nil {
		return nil, err
	}
	if err := b.AddFile(ImageConfigPath, config, 0o644); err != nil {
		return nil, err
	}
	var buf bytes.Buffer
	if _, err := b.WriteTo(&buf); err != nil {
		return nil, err
	}
	return buf.Bytes(), nil
}
