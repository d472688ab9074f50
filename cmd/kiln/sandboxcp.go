package main

// kiln sandbox cp: files and directory trees into and out of a sandbox,
// with docker cp's rules for where they land.

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/stmode"
)

// st_mode's file type bits, as FileInfo.Mode carries them.
const (
	sIFMT  = stmode.IFMT
	sIFDIR = stmode.IFDIR
	sIFREG = stmode.IFREG
	sIFLNK = stmode.IFLNK
)

// remotePath splits ID:PATH; ok is false for a local path.
func remotePath(s string) (id, p string, ok bool) {
	id, p, ok = strings.Cut(s, ":")
	if !ok || id == "" || strings.Contains(id, "/") || !strings.HasPrefix(p, "/") {
		return "", "", false
	}
	return id, p, true
}

func (a *cli) cpCmd() *cobra.Command {
	var parents bool
	cmd := &cobra.Command{
		Use:   "cp (LOCAL ID:PATH | ID:PATH LOCAL)",
		Short: "copy a file or a directory tree into or out of a sandbox (LOCAL - is stdin or stdout, for a file)",
		Long: `Copy a file or a directory tree into or out of a sandbox, as docker cp does.

If the destination is an existing directory, the source goes inside it under
its own name (a source ending in /. puts its contents there instead); else the
source becomes the destination. A directory is copied with everything under
it, keeping permission bits; a directory already at the destination is merged
into, a file there is replaced. Symlinks and special files inside a tree are
skipped with a warning on stderr, never followed. A copy that fails partway
says what it had copied.`,
		Args: args(cobra.ExactArgs(2)),
		PreRunE: func(_ *cobra.Command, argv []string) error {
			_, _, srcRemote := remotePath(argv[0])
			_, _, dstRemote := remotePath(argv[1])
			if srcRemote == dstRemote {
				return usagef("sandbox cp: want exactly one side as ID:/PATH (an absolute path in the sandbox)")
			}
			return nil
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, argv []string) error {
			if dstID, dstPath, ok := remotePath(argv[1]); ok {
				cp := &copier{a: a, c: c, id: dstID}
				return cp.upload(ctx, argv[0], dstPath, parents)
			}
			srcID, srcPath, _ := remotePath(argv[0])
			cp := &copier{a: a, c: c, id: srcID}
			return cp.download(ctx, srcPath, argv[1])
		}),
	}
	cmd.Flags().BoolVarP(&parents, "parents", "p", false, "create missing directories in the sandbox")
	return cmd
}

// copier is one kiln sandbox cp: the sandbox, and what has been copied so
// far, for the message of a copy that fails partway.
type copier struct {
	a           *cli
	c           *kilnclient.Client
	id          string
	files, dirs int
	bytes       int64
	skipped     int
	// trees is set once a directory copy has begun: from then on a
	// failure says what was copied to destination.
	trees       bool
	destination string
}

// copied says what has been copied, as "3 files (12 B) and 2 directories".
func (cp *copier) copied() string {
	return fmt.Sprintf("%s (%s) and %s", plural(cp.files, "file", "files"), byteSize(cp.bytes),
		plural(cp.dirs, "directory", "directories"))
}

func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %s", n, many)
}

func byteSize(n int64) string {
	switch {
	case n < 1<<10:
		return fmt.Sprintf("%d B", n)
	case n < 1<<20:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	case n < 1<<30:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	}
	return fmt.Sprintf("%.1f GiB", float64(n)/(1<<30))
}

// partialCopyError is a directory copy that stopped partway: why, and
// what it had copied by then.
type partialCopyError struct {
	err         error
	copied      string
	destination string
}

func (e *partialCopyError) Error() string {
	return fmt.Sprintf("sandbox cp: %s; copied %s to %s before that",
		strings.TrimPrefix(e.err.Error(), "kiln: "), e.copied, e.destination)
}

func (e *partialCopyError) Unwrap() error { return e.err }

// fail wraps err as a partial copy's error once a tree copy has begun.
func (cp *copier) fail(err error) error {
	if err == nil || !cp.trees {
		return err
	}
	return &partialCopyError{err: err, copied: cp.copied(), destination: cp.destination}
}

// warnf prints a warning on stderr and counts a skipped entry.
func (cp *copier) warnf(format string, args ...any) {
	cp.skipped++
	cp.a.printErr(fmt.Errorf(format, args...))
}

