package initramfs

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
)

// HostBusybox is where Debian's busybox-static package installs its
// statically linked busybox.
const HostBusybox = "/bin/busybox"

// BusyboxApplets returns the applets BusyboxInit links in /bin.
func BusyboxApplets() []string {
	return []string{
		"[", "ash", "awk", "base64", "cat", "chmod", "chroot", "cp", "cut", "date", "dd",
		"dmesg", "echo", "env", "false", "find", "grep", "halt", "head", "hostname",
		"id", "insmod", "ip", "kill", "ln", "ls", "lsmod", "md5sum", "mkdir", "mknod",
		"modinfo", "modprobe", "mount", "mv", "nproc", "ping", "poweroff", "printf", "ps", "reboot", "rm", "rmmod", "sed", "seq", "sh",
		"sha256sum", "sleep", "sort", "stat", "sync", "tail", "tee", "test", "timeout", "touch",
		"tr", "true", "umount", "uname", "uniq", "wc", "wget", "xargs",
	}
}

// BusyboxInit returns a Builder holding an initramfs that runs script as
// /init under busybox's sh: /bin/busybox (copied from HostBusybox, from
// Debian's busybox-static package) with symlinks for BusyboxApplets, empty
// /dev, /proc, /sys, /tmp, /root, /etc and /mnt, and /init =
// "#!/bin/busybox sh\n" + script. The script should end by powering off
// (poweroff -f); when init exits the kernel panics.
func BusyboxInit(script string) (*Builder, error) {
	return busyboxInit(HostBusybox, script)
}

func busyboxInit(hostBusybox, script string) (*Builder, error) {
	fi, err := os.Stat(hostBusybox)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("initramfs: %s not found: install Debian's busybox-static package (make deps)", hostBusybox)
	}
	if err != nil {
		return nil, fmt.Errorf("initramfs: %w", err)
	}
	if !fi.Mode().IsRegular() || fi.Mode().Perm()&0o111 == 0 {
		return nil, fmt.Errorf("initramfs: %s is not an executable file", hostBusybox)
	}
	b := New()
	if err := b.AddHostFile("bin/busybox", hostBusybox, 0o755); err != nil {
		return nil, err
	}
	for _, a := range BusyboxApplets() {
		if err := b.AddSymlink("bin/"+a, "busybox"); err != nil {
			return nil, err
		}
	}
	for _, d := range []string{"dev", "proc", "sys", "tmp", "root", "etc", "mnt"} {
		mode := os.FileMode(0o755)
		if d == "tmp" {
			mode = 0o777 | fs.ModeSticky
		}
		if err := b.AddDir(d, mode); err != nil {
			return nil, err
		}
	}
	if err := b.AddFile("init", []byte("#!/bin/busybox sh\n"+script), 0o755); err != nil {
		return nil, err
	}
	return b, nil
}
