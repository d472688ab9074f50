package jail

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"

	"golang.org/x/sys/unix"
)

// Rlimits a jailed process runs under.
const (
	// MaxFiles is RLIMIT_NOFILE, soft and hard.
	MaxFiles = 4096
	// MaxProcs is RLIMIT_NPROC: threads of the jail's uid (one per
	// sandbox, so this process's own).
	MaxProcs = 512
)

// RootDir is the folder under Config.Dir that becomes the jail's root.
const RootDir = "root"

// Bind is a host path the jail holds, mounted at the same path inside it.
type Bind struct {
	// Path is absolute; a file or a directory (not recursive: mounts
	// beneath it are not carried).
	Path string `json:"path"`
	// ReadOnly mounts it read-only.
	ReadOnly bool `json:"ro,omitempty"`
}

// Config is a jail.
type Config struct {
	// Dir is an absolute folder of this sandbox's; the root is a tmpfs
	// mounted at Dir/root (created), visible only in the process's own
	// mount namespace.
	Dir string `json:"dir"`
	// UID and GID are the process's ids once jailed; not 0.
	UID int `json:"uid"`
	GID int `json:"gid"`
	// Binds are all the jail holds.
	Binds []Bind `json:"binds"`
	// ParentMountNS is the inode of the starting process's mount
	// namespace (MountNS): Enter refuses to run in it. Zero compares
	// with init's (/proc/1/ns/mnt) instead.
	ParentMountNS uint64 `json:"parent_mnt_ns,omitempty"`
}

// MountNS returns the inode of the calling process's mount namespace, for
// Config.ParentMountNS.
func MountNS() (uint64, error) {
	var st unix.Stat_t
	if err := unix.Stat("/proc/self/ns/mnt", &st); err != nil {
		return 0, fmt.Errorf("jail: its mount namespace: %w", err)
	}
	return st.Ino, nil
}

// Validate checks c without touching anything.
func (c Config) Validate() error {
	if c.Dir == "" || !filepath.IsAbs(c.Dir) {
		return fmt.Errorf("jail: folder %q is not an absolute path", c.Dir)
	}
	if c.UID <= 0 || c.GID <= 0 {
		return fmt.Errorf("jail: uid %d / gid %d: a jail needs ids other than root's", c.UID, c.GID)
	}
	for _, b := range c.Binds {
		if !filepath.IsAbs(b.Path) || filepath.Clean(b.Path) != b.Path || b.Path == "/" {
			return fmt.Errorf("jail: bind %q is not a clean absolute path below /", b.Path)
		}
		if _, err := os.Stat(b.Path); err != nil {
			return fmt.Errorf("jail: bind %s: %w", b.Path, err)
		}
	}
	return nil
}

// Enter jails the calling process as c says, in this order: check that it
// has a mount namespace of its own; make every mount private; mount a
// tmpfs at c.Dir/root and bind c.Binds into it at their own paths;
// pivot_root into it and detach the old root; make the root read-only;
// set rlimits (NOFILE MaxFiles, MEMLOCK 0, CORE 0, NPROC MaxProcs); clear
// the capability bounding and ambient sets; drop supplementary groups and
// take c.GID and c.UID (real, effective and saved) on every thread, which
// clears the permitted and effective sets; set NO_NEW_PRIVS on every
// thread. It checks that the effective set is empty at the end. A failure
// part way leaves the process half jailed: its caller must exit.
// Descriptors open before stay open (what the VMM built with).
func Enter(c Config) error {
	if err := c.Validate(); err != nil {
		return err
	}
	if err := checkOwnMountNS(c.ParentMountNS); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("jail: make the mounts private: %w", err)
	}
	root := filepath.Join(c.Dir, RootDir)
	if err := os.MkdirAll(root, 0o700); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	if err := unix.Mount("tmpfs", root, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "size=1m,mode=0755"); err != nil {
		return fmt.Errorf("jail: mount the root's tmpfs at %s: %w", root, err)
	}
	for _, b := range c.Binds {
		if err := bind(root, b); err != nil {
			return err
		}
	}
	if err := pivot(root); err != nil {
		return err
	}
	if err := unix.Mount("", "/", "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("jail: make the root read-only: %w", err)
	}
	if err := setRlimits(); err != nil {
		return err
	}
	if err := dropCaps(); err != nil {
		return err
	}
	if err := syscall.Setgroups(nil); err != nil {
		return fmt.Errorf("jail: drop supplementary groups: %w", err)
	}
	if err := syscall.Setresgid(c.GID, c.GID, c.GID); err != nil {
		return fmt.Errorf("jail: setresgid %d: %w", c.GID, err)
	}
	if err := syscall.Setresuid(c.UID, c.UID, c.UID); err != nil {
		return fmt.Errorf("jail: setresuid %d: %w", c.UID, err)
	}
	if _, _, errno := syscall.AllThreadsSyscall(syscall.SYS_PRCTL, unix.PR_SET_NO_NEW_PRIVS, 1, 0); errno != 0 {
		return fmt.Errorf("jail: set NO_NEW_PRIVS on every thread: %w", errno)
	}
	return checkNoCaps()
}