// unixPerm is m's permission bits with setuid, setgid and sticky, as the
// file calls take them.
func unixPerm(m fs.FileMode) uint32 {
	p := uint32(m.Perm())
	if m&fs.ModeSetuid != 0 {
		p |= 0o4000
	}
	if m&fs.ModeSetgid != 0 {
		p |= 0o2000
	}
	if m&fs.ModeSticky != 0 {
		p |= 0o1000
	}
	return p
}

// localBase is the name a local source takes inside a destination
// directory; "" when its contents go there instead (".", "/", DIR/.).
func localBase(p string) string {
	sep := string(filepath.Separator)
	if p == "." || strings.HasSuffix(p, sep+".") {
		return ""
	}
	if abs, err := filepath.Abs(p); err == nil {
		p = abs
	}
	if b := filepath.Base(p); b != sep {
		return b
	}
	return ""
}

// remoteBase is localBase for a path in the sandbox.
func remoteBase(p string) string {
	if strings.HasSuffix(p, "/.") {
		return ""
	}
	if b := path.Base(path.Clean(p)); b != "/" {
		return b
	}
	return ""
}

// upload copies local (a file, a directory tree, or - for stdin) to p in
// the sandbox.
func (cp *copier) upload(ctx context.Context, local, p string, parents bool) error {
	wantDir := strings.HasSuffix(p, "/")
	orig := p
	p = path.Clean(p)
	if local == "-" {
		if wantDir {
			return fmt.Errorf("sandbox cp: - (stdin) onto %s:%s: name the file to write", cp.id, orig)
		}
		_, err := cp.c.WriteFile(ctx, cp.id, p, cp.a.stdin, kilnclient.WriteFileOptions{Mode: 0o644, MakeParents: parents})
		return err
	}
	// The source named on the command line is followed if it is a
	// symlink; those inside a tree never are.
	fi, err := os.Stat(local)
	if err != nil {
		return fmt.Errorf("sandbox cp: %w", err)
	}
	if !fi.IsDir() && !fi.Mode().IsRegular() {
		return fmt.Errorf("sandbox cp: %s is not a regular file or a directory", local)
	}

	destIsDir := false
	dfi, err := cp.c.Stat(ctx, cp.id, p)
	switch {
	case err == nil:
		destIsDir = dfi.GetIsDir()
		if !destIsDir && fi.IsDir() {
			return fmt.Errorf("sandbox cp: cannot copy directory %s onto %s:%s, which is not a directory", local, cp.id, p)
		}
		if !destIsDir && wantDir {
			return fmt.Errorf("sandbox cp: %s:%s is not a directory", cp.id, p)
		}
	case status.Code(err) == codes.NotFound:
	default:
		return err
	}
	target := p
	// A file onto DIR/ that is missing goes inside it (made with -p).
	if base := localBase(local); base != "" && (destIsDir || wantDir && !fi.IsDir()) {
		target = path.Join(p, base)
	}

	if !fi.IsDir() {
		f, err := os.Open(local)
		if err != nil {
			return fmt.Errorf("sandbox cp: %w", err)
		}
		defer f.Close()
		_, err = cp.c.WriteFile(ctx, cp.id, target, f, kilnclient.WriteFileOptions{Mode: unixPerm(fi.Mode()), MakeParents: parents})
		return err
	}
	return cp.uploadTree(ctx, local, target, fi.Mode(), parents || destIsDir)
}

// uploadTree copies the directory local to target in the sandbox, which
// is made (with its parents if mkParents; an existing one is merged into).
func (cp *copier) uploadTree(ctx context.Context, local, target string, mode fs.FileMode, mkParents bool) error {
	// Everything is opened through root, so that no symlink (even one
	// swapped in during the copy) leads out of the tree.
	root, err := os.OpenRoot(local)
	if err != nil {
		return fmt.Errorf("sandbox cp: %w", err)
	}
	defer root.Close()
	if _, err := cp.c.MakeDir(ctx, cp.id, target, kilnclient.MakeDirOptions{Mode: unixPerm(mode), Parents: mkParents}); err != nil {
		return err
	}
	cp.trees, cp.destination = true, cp.id+":"+target
	cp.dirs++
	err = fs.WalkDir(root.FS(), ".", func(name string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("reading %s: %w", filepath.Join(local, filepath.FromSlash(name)), err)
		}
		if name == "." {
			return nil
		}
		rp := path.Join(target, name)
		lp := filepath.Join(local, filepath.FromSlash(name))
		switch t := d.Type(); {
		case t&fs.ModeSymlink != 0:
			to, _ := root.Readlink(name)
			cp.warnf("sandbox cp: skipped symlink %s -> %s: cp copies regular files and directories, not symlinks", lp, to)
		case t.IsDir():
			info, err := d.Info()
			if err != nil {
				return fmt.Errorf("reading %s: %w", lp, err)
			}
			if _, err := cp.c.MakeDir(ctx, cp.id, rp, kilnclient.MakeDirOptions{Mode: unixPerm(info.Mode()), Parents: true}); err != nil {
				return err
			}
			cp.dirs++
		case t.IsRegular():
			return cp.uploadFile(ctx, root, name, lp, rp)
		default:
			cp.warnf("sandbox cp: skipped %s: a %s, not a regular file or a directory", lp, fileKind(t))
		}
		return nil
	})
	if err != nil {
		return cp.fail(err)
	}
	return nil
}

