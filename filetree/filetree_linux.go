package filetree

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/dirwatch"
	"github.com/kilnvm/kiln/stmode"
)

// Bounds of the calls (the guest agent's API states them as its own,
// agentpb's, which the agent's tests hold them to).
const (
	// MaxListEntries is the most entries one List returns in all.
	MaxListEntries = 100_000
	// MaxWatchDirs is the most directories a recursive Watch watches.
	MaxWatchDirs = 8192
	// MaxUserNameBytes is the longest user name a call may name.
	MaxUserNameBytes = 256
)

const (
	// readChunk is the size of Read's writes.
	readChunk = 256 << 10
	// permBits are the mode bits a caller may set.
	permBits = 0o7777
	// tempNameBase bounds how much of the target's name the temporary
	// file of Write repeats, to stay under NAME_MAX.
	tempNameBase = 64
)

// Tree is a file tree: the folder Root of this machine as the calls' "/"
// ("/" itself for a guest's own tree), its files' owners the users and
// groups of the account files under Accounts (etc/passwd, etc/group).
type Tree struct {
	Root     string
	Accounts string
}

// Info describes a file of the tree.
type Info struct {
	Path    string // the tree's path
	Name    string
	Size    int64
	Mode    fs.FileMode
	ModTime time.Time
	IsDir   bool
	Symlink string // the target, for a symlink that was not followed
	UID     uint32
	GID     uint32
	// Owner and Group are the account files' names for UID and GID, or
	// the numbers when they have none.
	Owner string
	Group string
}

// Event is a change a watch saw (Watch): dirwatch's, its entry described
// as the calls describe files.
type Event struct {
	Started bool
	Op      dirwatch.Op
	// Name is the entry's path relative to the watched directory.
	Name string
	// Entry describes it as it is now, when it exists.
	Entry *Info
}

// host is the path on this machine of the tree's path p (absolute,
// clean): p itself in a tree whose Root is "/". Under another Root, p's
// symlinks resolve in the tree, as in a chroot, not on this machine: the
// part of p that exists is resolved (its final symlink too when follow)
// and what does not exist is joined to it.
func (t Tree) host(p string, follow bool) string {
	if t.Root == "/" {
		return p
	}
	if !follow && p != "/" {
		return filepath.Join(t.host(filepath.Dir(p), true), filepath.Base(p))
	}
	return t.resolve(p, "", 0)
}

// resolve is host for a Root other than "/": p's longest prefix that
// exists, resolved in the tree (openat2's RESOLVE_IN_ROOT), joined to
// the rest, a dangling symlink where they meet followed in the tree too;
// past 40 symlinks, a path no call opens.
func (t Tree) resolve(p, rest string, links int) string {
	if links > 40 {
		return t.Root + "/\x00too many symlinks" // no call opens it (EINVAL)
	}
	root, err := os.Open(t.Root)
	if err != nil {
		return filepath.Join(t.Root, p, rest) // the call fails as it would
	}
	defer root.Close()
	for ; ; p, rest = filepath.Dir(p), filepath.Join(filepath.Base(p), rest) {
		fd, err := unix.Openat2(int(root.Fd()), p, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT})
		if err != nil && p == "/" {
			return filepath.Join(t.Root, rest) // the call fails as it would
		}
		if err != nil {
			continue // p is not there
		}
		real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
		unix.Close(fd)
		target, lerr := os.Readlink(real)
		switch {
		case err != nil:
			return filepath.Join(t.Root, p, rest)
		case lerr != nil:
			return filepath.Join(real, rest)
		case !filepath.IsAbs(target):
			target = filepath.Join(filepath.Dir(p), target)
		}
		return t.resolve(filepath.Clean(target), rest, links+1)
	}
}

// treePath is the tree's path of host, a path on this machine under Root.
func (t Tree) treePath(host string) string {
	if r, err := filepath.Rel(t.Root, host); t.Root != "/" && err == nil {
		return filepath.Join("/", r)
	}
	return host
}

// CleanPath validates a caller's path: non-empty, absolute, no NUL byte.
func CleanPath(p string) (string, error) {
	switch {
	case p == "":
		return "", status.Error(codes.InvalidArgument, "path is empty")
	case strings.IndexByte(p, 0) >= 0:
		return "", status.Errorf(codes.InvalidArgument, "path %s contains a NUL byte", quoteShort(p))
	case !filepath.IsAbs(p):
		return "", status.Errorf(codes.InvalidArgument, "path %s is not absolute", quoteShort(p))
	}
	return filepath.Clean(p), nil
}

