package agent

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/guest/agentpb"
)

const (
	// readChunk is the size of ReadFile's chunks.
	readChunk = 256 << 10
	// permBits are the mode bits a client may set.
	permBits = 0o7777
	// tempNameBase bounds how much of the target's name the temporary
	// file of WriteFile repeats, to stay under NAME_MAX.
	tempNameBase = 64
)

// cleanPath validates a client's path: non-empty, absolute, no NUL byte.
func cleanPath(p string) (string, error) {
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
	m := fs.FileMode(perm & 0o777)
	if perm&syscall.S_ISUID != 0 {
		m |= fs.ModeSetuid
	}
	if perm&syscall.S_ISGID != 0 {
		m |= fs.ModeSetgid
	}
	if perm&syscall.S_ISVTX != 0 {
		m |= fs.ModeSticky
	}
	return m
}

// checkPerm validates a client's permission bits; 0 means def.
func checkPerm(perm, def uint32) (uint32, error) {
	if perm&^permBits != 0 {
		return 0, status.Errorf(codes.InvalidArgument, "mode %#o has bits other than permissions (07777)", perm)
	}
	if perm == 0 {
		return def, nil
	}
	return perm, nil
}

// fileInfo describes path (whose lstat or stat is fi), its owner and
// group named by names.
func fileInfo(path string, fi fs.FileInfo, names *accounts.Names) *agentpb.FileInfo {
	out := &agentpb.FileInfo{
		Path:           path,
		Name:           fi.Name(),
		Size:           fi.Size(),
		MtimeUnixNanos: fi.ModTime().UnixNano(),
		IsDir:          fi.IsDir(),
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		out.Mode, out.Uid, out.Gid = st.Mode, st.Uid, st.Gid
		out.Owner, out.Group = names.User(st.Uid), names.Group(st.Gid)
	}
	if fi.Mode()&fs.ModeSymlink != 0 {
		if target, err := os.Readlink(path); err == nil {
			out.Symlink = target
		}
	}
	return out
}

// WriteFile writes a file atomically: to a temporary file in the target's
// directory, renamed over the target once all data arrived.
func (s *Server) WriteFile(stream agentpb.Agent_WriteFileServer) error {
	req, err := stream.Recv()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return status.Error(codes.InvalidArgument, "write file: no header")
		}
		return err
	}
	h := req.GetHeader()
	if h == nil {
		return status.Error(codes.InvalidArgument, "write file: the first request must carry the header")
	}
	path, err := cleanPath(h.GetPath())
	if err != nil {
		return err
	}
	if path == "/" {
		return status.Error(codes.InvalidArgument, "write file: path is /")
	}
	perm, err := checkPerm(h.GetMode(), 0o644)
	if err != nil {
		return err
	}
	owner, err := fileOwner("write file", h.GetUser())
	if err != nil {
		return err
	}
	dir := filepath.Dir(path)
	if h.GetMakeParents() {
		if err := makeDirs(dir, 0o755, owner); err != nil {
			return fsStatus("creating the parent directories of", path, err)
		}
	}
	base := filepath.Base(path)
	if len(base) > tempNameBase {
		base = base[:tempNameBase]
	}
	f, err := os.CreateTemp(dir, "."+base+".kiln-*")
	if err != nil {
		return fsStatus("writing", path, err)
	}
	tmp := f.Name()
	done := false
	defer func() {
		if !done {
			f.Close()
			os.Remove(tmp)
		}
	}()

	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return err
		}
		data, ok := req.GetKind().(*agentpb.WriteFileRequest_Data)
		if !ok {
			return status.Error(codes.InvalidArgument, "write file: a second header")
		}
		if _, err := f.Write(data.Data); err != nil {
			return fsStatus("writing", path, err)
		}
	}
	if owner != nil {
		if err := f.Chown(int(owner.UID), int(owner.GID)); err != nil {
			return fsStatus("writing", path, err)
		}
	}
	// After the chown, which clears setuid and setgid bits.
	if err := f.Chmod(fileMode(perm)); err != nil {
		return fsStatus("writing", path, err)
	}
	if err := f.Sync(); err != nil {
		return fsStatus("writing", path, err)
	}
	if err := f.Close(); err != nil {
		return fsStatus("writing", path, err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fsStatus("writing", path, err)
	}
	done = true
	fi, err := os.Lstat(path)
	if err != nil {
		return fsStatus("writing", path, err)
	}
	return stream.SendAndClose(fileInfo(path, fi, accounts.NewNames("/")))
}

