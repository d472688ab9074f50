package pid1

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// CgroupRoot is where MountBase mounts the cgroup2 hierarchy.
const CgroupRoot = "/sys/fs/cgroup"

// mountInfo is the file listing the mounts of the process's namespace.
const mountInfo = "/proc/self/mountinfo"

// mountSpec is one mount MountBase makes.
type mountSpec struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
}

// baseMounts returns MountBase's mounts, parents before children.
func baseMounts() []mountSpec {
	const nsn = unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC
	return []mountSpec{
		{"proc", "/proc", "proc", nsn, ""},
		{"sysfs", "/sys", "sysfs", nsn, ""},
		{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
		{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0620,ptmxmode=0666"},
		{"shm", "/dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
		{"tmpfs", "/tmp", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
		{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
		{"cgroup2", CgroupRoot, "cgroup2", nsn, ""},
	}
}

// devLinks returns the symbolic links MountBase makes in /dev, link to
// target.
func devLinks() [][2]string {
	return [][2]string{
		{"/dev/fd", "/proc/self/fd"},
		{"/dev/stdin", "/proc/self/fd/0"},
		{"/dev/stdout", "/proc/self/fd/1"},
		{"/dev/stderr", "/proc/self/fd/2"},
	}
}

// cgroupControllers returns the controllers MountBase enables for the
// children of the root cgroup, where the kernel has them.
func cgroupControllers() []string { return []string{"memory", "pids"} }

// MountBase mounts /proc, /sys, /dev (devtmpfs), /dev/pts, /dev/shm, /tmp and
// /run (tmpfs) and the cgroup2 hierarchy on /sys/fs/cgroup, creating the
// mount points, and links /dev/fd, /dev/stdin, /dev/stdout and /dev/stderr
// into /proc/self/fd. A filesystem already mounted on its mount point (in
// /proc/self/mountinfo, or EBUSY from mount) is left as it is. It then
// enables the memory and pids controllers for the root cgroup's children,
// those of them that the kernel has.
func (s *Sys) MountBase() error {
	for _, m := range baseMounts() {
		if err := s.mountOnce(m); err != nil {
			return err
		}
	}
	for _, l := range devLinks() {
		if err := s.Symlink(l[1], l[0]); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("linking %s to %s: %w", l[0], l[1], err)
		}
	}
	return s.enableControllers(CgroupRoot, cgroupControllers())
}

// mountOnce mounts m unless something is mounted on its target already.
func (s *Sys) mountOnce(m mountSpec) error {
	if s.isMountPoint(m.target) {
		return nil
	}
	if err := s.MkdirAll(m.target, 0o755); err != nil {
		return fmt.Errorf("creating mount point %s: %w", m.target, err)
	}
	err := s.Mount(m.source, m.target, m.fstype, m.flags, m.data)
	if err != nil && !errors.Is(err, unix.EBUSY) {
		return fmt.Errorf("mounting %s on %s: %w", m.fstype, m.target, err)
	}
	return nil
}

// isMountPoint reports whether mountinfo lists target; false when it cannot
// be read (before /proc is mounted).
func (s *Sys) isMountPoint(target string) bool {
	data, err := s.ReadFile(mountInfo)
	if err != nil {
		return false
	}
	for _, p := range MountPoints(data) {
		if p == target {
			return true
		}
	}
	return false
}

// MountPoints returns the mount points (fifth field) of the lines of a
// /proc/<pid>/mountinfo file, unescaped.
func MountPoints(mountinfo []byte) []string {
	var points []string
	for line := range bytes.SplitSeq(mountinfo, []byte{'\n'}) {
		f := strings.Fields(string(line))
		if len(f) < 5 {
			continue
		}
		points = append(points, unescapeOctal(f[4]))
	}
	return points
}

// unescapeOctal undoes the kernel's escaping of space, tab, newline and
// backslash in mountinfo paths as \ooo.
func unescapeOctal(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// enableControllers enables, for the children of the cgroup at dir, each of
// want that dir's cgroup.controllers lists. A missing cgroup.controllers
// (no cgroup2) enables nothing.
func (s *Sys) enableControllers(dir string, want []string) error {
	data, err := s.ReadFile(dir + "/cgroup.controllers")
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("reading the cgroup controllers: %w", err)
	}
	have := map[string]bool{}
	for _, c := range strings.Fields(string(data)) {
		have[c] = true
	}
	for _, c := range want {
		if !have[c] {
			continue
		}
		if err := s.WriteFile(dir+"/cgroup.subtree_control", []byte("+"+c)); err != nil {
			return fmt.Errorf("enabling the %s cgroup controller: %w", c, err)
		}
	}
	return nil
}
