package daemontest

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"strings"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/daemon"
	"github.com/kilnvm/kiln/dirwatch"
)

// The file calls go to the root folder through os.Root; owners are users
// of the host's account files.

// rel turns a sandbox path (absolute, clean) into one of the root.
func rel(p string) string {
	if p = strings.TrimPrefix(path.Clean(p), "/"); p == "" {
		return "."
	}
	return p
}

// fileErr gives a host file error the code the agent would.
func fileErr(op, p string, err error) error {
	code := codes.Internal
	switch {
	case errors.Is(err, fs.ErrNotExist):
		code = codes.NotFound
	case errors.Is(err, syscall.ENOTDIR), errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENOTEMPTY):
		code = codes.FailedPrecondition
	case errors.Is(err, fs.ErrExist):
		code = codes.AlreadyExists
	case errors.Is(err, fs.ErrPermission):
		code = codes.PermissionDenied
	case strings.Contains(err.Error(), "escapes"):
		code = codes.InvalidArgument
	}
	return status.Errorf(code, "daemontest: %s %s: %v", op, p, err)
}

// info describes p, its owner and group named by names (the host's).
func (in *Instance) info(p string, fi fs.FileInfo, names *accounts.Names) daemon.FileInfo {
	out := daemon.FileInfo{Path: p, Name: path.Base(p), Size: fi.Size(), Mode: fi.Mode(), ModTime: fi.ModTime(), IsDir: fi.IsDir()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		out.UID, out.GID = st.Uid, st.Gid
		out.Owner, out.Group = names.User(st.Uid), names.Group(st.Gid)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		out.Symlink, _ = in.root.Readlink(rel(p))
	}
	return out
}

// owner resolves a file call's owner on the host (nil for none).
func owner(name string) (*accounts.User, error) {
	if name == "" {
		return nil, nil
	}
	u, err := accounts.Lookup("/", name)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "daemontest: %v", err)
	}
	return &u, nil
}

// own gives the root's r to u (when set) with mode.
func (in *Instance) own(r string, u *accounts.User, mode fs.FileMode) error {
	if u != nil {
		if err := in.root.Lchown(r, int(u.UID), int(u.GID)); err != nil {
			return err
		}
	}
	return in.root.Chmod(r, mode)
}

// WriteFile writes the file whole or not at all (a temporary file renamed
// into place).
func (in *Instance) WriteFile(ctx context.Context, p string, r io.Reader, mode fs.FileMode, makeParents bool, ownerName string) (daemon.FileInfo, error) {
	u, err := owner(ownerName)
	if err != nil {
		return daemon.FileInfo{}, err
	}
	if makeParents {
		if err := in.mkdirs(rel(path.Dir(p)), 0o755, u); err != nil {
			return daemon.FileInfo{}, fileErr("write", p, err)
		}
	}
	tmp := rel(path.Dir(p)) + "/.kiln-write-" + randHex()
	f, err := in.root.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode.Perm())
	if err != nil {
		return daemon.FileInfo{}, fileErr("write", p, err)
	}
	_, err = io.Copy(f, r)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = in.own(tmp, u, mode)
	}
	if err == nil {
		err = in.root.Rename(tmp, rel(p))
	}
	if err != nil {
		in.root.Remove(tmp)
		return daemon.FileInfo{}, fileErr("write", p, err)
	}
	return in.Stat(ctx, p, false)
}

func (in *Instance) ReadFile(ctx context.Context, p string, w io.Writer) (int64, error) {
	f, err := in.root.Open(rel(p))
	if err != nil {
		return 0, fileErr("read", p, err)
	}
	defer f.Close()
	n, err := io.CopyBuffer(w, f, make([]byte, 64<<10))
	if err != nil {
		return n, fileErr("read", p, err)
	}
	return n, nil
}

func (in *Instance) Stat(ctx context.Context, p string, noFollow bool) (daemon.FileInfo, error) {
	stat := in.root.Stat
	if noFollow {
		stat = in.root.Lstat
	}
	fi, err := stat(rel(p))
	if err != nil {
		return daemon.FileInfo{}, fileErr("stat", p, err)
	}
	return in.info(p, fi, accounts.NewNames("/")), nil
}