// uploadFile copies the regular file name under root to rp.
func (cp *copier) uploadFile(ctx context.Context, root *os.Root, name, lp, rp string) error {
	f, err := root.Open(name)
	if err != nil {
		return fmt.Errorf("reading %s: %w", lp, err)
	}
	defer f.Close()
	info, err := f.Stat()
	if err != nil {
		return fmt.Errorf("reading %s: %w", lp, err)
	}
	if !info.Mode().IsRegular() {
		return fmt.Errorf("%s changed during the copy: it is no longer a regular file", lp)
	}
	r := &countReader{r: f}
	_, err = cp.c.WriteFile(ctx, cp.id, rp, r, kilnclient.WriteFileOptions{Mode: unixPerm(info.Mode())})
	if err != nil {
		return err
	}
	cp.files++
	cp.bytes += r.n
	return nil
}

// countReader counts the bytes read through it.
type countReader struct {
	r io.Reader
	n int64
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	return n, err
}

func fileKind(t fs.FileMode) string {
	switch {
	case t&fs.ModeNamedPipe != 0:
		return "named pipe"
	case t&fs.ModeSocket != 0:
		return "socket"
	case t&fs.ModeCharDevice != 0:
		return "character device"
	case t&fs.ModeDevice != 0:
		return "device"
	}
	return "special file"
}

// remoteKind is what an entry of a sandbox's listing is: sIFDIR, sIFREG,
// sIFLNK or another st_mode type.
func remoteKind(fi *kilnpb.FileInfo) uint32 {
	switch {
	case fi.GetSymlink() != "" || fi.GetMode()&sIFMT == sIFLNK:
		return sIFLNK
	case fi.GetIsDir():
		return sIFDIR
	}
	return fi.GetMode() & sIFMT
}

// entryName checks a name from a sandbox's directory listing, which the
// sandbox controls: one path element, never "." or "..", with no slash or
// NUL that would place a file outside the directory being copied.
func entryName(name string) error {
	switch {
	case name == "":
		return errors.New("an entry has an empty name")
	case name == "." || name == "..":
		return fmt.Errorf("an entry is named %q", name)
	case strings.ContainsAny(name, "/\x00"):
		return fmt.Errorf("entry %q is not a single path element", name)
	}
	return nil
}

// download copies p in the sandbox (a file or a directory tree) to local,
// or a file to stdout for -.
func (cp *copier) download(ctx context.Context, p, local string) error {
	base := remoteBase(p)
	p = path.Clean(p)
	sfi, err := cp.c.Stat(ctx, cp.id, p)
	if err != nil {
		return err
	}
	isDir := sfi.GetIsDir()
	if !isDir && sfi.GetMode()&sIFMT != sIFREG {
		return fmt.Errorf("sandbox cp: %s:%s is not a regular file or a directory", cp.id, p)
	}
	if local == "-" {
		if isDir {
			return fmt.Errorf("sandbox cp: %s:%s is a directory: - (stdout) takes a single file", cp.id, p)
		}
		_, err := cp.c.ReadFile(ctx, cp.id, p, cp.a.stdout)
		return err
	}

	wantDir := strings.HasSuffix(local, string(filepath.Separator))
	target := filepath.Clean(local)
	lfi, err := os.Stat(target)
	switch {
	case err == nil && lfi.IsDir():
		if base != "" {
			target = filepath.Join(target, base)
		}
	case err == nil:
		if isDir {
			return fmt.Errorf("sandbox cp: cannot copy directory %s:%s onto %s, which is not a directory", cp.id, p, local)
		}
		if wantDir {
			return fmt.Errorf("sandbox cp: %s is not a directory", local)
		}
	case errors.Is(err, fs.ErrNotExist):
		if wantDir && !isDir {
			return fmt.Errorf("sandbox cp: directory %s does not exist", local)
		}
	default:
		return fmt.Errorf("sandbox cp: %w", err)
	}

	tfi, err := os.Stat(target)
	exists := err == nil
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("sandbox cp: %w", err)
	}
	if exists && tfi.IsDir() != isDir {
		if isDir {
			return fmt.Errorf("sandbox cp: cannot overwrite %s, which is not a directory, with directory %s:%s", target, cp.id, p)
		}
		return fmt.Errorf("sandbox cp: cannot overwrite directory %s with file %s:%s", target, cp.id, p)
	}
	if isDir && exists {
		root, err := os.OpenRoot(target)
		if err != nil {
			return fmt.Errorf("sandbox cp: %w", err)
		}
		defer root.Close()
		cp.trees, cp.destination = true, target
		return cp.fail(cp.downloadTree(ctx, root, p, target))
	}

	// Made or written in its parent, opened as a root: nothing the sandbox
	// names lands outside it.
	parent, err := os.OpenRoot(filepath.Dir(target))
	if err != nil {
		return fmt.Errorf("sandbox cp: %w", err)
	}
	defer parent.Close()
	name := filepath.Base(target)
	if !isDir {
		_, err := cp.fetch(ctx, parent, name, p, fs.FileMode(sfi.GetMode()&0o777))
		return err
	}
	if err := parent.Mkdir(name, 0o700); err != nil {
		return fmt.Errorf("sandbox cp: %w", err)
	}
	cp.trees, cp.destination = true, target
	cp.dirs++
	sub, err := parent.OpenRoot(name)
	if err != nil {
		return cp.fail(err)
	}
	err = cp.downloadTree(ctx, sub, p, target)
	sub.Close()
	if err != nil {
		return cp.fail(err)
	}
	return cp.fail(parent.Chmod(name, fs.FileMode(sfi.GetMode()&0o777)))
}

