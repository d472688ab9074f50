package pid1

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// NewRoot is where SwitchRoot mounts the root filesystem before making it
// the root.
const NewRoot = "/newroot"

// Root device wait: SwitchRoot polls for the device node this often, for up
// to rootWait.
const (
	rootWait = 5 * time.Second
	rootPoll = 20 * time.Millisecond
)

// SwitchRoot makes the filesystem of type fstype (DefaultRootFSType when "")
// on the block device dev the root, the way busybox's switch_root leaves an
// initramfs: it waits up to 5 s for dev to appear (the driver probes it
// asynchronously), mounts it on /newroot with the mount options flags
// (read-only when readOnly), moves /dev, /proc, /sys and /run (with the
// mounts below them) into it, mounts a fresh tmpfs on its /tmp and drops the
// initramfs's, then moves it onto / and chroots into it. pivot_root cannot
// take the initramfs's rootfs away, so the initramfs stays in memory,
// hidden; the running program, read from it, keeps running. Mount points
// missing in the new root are created; on a read-only root only /run and
// /tmp may be missing, and are then skipped.
func (s *Sys) SwitchRoot(dev, fstype, flags string, readOnly bool) error {
	if dev == "" {
		return errors.New("switching root: no root device")
	}
	if fstype == "" {
		fstype = DefaultRootFSType
	}
	if err := s.waitForPath(dev, rootWait, rootPoll); err != nil {
		return fmt.Errorf("switching root: %w", err)
	}
	mflags, data := parseMountOptions(flags)
	if readOnly {
		mflags |= unix.MS_RDONLY
	}
	if err := s.MkdirAll(NewRoot, 0o755); err != nil {
		return fmt.Errorf("switching root: creating %s: %w", NewRoot, err)
	}
	if err := s.Mount(dev, NewRoot, fstype, mflags, data); err != nil {
		return fmt.Errorf("switching root: mounting %s (%s, options %q) on %s: %w", dev, fstype, flags, NewRoot, err)
	}
	return s.enterNewRoot()
}

// enterNewRoot moves /dev, /proc, /sys and /run into the filesystem mounted
// on NewRoot, gives it a fresh /tmp, and makes it the root.
func (s *Sys) enterNewRoot() error {
	for _, m := range []struct {
		dir      string
		optional bool
	}{{"/dev", false}, {"/proc", false}, {"/sys", false}, {"/run", true}} {
		target := NewRoot + m.dir
		if err := s.MkdirAll(target, 0o755); err != nil {
			if m.optional && errors.Is(err, unix.EROFS) {
				continue
			}
			return fmt.Errorf("switching root: creating %s: %w", target, err)
		}
		if err := s.Mount(m.dir, target, "", unix.MS_MOVE, ""); err != nil {
			return fmt.Errorf("switching root: moving %s to %s: %w", m.dir, target, err)
		}
	}
	// The initramfs's /tmp would only be hidden; the new root gets its own.
	if err := s.Unmount("/tmp", unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("switching root: unmounting /tmp: %w", err)
	}
	switch err := s.MkdirAll(NewRoot+"/tmp", 0o755); {
	case errors.Is(err, unix.EROFS):
	case err != nil:
		return fmt.Errorf("switching root: creating %s/tmp: %w", NewRoot, err)
	default:
		if err := s.Mount("tmpfs", NewRoot+"/tmp", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777"); err != nil {
			return fmt.Errorf("switching root: mounting tmpfs on %s/tmp: %w", NewRoot, err)
		}
	}
	if err := s.Chdir(NewRoot); err != nil {
		return fmt.Errorf("switching root: chdir %s: %w", NewRoot, err)
	}
	if err := s.Mount(".", "/", "", unix.MS_MOVE, ""); err != nil {
		return fmt.Errorf("switching root: moving %s onto /: %w", NewRoot, err)
	}
	if err := s.Chroot("."); err != nil {
		return fmt.Errorf("switching root: chroot: %w", err)
	}
	if err := s.Chdir("/"); err != nil {
		return fmt.Errorf("switching root: chdir /: %w", err)
	}
	return nil
}

// waitForPath polls for path to exist, every poll for up to wait.
func (s *Sys) waitForPath(path string, wait, poll time.Duration) error {
	for waited := time.Duration(0); ; waited += poll {
		_, err := s.Stat(path)
		if err == nil {
			return nil
		}
		if waited >= wait {
			return fmt.Errorf("%s did not appear within %v: %w", path, wait, err)
		}
		s.Sleep(poll)
	}
}

// parseMountOptions splits mount -o style options into mount(2) flags and
// the filesystem-specific rest, comma-separated in their order. The last of
// contradicting flags (ro, rw) wins.
func parseMountOptions(opts string) (uintptr, string) {
	var flags uintptr
	var data []string
	for o := range strings.SplitSeq(opts, ",") {
		switch o {
		case "":
		case "defaults":
		case "ro":
			flags |= unix.MS_RDONLY
		case "rw":
			flags &^= unix.MS_RDONLY
		case "nosuid":
			flags |= unix.MS_NOSUID
		case "suid":
			flags &^= unix.MS_NOSUID
		case "nodev":
			flags |= unix.MS_NODEV
		case "dev":
			flags &^= unix.MS_NODEV
		case "noexec":
			flags |= unix.MS_NOEXEC
		case "exec":
			flags &^= unix.MS_NOEXEC
		case "sync":
			flags |= unix.MS_SYNCHRONOUS
		case "async":
			flags &^= unix.MS_SYNCHRONOUS
		case "dirsync":
			flags |= unix.MS_DIRSYNC
		case "noatime":
			flags |= unix.MS_NOATIME
		case "atime":
			flags &^= unix.MS_NOATIME
		case "nodiratime":
			flags |= unix.MS_NODIRATIME
		case "diratime":
			flags &^= unix.MS_NODIRATIME
		case "relatime":
			flags |= unix.MS_RELATIME
		case "norelatime":
			flags &^= unix.MS_RELATIME
		case "strictatime":
			flags |= unix.MS_STRICTATIME
		case "lazytime":
			flags |= unix.MS_LAZYTIME
		case "nolazytime":
			flags &^= unix.MS_LAZYTIME
		default:
			data = append(data, o)
		}
	}
	return flags, strings.Join(data, ",")
}
