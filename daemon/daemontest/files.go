package daemontest

import (
	"archive/tar"
	"context"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/dirwatch"
	"github.com/kilnvm/kiln/filetree"
	"github.com/kilnvm/kiln/stmode"
)

// The file calls are package filetree's, as the guest agent's, on the
// root folder; owners are users of the host's account files.

func (in *Instance) tree() filetree.Tree { return filetree.Tree{Root: in.rootPath(), Accounts: "/"} }

// perm is mode's permission bits, as the agent's calls take them.
func perm(mode fs.FileMode) uint32 { return stmode.FromFileMode(mode) & 0o7777 }

func (in *Instance) WriteFile(ctx context.Context, p string, r io.Reader, mode fs.FileMode, makeParents bool, owner string) (daemon.FileInfo, error) {
	fi, err := in.tree().Write(p, perm(mode), makeParents, owner, r)
	return daemon.FileInfo(fi), err
}

func (in *Instance) ReadFile(ctx context.Context, p string, w io.Writer) (int64, error) {
	return in.tree().Read(p, w)
}

func (in *Instance) Stat(ctx context.Context, p string, noFollow bool) (daemon.FileInfo, error) {
	fi, err := in.tree().Stat(p, noFollow)
	return daemon.FileInfo(fi), err
}

func (in *Instance) List(ctx context.Context, p string, depth int) ([]daemon.FileInfo, error) {
	fis, err := in.tree().List(ctx, p, uint32(max(depth, 0)))
	out := make([]daemon.FileInfo, len(fis))
	for i, fi := range fis {
		out[i] = daemon.FileInfo(fi)
	}
	return out, err
}

func (in *Instance) Mkdir(ctx context.Context, p string, mode fs.FileMode, parents bool, owner string) error {
	return in.tree().Mkdir(p, perm(mode), parents, owner)
}

func (in *Instance) Remove(ctx context.Context, p string, recursive bool) error {
	return in.tree().Remove(p, recursive)
}

func (in *Instance) Move(ctx context.Context, src, dst string) (daemon.FileInfo, error) {
	fi, err := in.tree().Move(src, dst)
	return daemon.FileInfo(fi), err
}

func (in *Instance) Watch(ctx context.Context, p string, recursive bool, fn func(daemon.WatchEvent) error) error {
	return in.tree().Watch(ctx, p, recursive, func(ev filetree.Event) error {
		out := daemon.WatchEvent{Started: ev.Started, Op: watchOps[ev.Op], Name: ev.Name, HasEntry: ev.Entry != nil}
		if ev.Entry != nil {
			out.Entry = daemon.FileInfo(*ev.Entry)
		}
		return fn(out)
	})
}

// watchOps are dirwatch's operations as the seam's.
var watchOps = [...]daemon.WatchOp{dirwatch.Create: daemon.WatchCreate, dirwatch.Write: daemon.WatchWrite,
	dirwatch.Remove: daemon.WatchRemove, dirwatch.Rename: daemon.WatchRename, dirwatch.Chmod: daemon.WatchChmod}

// ExportWritable writes the root folder as a tar (the double's root is
// all writes: it has no image layer under them).
func (in *Instance) ExportWritable(ctx context.Context, w io.Writer) (int64, error) {
	cw := &countWriter{w: w}
	tw := tar.NewWriter(cw)
	if err := tw.AddFS(os.DirFS(in.rootPath())); err != nil {
		return cw.n, fmt.Errorf("daemontest: export: %w", err)
	}
	return cw.n, tw.Close()
}

// ImportWritable extracts an ExportWritable tar into the root folder.
func (in *Instance) ImportWritable(ctx context.Context, r io.Reader) error {
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("daemontest: import: %w", err)
		}
		if !filepath.IsLocal(h.Name) {
			return fmt.Errorf("daemontest: import: entry %q", h.Name)
		}
		p := filepath.Join(in.rootPath(), h.Name)
		switch h.Typeflag {
		case tar.TypeDir:
			err = os.MkdirAll(p, fs.FileMode(h.Mode)&fs.ModePerm)
		case tar.TypeReg:
			var f *os.File
			if f, err = os.OpenFile(p, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, fs.FileMode(h.Mode)&fs.ModePerm); err == nil {
				_, err = io.Copy(f, tr)
				f.Close()
			}
		}
		if err != nil {
			return fmt.Errorf("daemontest: import %s: %w", h.Name, err)
		}
	}
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
