package stmode

import (
	"syscall"
	"testing"
)

// TestLinuxBits checks the bits against the kernel's, as Go's syscall
// package has them.
func TestLinuxBits(t *testing.T) {
	for _, tt := range []struct {
		name      string
		ours, sys uint32
	}{
		{"IFMT", IFMT, syscall.S_IFMT}, {"IFSOCK", IFSOCK, syscall.S_IFSOCK}, {"IFLNK", IFLNK, syscall.S_IFLNK},
		{"IFREG", IFREG, syscall.S_IFREG}, {"IFBLK", IFBLK, syscall.S_IFBLK}, {"IFDIR", IFDIR, syscall.S_IFDIR},
		{"IFCHR", IFCHR, syscall.S_IFCHR}, {"IFIFO", IFIFO, syscall.S_IFIFO}, {"ISUID", ISUID, syscall.S_ISUID},
		{"ISGID", ISGID, syscall.S_ISGID}, {"ISVTX", ISVTX, syscall.S_ISVTX},
	} {
		if tt.ours != tt.sys {
			t.Errorf("%s = %#o, Linux's %#o", tt.name, tt.ours, tt.sys)
		}
	}
}
