// Package fsverity seals a file with fs-verity and measures it: once
// enabled, the file can never be written again, and the kernel checks
// every page read from it (read, mmap) against a Merkle tree whose root
// the file's digest names, failing a read whose data does not match
// (EIO, or SIGBUS in a mapping). Only some file systems have it (ext4
// made or tuned with the verity feature, btrfs, f2fs); elsewhere Enable
// and Measure say ErrUnsupported.
//
// Kiln uses SHA-256 and 4 KiB blocks with no salt, so a file's digest
// depends on its bytes only.
package fsverity

import (
	"encoding/hex"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// Errors a caller tells apart (errors.Is).
var (
	// ErrUnsupported: the file's file system (or the kernel) has no
	// fs-verity, or not with Kiln's parameters.
	ErrUnsupported = errors.New("fs-verity is not supported here")
	// ErrNotEnabled: the file has no fs-verity (Measure).
	ErrNotEnabled = errors.New("the file has no fs-verity")
)

// Digest is a file's fs-verity digest (SHA-256 of its fsverity
// descriptor: the Merkle tree's root, the file's size and parameters).
type Digest [32]byte

// String is the digest in hex.
func (d Digest) String() string { return hex.EncodeToString(d[:]) }

// ParseDigest reads a digest from hex.
func ParseDigest(s string) (Digest, error) {
	var d Digest
	b, err := hex.DecodeString(s)
	if err != nil || len(b) != len(d) {
		return d, fmt.Errorf("fs-verity digest %.80q: want %d hex digits", s, 2*len(d))
	}
	copy(d[:], b)
	return d, nil
}

// The parameters Kiln enables fs-verity with.
const (
	hashSHA256 = 1 // FS_VERITY_HASH_ALG_SHA256
	blockSize  = 4096
)

// Enable turns fs-verity on for f, which must be open read-only with no
// writer left anywhere: the kernel reads the whole file to build its
// Merkle tree (the cost is a read and a hash of every block, holes
// included). A file that has it already is left as it is.
func Enable(f *os.File) error {
	err := enable(int(f.Fd()))
	switch {
	case err == nil, errors.Is(err, unix.EEXIST):
		return nil
	case unsupported(err):
		return fmt.Errorf("%s: %w (%w)", f.Name(), ErrUnsupported, err)
	}
	return fmt.Errorf("%s: enable fs-verity: %w", f.Name(), err)
}

// Measure returns f's fs-verity digest: ErrNotEnabled when f has none,
// ErrUnsupported where its file system has no fs-verity.
func Measure(f *os.File) (Digest, error) {
	d, alg, err := measure(int(f.Fd()))
	switch {
	case err == nil:
	case errors.Is(err, unix.ENODATA):
		return d, fmt.Errorf("%s: %w", f.Name(), ErrNotEnabled)
	case unsupported(err):
		return d, fmt.Errorf("%s: %w (%w)", f.Name(), ErrUnsupported, err)
	default:
		return d, fmt.Errorf("%s: measure fs-verity: %w", f.Name(), err)
	}
	if alg != hashSHA256 {
		return Digest{}, fmt.Errorf("%s: fs-verity with hash algorithm %d, not SHA-256", f.Name(), alg)
	}
	return d, nil
}

// unsupported says whether err means "no fs-verity here": no such ioctl
// (ENOTTY), a file system without it (EOPNOTSUPP), or parameters it does
// not take (EINVAL: a block size other than the page's).
func unsupported(err error) bool {
	return errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EINVAL)
}
