package guestkernel

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
)

// A modules disk is a read-only ext4 image of a kernel's lib/modules/<release>
// tree (ModulesDir, with modules.dep and the other depmod files), built once
// per kernel and shared by every sandbox of it: the guest mounts it at
// ModulesMountPoint(release), so that modprobe finds every module of its
// kernel whatever its root filesystem.
//
// The image is deterministic: the same tree gives the same bytes. Its
// UUID and directory hash seed are derived from the release, every inode's
// owner is 0:0 and its times ModulesDiskEpoch, and mke2fs reads no host
// configuration. Its superblock says what it is: the volume label
// ModulesDiskLabel, the release in its last-mounted path
// (/lib/modules/<release>) and the UUID ModulesDiskUUID(release), which
// ParseModulesSuperblock checks (the host before it attaches a disk, the
// guest before it mounts one).
const (
	// ModulesDiskLabel is a modules disk's ext4 volume label.
	ModulesDiskLabel = "kiln-modules"
	// ModulesDiskVersion is the layout version in a modules disk's file
	// name: a change of how the disk is built changes it.
	ModulesDiskVersion = 1
	// ModulesDiskEpoch is every time in a modules disk (2000-01-01 UTC).
	ModulesDiskEpoch = 946684800
)

// ErrNotModulesDisk is returned (wrapped) for a file or superblock that is
// not a complete Kiln modules disk: another file, a truncated or corrupt
// one.
var ErrNotModulesDisk = errors.New("not a Kiln modules disk")

// modulesPrefix starts a modules disk's last-mounted path.
const modulesPrefix = "/lib/modules/"

// The ext4 superblock: where it is in the image, and its fields a modules
// disk is checked by.
const (
	superblockOffset = 1024
	superblockSize   = 1024
	sbBlocksCountLo  = 0x04
	sbLogBlockSize   = 0x18
	sbMagic          = 0x38
	sbFeatureIncompt = 0x60
	sbUUID           = 0x68
	sbVolumeName     = 0x78
	sbLastMounted    = 0x88
	sbBlocksCountHi  = 0x150
	ext4Magic        = 0xEF53
	incompat64bit    = 0x80
	lastMountedBytes = 64
)

// ModulesMountPoint is where a guest of kernel release mounts its modules
// disk.
func ModulesMountPoint(release string) string { return modulesPrefix + release }

// ModulesDiskName is the file name of release's modules disk in a cache
// folder: <release>-v<ModulesDiskVersion>.ext4.
func ModulesDiskName(release string) string {
	return fmt.Sprintf("%s-v%d.ext4", release, ModulesDiskVersion)
}

// ModulesDiskUUID is the ext4 UUID of release's modules disk, in its
// textual form.
func ModulesDiskUUID(release string) string {
	return formatUUID(derivedUUID("kiln modules disk uuid", release))
}

// modulesHashSeed is the directory hash seed of release's modules disk.
func modulesHashSeed(release string) string {
	return formatUUID(derivedUUID("kiln modules disk hash seed", release))
}

// derivedUUID is a name-based UUID (version 5's layout, SHA-256) of
// release in the domain what.
func derivedUUID(what, release string) [16]byte {
	sum := sha256.Sum256([]byte(what + "\x00" + release))
	var u [16]byte
	copy(u[:], sum[:16])
	u[6] = u[6]&0x0f | 0x50
	u[8] = u[8]&0x3f | 0x80
	return u
}