// List implements daemon.Files: each folder's entries sorted by name,
// followed by its subfolders' down to depth levels.
func (in *Instance) List(ctx context.Context, p string, depth int) ([]daemon.FileInfo, error) {
	var out []daemon.FileInfo
	names := accounts.NewNames("/")
	var walk func(dir string, level int) error
	walk = func(dir string, level int) error {
		ents, err := fs.ReadDir(in.root.FS(), rel(dir))
		if level > 1 && errors.Is(err, fs.ErrNotExist) {
			return nil // removed meanwhile
		}
		if err != nil {
			return fileErr("list", dir, err)
		}
		for _, e := range ents {
			fi, err := e.Info()
			if err != nil {
				continue // removed meanwhile
			}
			ep := path.Join(dir, e.Name())
			out = append(out, in.info(ep, fi, names))
			if e.IsDir() && level < max(depth, 1) {
				if err := walk(ep, level+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	return out, walk(p, 1)
}

func (in *Instance) Mkdir(ctx context.Context, p string, mode fs.FileMode, parents bool, ownerName string) error {
	u, err := owner(ownerName)
	if err != nil {
		return err
	}
	if parents {
		err = in.mkdirs(rel(p), mode.Perm(), u)
	} else if err = in.root.Mkdir(rel(p), mode.Perm()); err == nil && u != nil {
		err = in.root.Lchown(rel(p), int(u.UID), int(u.GID))
	}
	if err != nil {
		return fileErr("mkdir", p, err)
	}
	return nil
}

// mkdirs creates the root's folder r and its missing parents with perm,
// owned by u when set.
func (in *Instance) mkdirs(r string, perm fs.FileMode, u *accounts.User) error {
	var missing []string
	for p := r; p != "."; p = path.Dir(p) {
		fi, err := in.root.Stat(p)
		if err == nil {
			if !fi.IsDir() {
				return &fs.PathError{Op: "mkdir", Path: p, Err: syscall.ENOTDIR}
			}
			break
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		missing = append(missing, p)
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := in.root.Mkdir(missing[i], perm); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
		if err := in.own(missing[i], u, perm); err != nil {
			return err
		}
	}
	return nil
}

func (in *Instance) Remove(ctx context.Context, p string, recursive bool) error {
	var err error
	if recursive {
		if _, err = in.root.Lstat(rel(p)); err == nil {
			err = in.root.RemoveAll(rel(p))
		}
	} else {
		err = in.root.Remove(rel(p))
	}
	if err != nil {
		return fileErr("remove", p, err)
	}
	return nil
}

// Move implements daemon.Files.
func (in *Instance) Move(ctx context.Context, src, dst string) (daemon.FileInfo, error) {
	if err := in.root.Rename(rel(src), rel(dst)); errors.Is(err, syscall.EXDEV) {
		return daemon.FileInfo{}, status.Errorf(codes.FailedPrecondition, "daemontest: move %s to %s: different file systems", src, dst)
	} else if err != nil {
		return daemon.FileInfo{}, fileErr("move "+src+" to", dst, err)
	}
	return in.Stat(ctx, dst, true)
}

// Watch implements daemon.Files with dirwatch, on the root's folder, up
// to as many folders as the agent watches (agentpb.MaxWatchDirs).
func (in *Instance) Watch(ctx context.Context, p string, recursive bool, fn func(daemon.WatchEvent) error) error {
	if fi, err := in.root.Stat(rel(p)); err != nil {
		return fileErr("watch", p, err)
	} else if !fi.IsDir() {
		return status.Errorf(codes.InvalidArgument, "daemontest: watch %s: not a directory", p)
	}
	names := accounts.NewNames("/")
	var fnErr error
	err := dirwatch.Watch(ctx, filepath.Join(in.rootPath(), rel(p)), recursive, 8192, func(ev dirwatch.Event) error {
		out := daemon.WatchEvent{Started: ev.Started, Op: watchOps[ev.Op], Name: ev.Name}
		if ev.Info != nil {
			out.Entry, out.HasEntry = in.info(path.Join(p, ev.Name), ev.Info, names), true
		}
		fnErr = fn(out)
		return fnErr
	})
	switch {
	case err == nil || err == fnErr:
		return err
	case errors.Is(err, dirwatch.ErrOverflow), errors.Is(err, dirwatch.ErrTooManyDirs):
		return status.Errorf(codes.ResourceExhausted, "daemontest: %v", err)
	}
	return fileErr("watch", p, err)
}

// watchOps are dirwatch's operations as the seam's.
var watchOps = [...]daemon.WatchOp{dirwatch.Create: daemon.WatchCreate, dirwatch.Write: daemon.WatchWrite,
	dirwatch.Remove: daemon.WatchRemove, dirwatch.Rename: daemon.WatchRename, dirwatch.Chmod: daemon.WatchChmod}