// fileMode converts Unix permission bits (07777) to an fs.FileMode.
func fileMode(perm uint32) fs.FileMode {
	return stmode.FileMode(stmode.IFREG | perm&permBits)
}

// checkPerm validates a caller's permission bits; 0 means def.
func checkPerm(perm, def uint32) (uint32, error) {
	if perm&^permBits != 0 {
		return 0, status.Errorf(codes.InvalidArgument, "mode %#o has bits other than permissions (07777)", perm)
	}
	if perm == 0 {
		return def, nil
	}
	return perm, nil
}

// info describes the tree's path p, whose lstat or stat is fi, its owner
// and group named by names.
func (t Tree) info(p string, fi fs.FileInfo, names *accounts.Names) Info {
	out := Info{Path: p, Name: filepath.Base(p), Size: fi.Size(), Mode: fi.Mode(), ModTime: fi.ModTime(), IsDir: fi.IsDir()}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		out.UID, out.GID = st.Uid, st.Gid
		out.Owner, out.Group = names.User(st.Uid), names.Group(st.Gid)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		if target, err := os.Readlink(t.host(p, false)); err == nil {
			out.Symlink = target
		}
	}
	return out
}

// Write writes the file path atomically: r's bytes go to a temporary file
// in its directory, renamed over it once r ended (io.EOF). perm is its
// permission bits (0: 0644), user its owner ("": the caller), makeParents
// creates its missing parent directories (0755, user's). An error of r
// other than io.EOF ends it as it is.
func (t Tree) Write(path string, perm uint32, makeParents bool, user string, r io.Reader) (Info, error) {
	path, err := CleanPath(path)
	if err != nil {
		return Info{}, err
	}
	if path == "/" {
		return Info{}, status.Error(codes.InvalidArgument, "write file: path is /")
	}
	perm, err = checkPerm(perm, 0o644)
	if err != nil {
		return Info{}, err
	}
	owner, err := t.owner("write file", user)
	if err != nil {
		return Info{}, err
	}
	dir := t.host(filepath.Dir(path), true)
	if makeParents {
		if err := makeDirs(dir, 0o755, owner); err != nil {
			return Info{}, Status("creating the parent directories of", path, err)
		}
	}
	base := filepath.Base(path)
	if len(base) > tempNameBase {
		base = base[:tempNameBase]
	}
	f, err := os.CreateTemp(dir, "."+base+".kiln-*")
	if err != nil {
		return Info{}, Status("writing", path, err)
	}
	tmp := f.Name()
	done := false
	defer func() {
		if !done {
			f.Close()
			os.Remove(tmp)
		}
	}()
	buf := make([]byte, readChunk)
	for {
		n, rerr := r.Read(buf)
		if n > 0 {
			if _, err := f.Write(buf[:n]); err != nil {
				return Info{}, Status("writing", path, err)
			}
		}
		if errors.Is(rerr, io.EOF) {
			break
		}
		if rerr != nil {
			return Info{}, rerr
		}
	}
	if owner != nil {
		if err := f.Chown(int(owner.UID), int(owner.GID)); err != nil {
			return Info{}, Status("writing", path, err)
		}
	}
	// After the chown, which clears setuid and setgid bits.
	if err := f.Chmod(fileMode(perm)); err != nil {
		return Info{}, Status("writing", path, err)
	}
	if err := f.Sync(); err != nil {
		return Info{}, Status("writing", path, err)
	}
	if err := f.Close(); err != nil {
		return Info{}, Status("writing", path, err)
	}
	if err := os.Rename(tmp, t.host(path, false)); err != nil {
		return Info{}, Status("writing", path, err)
	}
	done = true
	fi, err := os.Lstat(t.host(path, false))
	if err != nil {
		return Info{}, Status("writing", path, err)
	}
	return t.info(path, fi, accounts.NewNames(t.Accounts)), nil
}

// Read copies the file path to w, in writes of at most 256 KiB, and
// returns how many bytes it wrote; w's errors end it as they are.
func (t Tree) Read(path string, w io.Writer) (int64, error) {
	path, err := CleanPath(path)
	if err != nil {
		return 0, err
	}
	// Opening a FIFO would block until it has a writer, and reading a
	// socket fails anyway.
	if fi, err := os.Stat(t.host(path, true)); err != nil {
		return 0, Status("reading", path, err)
	} else if fi.Mode()&(fs.ModeNamedPipe|fs.ModeSocket) != 0 {
		return 0, status.Errorf(codes.InvalidArgument, "reading %s: not a regular file, directory or device (%v)", path, fi.Mode().Type())
	}
	f, err := os.Open(t.host(path, true))
	if err != nil {
		return 0, Status("reading", path, err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return 0, Status("reading", path, err)
	} else if fi.IsDir() {
		return 0, Status("reading", path, syscall.EISDIR)
	}
	buf := make([]byte, readChunk)
	var total int64
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if _, err := w.Write(buf[:n]); err != nil {
				return total, err
			}
			total += int64(n)
		}
		if errors.Is(err, io.EOF) {
			return total, nil
		}
		if err != nil {
			return total, Status("reading", path, err)
		}
	}
}