// downloadTree copies the contents of the sandbox's directory remote into
// root (local, for messages). Directories it makes get their modes once
// filled, so that a read-only one can be filled.
func (cp *copier) downloadTree(ctx context.Context, root *os.Root, remote, local string) error {
	ents, err := cp.c.ListDir(ctx, cp.id, remote)
	if err != nil {
		return err
	}
	for _, e := range ents {
		name := e.GetName()
		if err := entryName(name); err != nil {
			return fmt.Errorf("listing %s:%s: %w", cp.id, remote, err)
		}
		rp, lp := path.Join(remote, name), filepath.Join(local, name)
		perm := fs.FileMode(e.GetMode() & 0o777)
		switch remoteKind(e) {
		case sIFLNK:
			cp.warnf("sandbox cp: skipped symlink %s:%s -> %s: cp copies regular files and directories, not symlinks", cp.id, rp, e.GetSymlink())
		case sIFDIR:
			made := true
			if err := root.Mkdir(name, 0o700); err != nil {
				if !errors.Is(err, fs.ErrExist) {
					return err
				}
				fi, lerr := root.Lstat(name)
				if lerr != nil {
					return lerr
				}
				if !fi.IsDir() {
					return fmt.Errorf("cannot overwrite %s, which is not a directory, with directory %s:%s", lp, cp.id, rp)
				}
				made = false // merged into; it keeps its mode
			}
			sub, err := root.OpenRoot(name)
			if err != nil {
				return err
			}
			err = cp.downloadTree(ctx, sub, rp, lp)
			sub.Close()
			if err != nil {
				return err
			}
			if made {
				if err := root.Chmod(name, perm); err != nil {
					return err
				}
				cp.dirs++
			}
		case sIFREG:
			if fi, err := root.Lstat(name); err == nil && fi.IsDir() {
				return fmt.Errorf("cannot overwrite directory %s with file %s:%s", lp, cp.id, rp)
			}
			if _, err := cp.fetch(ctx, root, name, rp, perm); err != nil {
				return err
			}
		default:
			cp.warnf("sandbox cp: skipped %s:%s: not a regular file or a directory (mode %#o)", cp.id, rp, e.GetMode())
		}
	}
	return nil
}

// fetch copies the sandbox's file remote to name under root: into a
// temporary file renamed into place when complete, so that a failed copy
// leaves nothing half-written.
func (cp *copier) fetch(ctx context.Context, root *os.Root, name, remote string, perm fs.FileMode) (int64, error) {
	tmp := ".kiln-cp-" + rand.Text()
	f, err := root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, err
	}
	n, err := cp.c.ReadFile(ctx, cp.id, remote, f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = root.Chmod(tmp, perm)
	}
	if err == nil {
		err = root.Rename(tmp, name)
	}
	if err != nil {
		root.Remove(tmp)
		return n, err
	}
	cp.files++
	cp.bytes += n
	return n, nil
}
