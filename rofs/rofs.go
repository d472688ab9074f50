// Package rofs is the seam between a read-only file tree and the servers
// that export it to a guest: an image's merged layers (image/tree) implement
// FS, and the 9P2000.L server (ninep) serves any FS. Files are named by
// inode number, which is stable for a given tree (the same image digest
// always gives the same numbers), so a server's state (its fid table) can
// be saved in a snapshot and restored against a tree rebuilt in another
// process.
//
// Errors: implementations return errors that wrap a syscall.Errno (ENOENT,
// ENOTDIR, ENODATA, EIO, ...) where the guest must see that errno; a server
// answers any other error with EIO.
package rofs

import (
	"context"
	"time"
)

// Attr is a file's attributes.
type Attr struct {
	Ino   uint64
	Mode  uint32 // file type (S_IFREG, S_IFDIR, ...) and permission bits, setuid/setgid/sticky included
	UID   uint32
	GID   uint32
	Nlink uint32
	Rdev  uint64 // device number (unix.Mkdev) for character and block devices
	Size  int64
	Mtime time.Time
}

// Dirent is one directory entry.
type Dirent struct {
	Name string
	Ino  uint64
	Mode uint32 // the entry's file type (S_IFMT bits)
}

// StatFS describes the whole tree, for statfs(2).
type StatFS struct {
	BlockSize uint32
	Blocks    uint64 // total size in BlockSize units
	Files     uint64 // number of inodes
	NameLen   uint32 // longest name
}

// FS is a read-only file tree addressed by inode number. Its methods are
// safe for concurrent use. Only ReadAt may block on I/O (a lazy fetch);
// the others answer from memory.
type FS interface {
	// Root is the inode number of the root directory.
	Root() uint64
	// Getattr returns ino's attributes (ENOENT for an unknown ino).
	Getattr(ino uint64) (Attr, error)
	// Lookup returns the inode number of name in directory dir (ENOENT,
	// ENOTDIR). name is one path element; "." and ".." are the caller's.
	Lookup(dir uint64, name string) (uint64, error)
	// ReadDir returns dir's entries, without "." and "..", in an order that
	// is the same on every call (ENOTDIR).
	ReadDir(dir uint64) ([]Dirent, error)
	// Readlink returns a symbolic link's target (EINVAL if ino is not one).
	Readlink(ino uint64) (string, error)
	// ReadAt reads a regular file's bytes at off, as io.ReaderAt does (a
	// short read at the end of the file returns io.EOF). It may block on
	// a fetch; ctx bounds it. Data that cannot be fetched or fails its
	// check returns an error wrapping EIO.
	ReadAt(ctx context.Context, ino uint64, p []byte, off int64) (int, error)
	// Getxattr returns the value of extended attribute name (ENODATA when
	// the file has none of that name).
	Getxattr(ino uint64, name string) ([]byte, error)
	// Listxattr returns the names of ino's extended attributes.
	Listxattr(ino uint64) ([]string, error)
	// StatFS describes the tree.
	StatFS() StatFS
}
