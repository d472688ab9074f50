package daemon

import (
	"context"
	"errors"
	"io"
	"io/fs"
	"path"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// maxPath is the longest path a file call takes (Linux's PATH_MAX).
const maxPath = 4096

// checkPath refuses a path that is not absolute and clean: relative, with
// a NUL byte, with "." or ".." elements or doubled slashes (a ".." could
// climb above the root), or too long. The error names the clean form.
func checkPath(field, p string) error {
	switch {
	case p == "":
		return status.Errorf(codes.InvalidArgument, "%s is empty: want an absolute path", field)
	case len(p) > maxPath:
		return status.Errorf(codes.InvalidArgument, "%s is %d bytes: at most %d", field, len(p), maxPath)
	case strings.IndexByte(p, 0) >= 0:
		return status.Errorf(codes.InvalidArgument, "%s %q has a NUL byte", field, p)
	case !strings.HasPrefix(p, "/"):
		return status.Errorf(codes.InvalidArgument, "%s %q is relative: want an absolute path", field, p)
	}
	if c := path.Clean(p); c != p {
		for _, el := range strings.Split(p, "/") {
			if el == ".." {
				return status.Errorf(codes.InvalidArgument, "%s %q has a \"..\" element: paths must be absolute and clean (%q), never climbing above /", field, p, c)
			}
		}
		return status.Errorf(codes.InvalidArgument, "%s %q is not clean: want %q", field, p, c)
	}
	return nil
}

func fileInfo(fi FileInfo) *kilnpb.FileInfo {
	return &kilnpb.FileInfo{
		Path: fi.Path, Name: fi.Name, Size: fi.Size, Mode: kilnpb.StMode(fi.Mode),
		MtimeUnixNanos: fi.ModTime.UnixNano(), IsDir: fi.IsDir, Symlink: fi.Symlink,
		Uid: fi.UID, Gid: fi.GID, Owner: fi.Owner, Group: fi.Group,
	}
}

// fileMode is a request's permission bits (with setuid, setgid, sticky);
// def when 0.
func fileMode(field string, m, def uint32) (fs.FileMode, error) {
	if m == 0 {
		m = def
	}
	if m&^0o7777 != 0 {
		return 0, status.Errorf(codes.InvalidArgument, "%s %#o: want permission bits (at most 07777)", field, m)
	}
	fm := fs.FileMode(m & 0o777)
	if m&0o4000 != 0 {
		fm |= fs.ModeSetuid
	}
	if m&0o2000 != 0 {
		fm |= fs.ModeSetgid
	}
	if m&0o1000 != 0 {
		fm |= fs.ModeSticky
	}
	return fm, nil
}

// WriteFile writes a file in a sandbox: a WriteFileHeader, then its data.
// The file appears whole once all of it arrived, or not at all.
func (s *Server) WriteFile(stream kilnpb.Kiln_WriteFileServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	h := first.GetHeader()
	if h == nil {
		return status.Errorf(codes.InvalidArgument, "write: the first request must be a WriteFileHeader, not %T", first.GetKind())
	}
	if err := checkPath("path", h.GetPath()); err != nil {
		return err
	}
	mode, err := fileMode("mode", h.GetMode(), 0o644)
	if err != nil {
		return err
	}
	if err := checkUser("user", h.GetUser()); err != nil {
		return err
	}
	b, inst, done, err := s.use(h.GetSandboxId())
	if err != nil {
		return err
	}
	defer done()
	pr, pw := io.Pipe()
	go func() {
		for {
			req, err := stream.Recv()
			if err == io.EOF {
				pw.Close()
				return
			}
			if err != nil {
				pw.CloseWithError(err)
				return
			}
			data := req.GetData()
			if req.GetHeader() != nil {
				pw.CloseWithError(status.Error(codes.InvalidArgument, "write: a second WriteFileHeader"))
				return
			}
			if _, err := pw.Write(data); err != nil {
				return
			}
		}
	}()
	fi, err := inst.WriteFile(stream.Context(), h.GetPath(), pr, mode, h.GetMakeParents(), h.GetUser())
	pr.CloseWithError(errors.New("the write is over"))
	if err != nil {
		return callErr("write "+h.GetPath()+" in sandbox "+b.id, err)
	}
	return stream.SendAndClose(fileInfo(fi))
}

// ReadFile streams a file of a sandbox.
func (s *Server) ReadFile(req *kilnpb.ReadFileRequest, stream kilnpb.Kiln_ReadFileServer) error {
	if err := checkPath("path", req.GetPath()); err != nil {
		return err
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return err
	}
	defer done()
	_, err = inst.ReadFile(stream.Context(), req.GetPath(), writerFunc(func(p []byte) (int, error) {
		if err := stream.Send(&kilnpb.FileChunk{Data: p}); err != nil {
			return 0, err
		}
		return len(p), nil
	}))
	return callErr("read "+req.GetPath()+" in sandbox "+b.id, err)
}

// maxListDepth bounds ListDirRequest.depth (the guest bounds the
// entries).
const maxListDepth = 1 << 12

// ListDir lists a directory of a sandbox, sorted by name, and with a depth
// its subdirectories after each (full paths, symlinks not followed).
func (s *Server) ListDir(ctx context.Context, req *kilnpb.ListDirRequest) (*kilnpb.ListDirResponse, error) {
	if err := checkPath("path", req.GetPath()); err != nil {
		return nil, err
	}
	if req.GetDepth() > maxListDepth {
		return nil, status.Errorf(codes.InvalidArgument, "depth %d: at most %d", req.GetDepth(), maxListDepth)
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	defer done()
	ents, err := inst.List(ctx, req.GetPath(), int(req.GetDepth()))
	if err != nil {
		return nil, callErr("list "+req.GetPath()+" in sandbox "+b.id, err)
	}
	out := &kilnpb.ListDirResponse{Entries: make([]*kilnpb.FileInfo, 0, len(ents))}
	for _, e := range ents {
		out.Entries = append(out.Entries, fileInfo(e))
	}
	return out, nil
}

// Stat describes a file of a sandbox.
func (s *Server) Stat(ctx context.Context, req *kilnpb.StatRequest) (*kilnpb.FileInfo, error) {
	if err := checkPath("path", req.GetPath()); err != nil {
		return nil, err
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	defer done()
	fi, err := inst.Stat(ctx, req.GetPath(), req.GetNoFollow())
	if err != nil {
		return nil, callErr("stat "+req.GetPath()+" in sandbox "+b.id, err)
	}
	return fileInfo(fi), nil
}

// Remove removes a file, or a tree with recursive, of a sandbox.
func (s *Server) Remove(ctx context.Context, req *kilnpb.RemoveRequest) (*kilnpb.RemoveResponse, error) {
	if err := checkPath("path", req.GetPath()); err != nil {
		return nil, err
	}
	if req.GetPath() == "/" {
		return nil, status.Error(codes.InvalidArgument, "path /: the root cannot be removed")
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	defer done()
	if err := inst.Remove(ctx, req.GetPath(), req.GetRecursive()); err != nil {
		return nil, callErr("remove "+req.GetPath()+" in sandbox "+b.id, err)
	}
	return &kilnpb.RemoveResponse{}, nil
}

// MakeDir makes a directory (and its parents, with parents) in a sandbox.
func (s *Server) MakeDir(ctx context.Context, req *kilnpb.MakeDirRequest) (*kilnpb.FileInfo, error) {
	if err := checkPath("path", req.GetPath()); err != nil {
		return nil, err
	}
	mode, err := fileMode("mode", req.GetMode(), 0o755)
	if err != nil {
		return nil, err
	}
	if err := checkUser("user", req.GetUser()); err != nil {
		return nil, err
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	defer done()
	if err := inst.Mkdir(ctx, req.GetPath(), mode, req.GetParents(), req.GetUser()); err != nil {
		return nil, callErr("mkdir "+req.GetPath()+" in sandbox "+b.id, err)
	}
	fi, err := inst.Stat(ctx, req.GetPath(), true)
	if err != nil {
		return nil, callErr("stat "+req.GetPath()+" in sandbox "+b.id, err)
	}
	return fileInfo(fi), nil
}

// Move renames a file or directory of a sandbox and describes it at its
// destination.
func (s *Server) Move(ctx context.Context, req *kilnpb.MoveRequest) (*kilnpb.FileInfo, error) {
	if err := checkPath("source", req.GetSource()); err != nil {
		return nil, err
	}
	if err := checkPath("destination", req.GetDestination()); err != nil {
		return nil, err
	}
	if req.GetSource() == "/" || req.GetDestination() == "/" {
		return nil, status.Error(codes.InvalidArgument, "move: the root cannot be moved, nor anything onto it")
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return nil, err
	}
	defer done()
	fi, err := inst.Move(ctx, req.GetSource(), req.GetDestination())
	if err != nil {
		return nil, callErr("move "+req.GetSource()+" to "+req.GetDestination()+" in sandbox "+b.id, err)
	}
	return fileInfo(fi), nil
}

// WatchDir streams the changes below a directory of a sandbox: a started
// event, then one per change, until the call ends, the directory goes or
// the sandbox ends.
func (s *Server) WatchDir(req *kilnpb.WatchDirRequest, stream kilnpb.Kiln_WatchDirServer) error {
	if err := checkPath("path", req.GetPath()); err != nil {
		return err
	}
	b, inst, done, err := s.use(req.GetSandboxId())
	if err != nil {
		return err
	}
	defer done()
	defer b.following()()
	b.mu.Lock()
	bctx := b.ctx
	b.mu.Unlock()
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	stop := context.AfterFunc(bctx, cancel) // the sandbox ended
	defer stop()
	err = inst.Watch(ctx, req.GetPath(), req.GetRecursive(), func(ev WatchEvent) error {
		out := &kilnpb.WatchEvent{Started: ev.Started, Op: kilnpb.WatchEvent_Op(ev.Op), Name: ev.Name}
		if ev.HasEntry {
			out.Entry = fileInfo(ev.Entry)
		}
		return stream.Send(out)
	})
	if err != nil {
		return callErr("watch "+req.GetPath()+" in sandbox "+b.id, err)
	}
	return nil
}
