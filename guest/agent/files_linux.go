package agent

import (
	"context"
	"errors"
	"io"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/filetree"
	"github.com/kilnvm/kiln/guest/agentpb"
	"github.com/kilnvm/kiln/stmode"
)

// The file calls are package filetree's on the guest's own tree, its
// owners those of its /etc/passwd and /etc/group.
var guestTree = filetree.Tree{Root: "/", Accounts: "/"}

// fileInfo is a filetree.Info as the API's.
func fileInfo(fi filetree.Info) *agentpb.FileInfo {
	return &agentpb.FileInfo{
		Path:           fi.Path,
		Name:           fi.Name,
		Size:           fi.Size,
		Mode:           stmode.FromFileMode(fi.Mode),
		Uid:            fi.UID,
		Gid:            fi.GID,
		MtimeUnixNanos: fi.ModTime.UnixNano(),
		IsDir:          fi.IsDir,
		Symlink:        fi.Symlink,
		Owner:          fi.Owner,
		Group:          fi.Group,
	}
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
	fi, err := guestTree.Write(h.GetPath(), h.GetMode(), h.GetMakeParents(), h.GetUser(), &writeReader{stream: stream})
	if err != nil {
		return err
	}
	return stream.SendAndClose(fileInfo(fi))
}

// writeReader reads the data of a WriteFile call: its stream's errors as
// they are, io.EOF at its end, InvalidArgument at a second header.
type writeReader struct {
	stream agentpb.Agent_WriteFileServer
	data   []byte
}

func (r *writeReader) Read(p []byte) (int, error) {
	for len(r.data) == 0 {
		req, err := r.stream.Recv()
		if err != nil {
			return 0, err
		}
		data, ok := req.GetKind().(*agentpb.WriteFileRequest_Data)
		if !ok {
			return 0, status.Error(codes.InvalidArgument, "write file: a second header")
		}
		r.data = data.Data
	}
	n := copy(p, r.data)
	r.data = r.data[n:]
	return n, nil
}

// ReadFile streams a file.
func (s *Server) ReadFile(req *agentpb.ReadFileRequest, stream agentpb.Agent_ReadFileServer) error {
	_, err := guestTree.Read(req.GetPath(), chunkWriter(func(b []byte) error { return stream.Send(&agentpb.Chunk{Data: b}) }))
	return err
}

// chunkWriter sends each write as a message.
type chunkWriter func([]byte) error

func (w chunkWriter) Write(b []byte) (int, error) {
	if err := w(b); err != nil {
		return 0, err
	}
	return len(b), nil
}

// Stat describes a path, following a final symlink unless no_follow.
func (s *Server) Stat(_ context.Context, req *agentpb.StatRequest) (*agentpb.FileInfo, error) {
	fi, err := guestTree.Stat(req.GetPath(), req.GetNoFollow())
	if err != nil {
		return nil, err
	}
	return fileInfo(fi), nil
}

// List describes a directory's entries, sorted by name, and with a depth
// those of its subdirectories after each (symlinks not followed).
func (s *Server) List(ctx context.Context, req *agentpb.ListRequest) (*agentpb.ListResponse, error) {
	fis, err := guestTree.List(ctx, req.GetPath(), req.GetDepth())
	if err != nil {
		return nil, err
	}
	resp := &agentpb.ListResponse{}
	for _, fi := range fis {
		resp.Entries = append(resp.Entries, fileInfo(fi))
	}
	return resp, nil
}

// Mkdir creates a directory (with its parents if asked).
func (s *Server) Mkdir(_ context.Context, req *agentpb.MkdirRequest) (*agentpb.MkdirResponse, error) {
	if err := guestTree.Mkdir(req.GetPath(), req.GetMode(), req.GetParents(), req.GetUser()); err != nil {
		return nil, err
	}
	return &agentpb.MkdirResponse{}, nil
}

// Move renames a file or directory and describes its new path.
func (s *Server) Move(_ context.Context, req *agentpb.MoveRequest) (*agentpb.FileInfo, error) {
	fi, err := guestTree.Move(req.GetSource(), req.GetDestination())
	if err != nil {
		return nil, err
	}
	return fileInfo(fi), nil
}

// Remove removes a file, an empty directory, or with recursive a tree.
func (s *Server) Remove(_ context.Context, req *agentpb.RemoveRequest) (*agentpb.RemoveResponse, error) {
	if err := guestTree.Remove(req.GetPath(), req.GetRecursive()); err != nil {
		return nil, err
	}
	return &agentpb.RemoveResponse{}, nil
}