// ReadFile streams a file.
func (s *Server) ReadFile(req *agentpb.ReadFileRequest, stream agentpb.Agent_ReadFileServer) error {
	path, err := cleanPath(req.GetPath())
	if err != nil {
		return err
	}
	// Opening a FIFO would block until it has a writer, and reading a
	// socket fails anyway.
	if fi, err := os.Stat(path); err != nil {
		return fsStatus("reading", path, err)
	} else if fi.Mode()&(fs.ModeNamedPipe|fs.ModeSocket) != 0 {
		return status.Errorf(codes.InvalidArgument, "reading %s: not a regular file, directory or device (%v)", path, fi.Mode().Type())
	}
	f, err := os.Open(path)
	if err != nil {
		return fsStatus("reading", path, err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil {
		return fsStatus("reading", path, err)
	} else if fi.IsDir() {
		return fsStatus("reading", path, syscall.EISDIR)
	}
	buf := make([]byte, readChunk)
	for {
		n, err := f.Read(buf)
		if n > 0 {
			if err := stream.Send(&agentpb.Chunk{Data: buf[:n]}); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fsStatus("reading", path, err)
		}
	}
}

// Stat describes a path, following a final symlink unless no_follow.
func (s *Server) Stat(_ context.Context, req *agentpb.StatRequest) (*agentpb.FileInfo, error) {
	path, err := cleanPath(req.GetPath())
	if err != nil {
		return nil, err
	}
	stat := os.Stat
	if req.GetNoFollow() {
		stat = os.Lstat
	}
	fi, err := stat(path)
	if err != nil {
		return nil, fsStatus("stat", path, err)
	}
	return fileInfo(path, fi, accounts.NewNames("/")), nil
}

// List describes a directory's entries, sorted by name, and with a depth
// those of its subdirectories after each (symlinks not followed).
func (s *Server) List(ctx context.Context, req *agentpb.ListRequest) (*agentpb.ListResponse, error) {
	path, err := cleanPath(req.GetPath())
	if err != nil {
		return nil, err
	}
	depth := max(req.GetDepth(), 1)
	names := accounts.NewNames("/")
	resp := &agentpb.ListResponse{}
	var walk func(dir string, level uint32) error
	walk = func(dir string, level uint32) error {
		if err := ctx.Err(); err != nil {
			return status.FromContextError(err).Err()
		}
		entries, err := os.ReadDir(dir)
		if err != nil {
			if level > 1 && errors.Is(err, fs.ErrNotExist) {
				return nil // removed meanwhile
			}
			return fsStatus("listing", dir, err)
		}
		for _, e := range entries {
			p := filepath.Join(dir, e.Name())
			fi, err := e.Info()
			if errors.Is(err, fs.ErrNotExist) {
				continue // removed meanwhile
			}
			if err != nil {
				return fsStatus("listing", p, err)
			}
			if len(resp.Entries) >= agentpb.MaxListEntries {
				return status.Errorf(codes.ResourceExhausted, "listing %s to depth %d: more than %d entries; list less deep", path, depth, agentpb.MaxListEntries)
			}
			resp.Entries = append(resp.Entries, fileInfo(p, fi, names))
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
	return resp, nil
}

// Mkdir creates a directory (with its parents if asked).
func (s *Server) Mkdir(_ context.Context, req *agentpb.MkdirRequest) (*agentpb.MkdirResponse, error) {
	path, err := cleanPath(req.GetPath())
	if err != nil {
		return nil, err
	}
	perm, err := checkPerm(req.GetMode(), 0o755)
	if err != nil {
		return nil, err
	}
	owner, err := fileOwner("mkdir", req.GetUser())
	if err != nil {
		return nil, err
	}
	if req.GetParents() {
		if fi, err := os.Stat(path); err == nil && fi.IsDir() {
			return &agentpb.MkdirResponse{}, nil
		}
		if err = makeDirs(path, fileMode(perm), owner); err == nil {
			// MkdirAll applies the umask; the client asked for perm.
			err = os.Chmod(path, fileMode(perm))
		}
	} else {
		err = makeDir(path, fileMode(perm), owner)
	}
	if err != nil {
		return nil, fsStatus("creating directory", path, err)
	}
	return &agentpb.MkdirResponse{}, nil
}

// fileOwner resolves the user a file call names (nil for none).
func fileOwner(op, user string) (*accounts.User, error) {
	if user == "" {
		return nil, nil
	}
	u, err := lookupUser("/", user)
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
	// Mkdir applies the umask (and chown clears setgid); the client
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

// Move renames a file or directory and describes its new path.
func (s *Server) Move(_ context.Context, req *agentpb.MoveRequest) (*agentpb.FileInfo, error) {
	src, err := cleanPath(req.GetSource())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "move: source: %s", status.Convert(err).Message())
	}
	dst, err := cleanPath(req.GetDestination())
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "move: destination: %s", status.Convert(err).Message())
	}
	if src == "/" || dst == "/" {
		return nil, status.Error(codes.InvalidArgument, "move: refusing to move / or onto it")
	}
	if err := os.Rename(src, dst); err != nil {
		if errnoOf(err) == syscall.EXDEV {
			return nil, status.Errorf(codes.FailedPrecondition, "moving %s to %s: they are on different file systems (rename cannot cross them: copy, then remove)", src, dst)
		}
		return nil, fsStatus("moving "+src+" to", dst, err)
	}
	fi, err := os.Lstat(dst)
	if err != nil {
		return nil, fsStatus("moving "+src+" to", dst, err)
	}
	return fileInfo(dst, fi, accounts.NewNames("/")), nil
}

// Remove removes a file, an empty directory, or with recursive a tree.
func (s *Server) Remove(_ context.Context, req *agentpb.RemoveRequest) (*agentpb.RemoveResponse, error) {
	path, err := cleanPath(req.GetPath())
	if err != nil {
		return nil, err
	}
	if path == "/" {
		return nil, status.Error(codes.InvalidArgument, "remove: refusing to remove /")
	}
	if _, err := os.Lstat(path); err != nil {
		return nil, fsStatus("removing", path, err)
	}
	if req.GetRecursive() {
		err = os.RemoveAll(path)
	} else {
		err = os.Remove(path)
	}
	if err != nil {
		return nil, fsStatus("removing", path, err)
	}
	return &agentpb.RemoveResponse{}, nil
}
