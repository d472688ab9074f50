package pid1

import (
	"errors"
	"fmt"
	"log/slog"
	"path"

	"golang.org/x/sys/unix"
)

// The kernel's module autoloading in the guest.
//
// request_module runs the usermode helper named in ModprobeSysctl
// (CONFIG_MODPROBE_PATH, /sbin/modprobe) as `HELPER -q -- NAME`. The
// helper is looked up in process 1's root: the kernel's usermode-helper
// threads share one fs_struct with process 1 (both come from the boot
// task with CLONE_FS), so after SwitchRoot, and after an exec of systemd,
// the lookup happens in the final root. A root without kmod (Debian's
// minbase, most slim images) has no /sbin/modprobe, so every autoload
// failed there: ip link add type veth, nftables, a bridge, an overlay
// mount.
//
// InstallModprobeHelper points the kernel at ModprobeHelper instead: the
// agent binary itself (a multi-call binary: run as .../modprobe it is
// guest/modprobe), bound from /proc/self/exe onto an empty file in /run.
// Why this way:
//   - /proc/self/exe is process 1's own executable, the initramfs's
//     /init, resolved even after the switch of root hid the initramfs; a
//     bind mount copies nothing, where a copy into the root would put
//     megabytes more into guest RAM (and into a read-only root, not at
//     all).
//   - /run is the tmpfs MountBase made, moved into the final root with
//     its mounts (enterNewRoot), so the path is the same in the
//     initramfs, a disk root and an image root; systemd, as process 1
//     after kiln.init=systemd, keeps a /run that is already a mount point
//     (its mount_setup skips mounted API filesystems), and the agent's
//     service runs its own copy (AgentServiceBinary), not this one.
//   - It is done once the final root is in place, so one code path serves
//     every root, and a read-only root without /run is merely left
//     without the helper (a warning).
//
// The root's own /sbin/modprobe is not touched, and the kernel uses Kiln's
// one even where the root has kmod: the modules are Kiln's (the modules
// disk, ModulesMountPoint), which Kiln's modprobe is made and tested to
// read, so autoloading behaves the same in every root, whether the root's
// modprobe is kmod, busybox's, a stub linked to /bin/true as some
// container images ship, or one too old for the kernel's depmod files.
// What that gives up is the root's /etc/modprobe.d (options, blacklists,
// install commands) for autoloaded modules; a user's own `modprobe` runs
// the root's.
const (
	// ModprobeHelper is the kernel's modprobe helper in the final root.
	ModprobeHelper = "/run/kiln/modprobe"
	// ModprobeSysctl names the kernel's helper.
	ModprobeSysctl = "/proc/sys/kernel/modprobe"
	// selfExe is process 1's executable, the agent binary.
	selfExe = "/proc/self/exe"
)

// InstallModprobeHelper makes ModprobeHelper the kernel's module-loading
// helper in the current root (see ModprobeHelper): it creates the empty
// file, binds the running executable onto it read-only and writes its
// path to ModprobeSysctl. A root where ModprobeHelper's folder cannot be
// made because it is read-only (no /run) keeps the kernel's helper as it
// is, with a warning. A nil log discards.
func (s *Sys) InstallModprobeHelper(log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	dir := path.Dir(ModprobeHelper)
	if err := s.MkdirAll(dir, 0o755); err != nil {
		if errors.Is(err, unix.EROFS) {
			log.Warn("the read-only root has no /run: the kernel's module autoloading keeps its own helper", "helper", ModprobeHelper)
			return nil
		}
		return fmt.Errorf("modprobe helper: creating %s: %w", dir, err)
	}
	if err := s.CreateFile(ModprobeHelper, 0o755); err != nil {
		return fmt.Errorf("modprobe helper: creating %s: %w", ModprobeHelper, err)
	}
	if err := s.Mount(selfExe, ModprobeHelper, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("modprobe helper: binding %s on %s: %w", selfExe, ModprobeHelper, err)
	}
	if err := s.Mount("", ModprobeHelper, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY, ""); err != nil {
		return fmt.Errorf("modprobe helper: making %s read-only: %w", ModprobeHelper, err)
	}
	if err := s.WriteFile(ModprobeSysctl, []byte(ModprobeHelper)); err != nil {
		return fmt.Errorf("modprobe helper: naming it in %s: %w", ModprobeSysctl, err)
	}
	log.Info("kernel module autoloading through the agent", "helper", ModprobeHelper)
	return nil
}