func formatUUID(u [16]byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// checkModulesRelease refuses a release that cannot name a modules disk.
func checkModulesRelease(release string) error {
	if err := validVersion(release); err != nil {
		return err
	}
	if len(modulesPrefix)+len(release) >= lastMountedBytes {
		return fmt.Errorf("kernel release %q is too long for a modules disk (at most %d bytes)", release, lastMountedBytes-1-len(modulesPrefix))
	}
	for _, r := range release {
		if r <= ' ' || r >= 0x7f || r == '"' || r == '\'' {
			return fmt.Errorf("kernel release %q: want printable ASCII without spaces or quotes", release)
		}
	}
	return nil
}

// ModulesSuperblock is what a modules disk's superblock says.
type ModulesSuperblock struct {
	// Release is the kernel release whose modules the disk holds.
	Release string
	// Size is the filesystem's size in bytes.
	Size int64
}

// ParseModulesSuperblock checks the ext4 superblock sb (the
// superblockSize bytes at offset 1024 of an image) of a modules disk: the
// ext4 magic, ModulesDiskLabel, a last-mounted path /lib/modules/<release>
// and the UUID derived from that release. Anything else is an error
// wrapping ErrNotModulesDisk.
func ParseModulesSuperblock(sb []byte) (ModulesSuperblock, error) {
	var out ModulesSuperblock
	if len(sb) < superblockSize {
		return out, fmt.Errorf("%w: superblock of %d bytes, want %d", ErrNotModulesDisk, len(sb), superblockSize)
	}
	le := binary.LittleEndian
	if m := le.Uint16(sb[sbMagic:]); m != ext4Magic {
		return out, fmt.Errorf("%w: no ext4 superblock (magic %#x)", ErrNotModulesDisk, m)
	}
	if label := cString(sb[sbVolumeName : sbVolumeName+16]); label != ModulesDiskLabel {
		return out, fmt.Errorf("%w: volume label %q, want %q", ErrNotModulesDisk, label, ModulesDiskLabel)
	}
	last := cString(sb[sbLastMounted : sbLastMounted+lastMountedBytes])
	release, ok := strings.CutPrefix(last, modulesPrefix)
	if !ok {
		return out, fmt.Errorf("%w: last-mounted path %q does not name a kernel release", ErrNotModulesDisk, last)
	}
	if err := checkModulesRelease(release); err != nil {
		return out, fmt.Errorf("%w: %w", ErrNotModulesDisk, err)
	}
	var uuid [16]byte
	copy(uuid[:], sb[sbUUID:sbUUID+16])
	if got, want := formatUUID(uuid), ModulesDiskUUID(release); got != want {
		return out, fmt.Errorf("%w: UUID %s, want %s for kernel %s", ErrNotModulesDisk, got, want, release)
	}
	logBlock := le.Uint32(sb[sbLogBlockSize:])
	if logBlock > 6 { // 64 KiB blocks at most
		return out, fmt.Errorf("%w: block size 2^%d KiB", ErrNotModulesDisk, logBlock)
	}
	blocks := uint64(le.Uint32(sb[sbBlocksCountLo:]))
	if le.Uint32(sb[sbFeatureIncompt:])&incompat64bit != 0 {
		blocks |= uint64(le.Uint32(sb[sbBlocksCountHi:])) << 32
	}
	if blocks == 0 || blocks > 1<<40 {
		return out, fmt.Errorf("%w: %d blocks", ErrNotModulesDisk, blocks)
	}
	out.Release, out.Size = release, int64(blocks)<<(10+logBlock)
	return out, nil
}

// cString is b up to its first NUL.
func cString(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// ReadModulesDisk checks the modules disk at path (its superblock, and
// that the file holds the whole filesystem) and returns its release. A
// file that is not a complete modules disk gives an error wrapping
// ErrNotModulesDisk.
func ReadModulesDisk(path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("modules disk: %w", err)
	}
	defer f.Close()
	sb := make([]byte, superblockSize)
	if _, err := f.ReadAt(sb, superblockOffset); err != nil {
		if errors.Is(err, io.EOF) {
			return "", fmt.Errorf("modules disk %s: %w: too short for a superblock", path, ErrNotModulesDisk)
		}
		return "", fmt.Errorf("modules disk %s: %w", path, err)
	}
	info, err := ParseModulesSuperblock(sb)
	if err != nil {
		return "", fmt.Errorf("modules disk %s: %w", path, err)
	}
	fi, err := f.Stat()
	if err != nil {
		return "", fmt.Errorf("modules disk %s: %w", path, err)
	}
	if fi.Size() != info.Size {
		return "", fmt.Errorf("modules disk %s: %w: the file has %d bytes, its filesystem %d (partial?)", path, ErrNotModulesDisk, fi.Size(), info.Size)
	}
	return info.Release, nil
}

// ModulesDisk returns the path of k's modules disk, building it first when
// it is missing, not a complete modules disk of k's release, or older
// than k's modules.dep. It is kept as ModulesDiskName(k.Version) in dir
// (<k.Cache>/modules when empty and k came from a cache), else, when that
// folder cannot be written (a read-only cache), in a folder under the
// temporary directory. A disk is written under a temporary name and
// renamed into place, so a disk that is there is complete.
func (k *Kernel) ModulesDisk(ctx context.Context, dir string) (string, error) {
	if err := checkModulesRelease(k.Version); err != nil {
		return "", fmt.Errorf("kernel %s: modules disk: %w", k.Version, err)
	}
	src, err := os.Stat(filepath.Join(k.ModulesDir, "modules.dep"))
	if err != nil {
		return "", fmt.Errorf("kernel %s: modules disk: the modules tree has no modules.dep: %w", k.Version, err)
	}
	if dir == "" && k.Cache != "" {
		dir = filepath.Join(k.Cache, "modules")
	}
	var dirs []string
	if dir != "" {
		dirs = append(dirs, dir)
	}
	dirs = append(dirs, filepath.Join(os.TempDir(), "kiln-modules"))
	name := ModulesDiskName(k.Version)
	for _, d := range dirs {
		p := filepath.Join(d, name)
		fi, err := os.Stat(p)
		if err != nil || !fi.Mode().IsRegular() || fi.ModTime().Before(src.ModTime()) {
			continue
		}
		if rel, err := ReadModulesDisk(p); err == nil && rel == k.Version {
			return p, nil
		}
	}
	var errs []error
	for _, d := range dirs {
		p := filepath.Join(d, name)
		err := BuildModulesDisk(ctx, k.ModulesDir, k.Version, p)
		if err == nil {
			return p, nil
		}
		if ctx.Err() != nil || !errors.Is(err, fs.ErrPermission) && !isReadOnly(err) {
			return "", fmt.Errorf("kernel %s: %w", k.Version, err)
		}
		errs = append(errs, err)
	}
	return "", fmt.Errorf("kernel %s: no folder to keep its modules disk in: %w", k.Version, errors.Join(errs...))
}

// isReadOnly reports whether err is a read-only filesystem's refusal.
func isReadOnly(err error) bool { return errors.Is(err, syscall.EROFS) }

// mke2fsConfig is the whole mke2fs configuration a modules disk is made
// with, so that the host's /etc/mke2fs.conf does not change its bytes.
const mke2fsConfig = `[defaults]
	base_features = sparse_super,large_file,filetype,dir_index,ext_attr
	blocksize = 4096
	inode_size = 256
	inode_ratio = 16384
	reserved_ratio = 0
	lazy_itable_init = false
	lazy_journal_init = false
[fs_types]
	ext4 = {
		features = extent,huge_file,flex_bg,metadata_csum,64bit,dir_nlink,extra_isize
	}
`

// The e2fsprogs tools a modules disk is built with.
const (
	mke2fsTool  = "mke2fs"
	debugfsTool = "debugfs"
)

// lookTool finds an e2fsprogs tool on PATH or in /sbin and /usr/sbin, which
// a user's PATH may lack.
func lookTool(name string) (string, error) {
	if p, err := exec.LookPath(name); err == nil {
		return p, nil
	}
	for _, d := range []string{"/usr/sbin", "/sbin"} {
		p := filepath.Join(d, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", fmt.Errorf("building a modules disk needs %s (Debian's e2fsprogs; make deps installs it): not on PATH, nor in /usr/sbin or /sbin", name)
}

// treeEntry is one file of the tree a modules disk holds.
type treeEntry struct {
	rel string // slash path inside the disk, "/" for its root
	dir bool
}

// scanTree lists src's files for BuildModulesDisk, with the blocks and
// inodes the filesystem needs for them.
func scanTree(src string) (entries []treeEntry, blocks, inodes int64, err error) {
	err = filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return err
		}
		rel = "/" + filepath.ToSlash(rel)
		if rel == "/." {
			rel = "/"
		}
		if strings.ContainsAny(rel, " \t\n\r\"'\\") || strings.ContainsRune(rel, 0) {
			return fmt.Errorf("%s: a space, quote or backslash in a file name of the modules tree", p)
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case fi.IsDir():
			// A directory entry takes 8 bytes and its name, rounded to 4.
			n, err := dirSize(p)
			if err != nil {
				return err
			}
			blocks += 1 + n/4096
		case fi.Mode().IsRegular():
			blocks += (fi.Size() + 4095) / 4096
			blocks += fi.Size() / (128 << 20) // extent blocks of a big file
		case fi.Mode()&fs.ModeSymlink != 0:
			blocks++
		default:
			return fmt.Errorf("%s: %v is neither a file, a directory nor a symbolic link", p, fi.Mode().Type())
		}
		inodes++
		entries = append(entries, treeEntry{rel: rel, dir: fi.IsDir()})
		return nil
	})
	if err != nil {
		return nil, 0, 0, fmt.Errorf("reading the modules tree %s: %w", src, err)
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].rel < entries[j].rel })
	return entries, blocks, inodes, nil
}