// checkOwnMountNS refuses to touch mounts in the mount namespace of the
// parent (parent, its inode) or, when that is not given, of init: a
// process not started with CLONE_NEWNS would change its parent's mounts.
func checkOwnMountNS(parent uint64) error {
	self, err := MountNS()
	if err != nil {
		return err
	}
	whose := "its parent's"
	if parent == 0 {
		whose = "init's"
		var st unix.Stat_t
		if err := unix.Stat("/proc/1/ns/mnt", &st); err != nil {
			return fmt.Errorf("jail: init's mount namespace (set Config.ParentMountNS): %w", err)
		}
		parent = st.Ino
	}
	if self == parent {
		return fmt.Errorf("jail: the process shares %s mount namespace: start it in one of its own (CLONE_NEWNS)", whose)
	}
	return nil
}

// bind mounts b at the same path under root.
func bind(root string, b Bind) error {
	fi, err := os.Stat(b.Path)
	if err != nil {
		return fmt.Errorf("jail: bind %s: %w", b.Path, err)
	}
	target := filepath.Join(root, b.Path)
	if fi.IsDir() {
		err = os.MkdirAll(target, 0o755)
	} else if err = os.MkdirAll(filepath.Dir(target), 0o755); err == nil {
		var f *os.File
		if f, err = os.OpenFile(target, os.O_RDONLY|os.O_CREATE, 0o600); err == nil {
			f.Close()
		}
	}
	if err != nil {
		return fmt.Errorf("jail: bind %s: make its mount point: %w", b.Path, err)
	}
	if err := unix.Mount(b.Path, target, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("jail: bind %s: %w", b.Path, err)
	}
	flags := uintptr(unix.MS_BIND | unix.MS_REMOUNT | unix.MS_NOSUID | unix.MS_NOEXEC)
	if fi.Mode()&os.ModeDevice == 0 {
		flags |= unix.MS_NODEV
	}
	if b.ReadOnly {
		flags |= unix.MS_RDONLY
	}
	// Flags the source's mount has (nodev, ro, …) stay: a remount that
	// dropped one would fail with EPERM.
	var st unix.Statfs_t
	if err := unix.Statfs(b.Path, &st); err == nil {
		flags |= uintptr(st.Flags) & (unix.MS_RDONLY | unix.MS_NODEV | unix.MS_NOATIME | unix.MS_RELATIME | unix.MS_NODIRATIME)
	}
	if err := unix.Mount("", target, "", flags, ""); err != nil {
		return fmt.Errorf("jail: bind %s: restrict it: %w", b.Path, err)
	}
	return nil
}

// pivot makes root the process's root and detaches the old one.
func pivot(root string) error {
	if err := unix.Chdir(root); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	// pivot_root(".", "."): the old root is stacked on the new one,
	// then detached; no folder for it is needed.
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("jail: pivot_root into %s: %w", root, err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("jail: detach the old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return fmt.Errorf("jail: %w", err)
	}
	return nil
}

func setRlimits() error {
	for _, l := range []struct {
		name     string
		resource int
		v        uint64
	}{
		{"NOFILE", unix.RLIMIT_NOFILE, MaxFiles},
		{"MEMLOCK", unix.RLIMIT_MEMLOCK, 0},
		{"CORE", unix.RLIMIT_CORE, 0},
		{"NPROC", unix.RLIMIT_NPROC, MaxProcs},
	} {
		if err := unix.Setrlimit(l.resource, &unix.Rlimit{Cur: l.v, Max: l.v}); err != nil {
			return fmt.Errorf("jail: RLIMIT_%s %d: %w", l.name, l.v, err)
		}
	}
	return nil
}

// dropCaps clears the bounding set (every capability the kernel knows,
// up to the first it refuses as unknown) and the ambient set, on every
// thread.
func dropCaps() error {
	for c := uintptr(0); c < 64; c++ {
		_, _, errno := syscall.AllThreadsSyscall(syscall.SYS_PRCTL, unix.PR_CAPBSET_DROP, c, 0)
		if errno == unix.EINVAL && c > 0 {
			break // past CAP_LAST_CAP
		}
		if errno == syscall.ENOTSUP {
			return errors.New("jail: this binary uses cgo, so the Go runtime cannot change every thread: build it with CGO_ENABLED=0")
		}
		if errno != 0 {
			return fmt.Errorf("jail: drop capability %d from the bounding set: %w", c, errno)
		}
	}
	if _, _, errno := syscall.AllThreadsSyscall6(syscall.SYS_PRCTL, unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0, 0); errno != 0 {
		return fmt.Errorf("jail: clear the ambient capabilities: %w", errno)
	}
	return nil
}

// checkNoCaps checks that the calling thread has no capability left.
func checkNoCaps() error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("jail: capget: %w", err)
	}
	for _, d := range data {
		if d.Effective != 0 || d.Permitted != 0 {
			return fmt.Errorf("jail: capabilities left after the drop (effective %#x, permitted %#x)", d.Effective, d.Permitted)
		}
	}
	return nil
}
