// Package volume makes the host-side images of kilnd's volumes: ext4 file
// systems in sparse files, which a sandbox mounts through a virtio-blk
// volume slot. Only mke2fs and debugfs (e2fsprogs) touch an image here:
// the host never mounts one, since a guest has written it.
package volume

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Size bounds of an image.
const (
	MinMiB = 16
	MaxMiB = 1 << 20 // 1 TiB
)

// config is the whole mke2fs configuration an image is made with, so
// that the host's /etc/mke2fs.conf does not change what a guest's kernel
// must read: the features of the modules disk (which every guest kernel
// mounts) and a journal, since a guest writes a volume and may be killed.
const config = `[defaults]
	base_features = sparse_super,large_file,filetype,dir_index,ext_attr,has_journal
	blocksize = 4096
	inode_size = 256
	inode_ratio = 16384
	reserved_ratio = 0
[fs_types]
	ext4 = {
		features = extent,huge_file,flex_bg,metadata_csum,64bit,dir_nlink,extra_isize
	}
`

// Make makes an empty ext4 image of sizeMiB at path, which must not
// exist: a sparse file whose root directory any user of the guest may
// write into (mode 1777, as /tmp). On an error nothing is left at path.
func Make(ctx context.Context, path string, sizeMiB uint32) (err error) {
	if sizeMiB < MinMiB || sizeMiB > MaxMiB {
		return fmt.Errorf("volume: %d MiB: want %d to %d", sizeMiB, MinMiB, MaxMiB)
	}
	mke2fs, err := look("mke2fs")
	if err != nil {
		return err
	}
	debugfs, err := look("debugfs")
	if err != nil {
		return err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("volume: %w", err)
	}
	defer func() {
		if err != nil {
			os.Remove(path)
		}
	}()
	err = f.Truncate(int64(sizeMiB) << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("volume: %w", err)
	}
	conf := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".mke2fs.conf")
	if err := os.WriteFile(conf, []byte(config), 0o600); err != nil {
		return fmt.Errorf("volume: %w", err)
	}
	defer os.Remove(conf)
	env := append(os.Environ(), "MKE2FS_CONFIG="+conf)
	if err := run(ctx, env, mke2fs, "-q", "-F", "-t", "ext4", "-L", "kiln-volume", path); err != nil {
		return err
	}
	return run(ctx, nil, debugfs, "-w", "-R", "set_inode_field / mode 041777", path)
}

// run runs a tool, its output in the error when it fails.
func run(ctx context.Context, env []string, tool string, args ...string) error {
	cmd := exec.CommandContext(ctx, tool, args...)
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("volume: %s %s: %w: %s", filepath.Base(tool), strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// look finds an e2fsprogs tool on PATH or in /usr/sbin and /sbin, which a
// user's PATH may lack.
func look(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/sbin"} {
		if p := filepath.Join(d, name); isExec(p) {
			return p, nil
		}
	}
	return "", fmt.Errorf("volume: no %s (Debian: apt-get install e2fsprogs): %w", name, errors.ErrUnsupported)
}

func isExec(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0
}

// The ext4 superblock's fields NeedsRecovery reads: it lies at byte
// 1024; its magic (le16) at 0x38, its incompatible features (le32) at
// 0x60, of which RECOVER says the journal holds writes not yet in place.
const (
	superblock        = 1024
	sbMagic           = 0x38
	sbFeatureIncompat = 0x60
	ext4Magic         = 0xef53
	incompatRecover   = 0x4
)

// NeedsRecovery reports whether the ext4 image at path was left with a
// journal to replay: mounted read-write when its guest stopped without
// unmounting or freezing it. A read-only mount cannot replay it (the
// slot refuses its writes); a read-write one does. It reads two fields of
// the superblock, nothing else of what a guest wrote.
func NeedsRecovery(path string) (bool, error) {
	f, err := os.Open(path)
	if err != nil {
		return false, fmt.Errorf("volume: %w", err)
	}
	defer f.Close()
	var b [sbFeatureIncompat + 4]byte
	if _, err := f.ReadAt(b[:], superblock); err != nil {
		return false, fmt.Errorf("volume %s: its superblock: %w", path, err)
	}
	if binary.LittleEndian.Uint16(b[sbMagic:]) != ext4Magic {
		return false, fmt.Errorf("volume %s: not an ext4 file system (its superblock's magic is %#x)", path, binary.LittleEndian.Uint16(b[sbMagic:]))
	}
	return binary.LittleEndian.Uint32(b[sbFeatureIncompat:])&incompatRecover != 0, nil
}