// dirSize is the bytes of directory entries the directory p needs.
func dirSize(p string) (int64, error) {
	names, err := os.ReadDir(p)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, e := range names {
		n += 8 + int64(len(e.Name())+3)&^3
	}
	return n, nil
}

// BuildModulesDisk writes the modules disk of the tree src (a kernel's
// lib/modules/<release>) for release to path, atomically: through a
// temporary file in path's folder, renamed once it is complete and
// checked. The same tree gives the same bytes. It needs e2fsprogs's mke2fs
// and debugfs.
func BuildModulesDisk(ctx context.Context, src, release, path string) (err error) {
	if err := checkModulesRelease(release); err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	mke2fs, err := lookTool(mke2fsTool)
	if err != nil {
		return err
	}
	debugfs, err := lookTool(debugfsTool)
	if err != nil {
		return err
	}
	entries, blocks, inodes, err := scanTree(src)
	if err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	tmpName := tmp.Name()
	tmp.Close()
	defer func() {
		if err != nil {
			os.Remove(tmpName)
		}
	}()
	conf := tmpName + ".conf"
	if err := os.WriteFile(conf, []byte(mke2fsConfig), 0o644); err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	defer os.Remove(conf)
	env := append(os.Environ(),
		"MKE2FS_CONFIG="+conf,
		"E2FSPROGS_FAKE_TIME="+strconv.Itoa(ModulesDiskEpoch),
		"SOURCE_DATE_EPOCH="+strconv.Itoa(ModulesDiskEpoch),
		"LC_ALL=C",
	)
	// Room for the inode tables (256 bytes an inode), bitmaps and group
	// descriptors beside the data; a tree that still does not fit is
	// retried larger, deterministically.
	inodes += 64
	size := blocks + inodes/16 + blocks/32 + 1024
	uuid := ModulesDiskUUID(release)
	for attempt := 0; ; attempt++ {
		if err := os.Truncate(tmpName, 0); err != nil {
			return fmt.Errorf("modules disk: %w", err)
		}
		if err := os.Truncate(tmpName, size*4096); err != nil {
			return fmt.Errorf("modules disk: %w", err)
		}
		args := []string{"-q", "-F", "-t", "ext4", "-T", "ext4",
			"-b", "4096", "-I", "256", "-N", strconv.FormatInt(inodes, 10), "-m", "0",
			"-O", "^has_journal,^resize_inode",
			"-L", ModulesDiskLabel, "-U", uuid, "-M", ModulesMountPoint(release),
			"-E", "hash_seed=" + modulesHashSeed(release) + ",root_owner=0:0,nodiscard",
			"-d", src, tmpName, strconv.FormatInt(size*4, 10) + "k"}
		out, err := run(ctx, env, mke2fs, args...)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return fmt.Errorf("modules disk: %w", ctx.Err())
		}
		if attempt < 3 && strings.Contains(out, "Could not allocate") {
			size += size / 4
			continue
		}
		return fmt.Errorf("modules disk: mke2fs -d %s: %w: %s", src, err, lastLines(out))
	}
	// mke2fs -d copies each file's owner and times; a modules disk has
	// root's and ModulesDiskEpoch, so that it does not depend on when (or
	// by whom) the tree was unpacked or last read.
	var script strings.Builder
	for _, e := range append(entries, treeEntry{rel: "/lost+found", dir: true}) {
		for _, f := range []string{"uid 0", "gid 0", "atime", "mtime", "ctime", "crtime"} {
			if !strings.Contains(f, " ") {
				f += " @" + strconv.Itoa(ModulesDiskEpoch)
			}
			fmt.Fprintf(&script, "sif \"%s\" %s\n", e.rel, f)
		}
	}
	scriptFile := tmpName + ".debugfs"
	if err := os.WriteFile(scriptFile, []byte(script.String()), 0o644); err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	defer os.Remove(scriptFile)
	out, err := run(ctx, env, debugfs, "-w", "-f", scriptFile, tmpName)
	if err != nil {
		return fmt.Errorf("modules disk: debugfs: %w: %s", err, lastLines(out))
	}
	if bad := debugfsErrors(out); bad != "" {
		return fmt.Errorf("modules disk: debugfs could not set the inodes' owner and times: %s", bad)
	}
	rel, err := ReadModulesDisk(tmpName)
	if err != nil {
		return fmt.Errorf("modules disk: the built image: %w", err)
	}
	if rel != release {
		return fmt.Errorf("modules disk: the built image is of kernel %s, want %s", rel, release)
	}
	f, err := os.OpenFile(tmpName, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	serr := f.Sync()
	if cerr := f.Close(); serr == nil {
		serr = cerr
	}
	if serr != nil {
		return fmt.Errorf("modules disk: %w", serr)
	}
	if err := os.Chmod(tmpName, 0o444); err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	if err := os.Rename(tmpName, path); err != nil {
		return fmt.Errorf("modules disk: %w", err)
	}
	return nil
}

// run runs a tool with env and returns its combined output.
func run(ctx context.Context, env []string, tool string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, tool, args...)
	cmd.Env = env
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// debugfsErrors returns the lines of debugfs's output that report a failed
// command (debugfs exits 0 regardless), or "".
func debugfsErrors(out string) string {
	var bad []string
	for _, l := range strings.Split(out, "\n") {
		l = strings.TrimSpace(l)
		if l == "" || strings.HasPrefix(l, "debugfs ") || strings.HasPrefix(l, "debugfs:") {
			continue
		}
		bad = append(bad, l)
	}
	return lastLines(strings.Join(bad, "\n"))
}

// lastLines is the end of a tool's output, for an error message.
func lastLines(out string) string {
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) > 5 {
		lines = lines[len(lines)-5:]
	}
	return strings.Join(lines, "; ")
}
