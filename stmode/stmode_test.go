package stmode

import (
	"io/fs"
	"testing"
)

func TestConvert(t *testing.T) {
	for _, tt := range []struct {
		st   uint32
		mode fs.FileMode
	}{
		{IFREG | 0o644, 0o644},
		{IFDIR | 0o755, fs.ModeDir | 0o755},
		{IFLNK | 0o777, fs.ModeSymlink | 0o777},
		{IFSOCK | 0o600, fs.ModeSocket | 0o600},
		{IFBLK | 0o660, fs.ModeDevice | 0o660},
		{IFCHR | 0o666, fs.ModeDevice | fs.ModeCharDevice | 0o666},
		{IFIFO | 0o600, fs.ModeNamedPipe | 0o600},
		{IFREG | ISUID | 0o755, fs.ModeSetuid | 0o755},
		{IFDIR | ISGID | ISVTX | 0o1777&0o777, fs.ModeDir | fs.ModeSetgid | fs.ModeSticky | 0o777},
	} {
		if got := FileMode(tt.st); got != tt.mode {
			t.Errorf("FileMode(%#o) = %v, want %v", tt.st, got, tt.mode)
		}
		if got := FromFileMode(tt.mode); got != tt.st {
			t.Errorf("FromFileMode(%v) = %#o, want %#o", tt.mode, got, tt.st)
		}
	}
	// A type st_mode does not have is irregular, and stays typeless.
	if got := FileMode(0o070000 | 0o644); got != fs.ModeIrregular|0o644 {
		t.Errorf("FileMode of an unknown type = %v", got)
	}
	if got := FromFileMode(fs.ModeIrregular | 0o644); got != 0o644 {
		t.Errorf("FromFileMode(irregular) = %#o", got)
	}
}
