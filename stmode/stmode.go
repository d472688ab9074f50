// Package stmode is a Unix st_mode: its type and permission bits (as in
// Linux's <sys/stat.h>, written here so that it builds on any host) and
// its conversions to and from an io/fs.FileMode. The agent's file calls,
// kiln.v1's FileInfo and EROFS inodes all carry one.
package stmode

import "io/fs"

// The st_mode bits.
const (
	IFMT   = 0o170000 // the type bits
	IFSOCK = 0o140000
	IFLNK  = 0o120000
	IFREG  = 0o100000
	IFBLK  = 0o060000
	IFDIR  = 0o040000
	IFCHR  = 0o020000
	IFIFO  = 0o010000
	ISUID  = 0o4000
	ISGID  = 0o2000
	ISVTX  = 0o1000
)

// FileMode converts a Unix st_mode to an fs.FileMode; a type it does not
// know is fs.ModeIrregular.
func FileMode(st uint32) fs.FileMode {
	m := fs.FileMode(st & 0o777)
	switch st & IFMT {
	case IFDIR:
		m |= fs.ModeDir
	case IFLNK:
		m |= fs.ModeSymlink
	case IFSOCK:
		m |= fs.ModeSocket
	case IFBLK:
		m |= fs.ModeDevice
	case IFCHR:
		m |= fs.ModeDevice | fs.ModeCharDevice
	case IFIFO:
		m |= fs.ModeNamedPipe
	case IFREG:
	default:
		m |= fs.ModeIrregular
	}
	if st&ISUID != 0 {
		m |= fs.ModeSetuid
	}
	if st&ISGID != 0 {
		m |= fs.ModeSetgid
	}
	if st&ISVTX != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// FromFileMode converts an fs.FileMode to a Unix st_mode; an irregular
// file gets no type bits.
func FromFileMode(m fs.FileMode) uint32 {
	st := uint32(m.Perm())
	switch {
	case m&fs.ModeDir != 0:
		st |= IFDIR
	case m&fs.ModeSymlink != 0:
		st |= IFLNK
	case m&fs.ModeSocket != 0:
		st |= IFSOCK
	case m&fs.ModeNamedPipe != 0:
		st |= IFIFO
	case m&fs.ModeCharDevice != 0:
		st |= IFCHR
	case m&fs.ModeDevice != 0:
		st |= IFBLK
	case m&fs.ModeIrregular == 0:
		st |= IFREG
	}
	if m&fs.ModeSetuid != 0 {
		st |= ISUID
	}
	if m&fs.ModeSetgid != 0 {
		st |= ISGID
	}
	if m&fs.ModeSticky != 0 {
		st |= ISVTX
	}
	return st
}