// Stat describes path, following a final symlink unless noFollow.
func (t Tree) Stat(path string, noFollow bool) (Info, error) {
	path, err := CleanPath(path)
	if err != nil {
		return Info{}, err
	}
	stat := os.Stat
	if noFollow {
		stat = os.Lstat
	}
	fi, err := stat(t.host(path, !noFollow))
	if err != nil {
		return Info{}, Status("stat", path, err)
	}
	return t.info(path, fi, accounts.NewNames(t.Accounts)), nil
}

// List describes the directory path's entries, sorted by name, each
// directory's followed by its own down to depth levels (0 as 1), not
// following symlinks; more than MaxListEntries in all is
// ResourceExhausted.
func (t Tree) List(ctx context.Context, path string, depth uint32) ([]Info, error) {
	path, err := CleanPath(path)
	if err != nil {
		return nil, err
	}
	depth = max(depth, 1)
	names := accounts.NewNames(t.Accounts)
	var out []Info
	var walk func(dir string, level uint32) error
	walk = func(dir string, level uint32) error {
		if err := ctx.Err(); err != nil {
			return status.FromContextError(err).Err()
		}
		entries, err := os.ReadDir(t.host(dir, true))
		if err != nil {
			if level > 1 && errors.Is(err, fs.ErrNotExist) {
				return nil // removed meanwhile
			}
			return Status("listing", dir, err)
		}
		for _, e := range entries {
			p := filepath.Join(dir, e.Name())
			fi, err := e.Info()
			if errors.Is(err, fs.ErrNotExist) {
				continue // removed meanwhile
			}
			if err != nil {
				return Status("listing", p, err)
			}
			if len(out) >= MaxListEntries {
				return status.Errorf(codes.ResourceExhausted, "listing %s to depth %d: more than %d entries; list less deep", path, depth, MaxListEntries)
			}
			out = append(out, t.info(p, fi, names))
			if e.IsDir() && level < depth {
				if err := walk(p, level+1); err != nil {
					return err
				}
			}
		}
		return nil
	}
	if err := walk(path, 1); err != nil {
		return nil, err
	}
	return out, nil
}

// Mkdir creates the directory path with perm (0: 0755; not masked by the
// umask), owned by user ("": the caller); parents creates its missing
// parents too, and an existing directory is then no error.
func (t Tree) Mkdir(path string, perm uint32, parents bool, user string) error {
	path, err := CleanPath(path)
	if err != nil {
		return err
	}
	perm, err = checkPerm(perm, 0o755)
	if err != nil {
		return err
	}
	owner, err := t.owner("mkdir", user)
	if err != nil {
		return err
	}
	host := t.host(path, parents)
	if parents {
		if fi, err := os.Stat(host); err == nil && fi.IsDir() {
			return nil
		}
		if err = makeDirs(host, fileMode(perm), owner); err == nil {
			// MkdirAll applies the umask; the caller asked for perm.
			err = os.Chmod(host, fileMode(perm))
		}
	} else {
		err = makeDir(host, fileMode(perm), owner)
	}
	if err != nil {
		return Status("creating directory", path, err)
	}
	return nil
}

// owner resolves the user a call names (nil for none).
func (t Tree) owner(op, user string) (*accounts.User, error) {
	if user == "" {
		return nil, nil
	}
	u, err := LookupUser(t.Accounts, user)
	if err != nil {
		return nil, status.Errorf(status.Code(err), "%s: %s", op, status.Convert(err).Message())
	}
	return u, nil
}

// makeDir creates the directory path with perm (not masked by the
// umask), owned by owner when set.
func makeDir(path string, perm fs.FileMode, owner *accounts.User) error {
	if err := os.Mkdir(path, perm); err != nil {
		return err
	}
	if owner != nil {
		if err := os.Lchown(path, int(owner.UID), int(owner.GID)); err != nil {
			return err
		}
	}
	// Mkdir applies the umask (and chown clears setgid); the caller
	// asked for perm.
	return os.Chmod(path, perm)
}

