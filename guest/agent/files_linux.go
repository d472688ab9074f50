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

// fileInfo describes path (whose lstat or stat is fi).
func fileInfo(path string, fi fs.FileInfo) *agentpb.FileInfo {
	out := &agentpb.FileInfo{
		Path:           path,
		Name:           fi.Name(),
		Size:           fi.Size(),
		MtimeUnixNanos: fi.ModTime().UnixNano(),
		IsDir:          fi.IsDir(),
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok {
		out.Mode, out.Uid, out.Gid = st.Mode, st.Uid, st.Gid
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
	dir := filepath.Dir(path)
	if h.GetMakeParents() {
		if err := os.MkdirAll(dir, 0o755); err != nil {
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
	return stream.SendAndClose(fileInfo(path, fi))
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
	return fileInfo(path, fi), nil
}

// List describes a directory's entries, sorted by name.
func (s *Server) List(_ context.Context, req *agentpb.ListRequest) (*agentpb.ListResponse, error) {
	path, err := cleanPath(req.GetPath())
	if err != nil {
		return nil, err
	}
	entries, err := os.ReadDir(path)
	if err != nil {
		return nil, fsStatus("listing", path, err)
	}
	resp := &agentpb.ListResponse{Entries: make([]*agentpb.FileInfo, 0, len(entries))}
	for _, e := range entries {
		fi, err := e.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue // removed meanwhile
		}
		if err != nil {
			return nil, fsStatus("listing", filepath.Join(path, e.Name()), err)
		}
		resp.Entries = append(resp.Entries, fileInfo(filepath.Join(path, e.Name()), fi))
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
	if req.GetParents() {
		if fi, err := os.Stat(path); err == nil && fi.IsDir() {
			return &agentpb.MkdirResponse{}, nil
		}
		err = os.MkdirAll(path, fileMode(perm))
	} else {
		err = os.Mkdir(path, fileMode(perm))
	}
	if err != nil {
		return nil, fsStatus("creating directory", path, err)
	}
	// Mkdir applies the umask; the client asked for perm.
	if err := os.Chmod(path, fileMode(perm)); err != nil {
		return nil, fsStatus("creating directory", path, err)
	}
	return &agentpb.MkdirResponse{}, nil
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