// makeDirs creates path and its missing parents (each with perm, owned
// by owner when set); an existing directory is not an error.
func makeDirs(path string, perm fs.FileMode, owner *accounts.User) error {
	if owner == nil {
		return os.MkdirAll(path, perm)
	}
	var missing []string
	for p := path; ; p = filepath.Dir(p) {
		fi, err := os.Stat(p)
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
		if p == "/" {
			break
		}
	}
	for i := len(missing) - 1; i >= 0; i-- {
		if err := makeDir(missing[i], perm, owner); err != nil && !errors.Is(err, fs.ErrExist) {
			return err
		}
	}
	return nil
}

// Move renames src to dst (rename(2): FailedPrecondition across file
// systems) and describes dst.
func (t Tree) Move(src, dst string) (Info, error) {
	src, err := CleanPath(src)
	if err != nil {
		return Info{}, status.Errorf(codes.InvalidArgument, "move: source: %s", status.Convert(err).Message())
	}
	dst, err = CleanPath(dst)
	if err != nil {
		return Info{}, status.Errorf(codes.InvalidArgument, "move: destination: %s", status.Convert(err).Message())
	}
	if src == "/" || dst == "/" {
		return Info{}, status.Error(codes.InvalidArgument, "move: refusing to move / or onto it")
	}
	if err := os.Rename(t.host(src, false), t.host(dst, false)); err != nil {
		if errors.Is(err, syscall.EXDEV) {
			return Info{}, status.Errorf(codes.FailedPrecondition, "moving %s to %s: they are on different file systems (rename cannot cross them: copy, then remove)", src, dst)
		}
		return Info{}, Status("moving "+src+" to", dst, err)
	}
	fi, err := os.Lstat(t.host(dst, false))
	if err != nil {
		return Info{}, Status("moving "+src+" to", dst, err)
	}
	return t.info(dst, fi, accounts.NewNames(t.Accounts)), nil
}

// Remove removes the file or empty directory path, or with recursive the
// tree below it too.
func (t Tree) Remove(path string, recursive bool) error {
	path, err := CleanPath(path)
	if err != nil {
		return err
	}
	if path == "/" {
		return status.Error(codes.InvalidArgument, "remove: refusing to remove /")
	}
	host := t.host(path, false)
	if _, err := os.Lstat(host); err != nil {
		return Status("removing", path, err)
	}
	if recursive {
		err = os.RemoveAll(host)
	} else {
		err = os.Remove(host)
	}
	if err != nil {
		return Status("removing", path, err)
	}
	return nil
}

// Watch calls fn with the changes below the directory path (recursive: in
// its subdirectories too, up to MaxWatchDirs directories), a started
// event first, as dirwatch.Watch does: until ctx ends or the directory
// goes (nil), fn fails (its error, as it is) or the watch does
// (ResourceExhausted when the kernel's queue overflowed or there are too
// many directories).
func (t Tree) Watch(ctx context.Context, path string, recursive bool, fn func(Event) error) error {
	path, err := CleanPath(path)
	if err != nil {
		return err
	}
	fi, err := os.Stat(t.host(path, true))
	if err != nil {
		return Status("watching", path, err)
	}
	if !fi.IsDir() {
		return status.Errorf(codes.InvalidArgument, "watching %s: not a directory", path)
	}
	names := accounts.NewNames(t.Accounts)
	var fnErr error
	err = dirwatch.Watch(ctx, t.host(path, true), recursive, MaxWatchDirs, func(ev dirwatch.Event) error {
		out := Event{Started: ev.Started, Op: ev.Op, Name: ev.Name}
		if ev.Info != nil {
			in := t.info(filepath.Join(path, ev.Name), ev.Info, names)
			out.Entry = &in
		}
		fnErr = fn(out)
		return fnErr
	})
	var pe *fs.PathError
	switch {
	case err == nil || err == fnErr:
		return err
	case errors.Is(err, dirwatch.ErrOverflow):
		return status.Errorf(codes.ResourceExhausted, "watching %s: the kernel's event queue overflowed (changes were lost); watch again", path)
	case errors.Is(err, dirwatch.ErrTooManyDirs):
		return status.Errorf(codes.ResourceExhausted, "watching %s: more than %d directories below it", path, MaxWatchDirs)
	case errors.As(err, &pe):
		return Status("watching", t.treePath(pe.Path), pe.Err)
	}
	return status.Error(codes.Internal, err.Error())
}

// quoteShort quotes s, shortened to keep error messages readable.
func quoteShort(s string) string {
	const limit = 128
	if len(s) > limit {
		s = s[:limit] + "..."
	}
	return strconv.Quote(s)
}
