package agent

import (
	"context"
	"errors"
	"io/fs"
	"os"
	"path/filepath"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/accounts"
	"github.com/kilnvm/kiln/dirwatch"
	"github.com/kilnvm/kiln/guest/agentpb"
)

// watchOps are dirwatch's operations as the agent's API names them.
var watchOps = [...]agentpb.WatchEvent_Op{
	dirwatch.Create: agentpb.WatchEvent_OP_CREATE,
	dirwatch.Write:  agentpb.WatchEvent_OP_WRITE,
	dirwatch.Remove: agentpb.WatchEvent_OP_REMOVE,
	dirwatch.Rename: agentpb.WatchEvent_OP_RENAME,
	dirwatch.Chmod:  agentpb.WatchEvent_OP_CHMOD,
}

// watchDir watches the directory dir (absolute) with dirwatch, up to
// agentpb.MaxWatchDirs directories, and sends its events as the API's:
// each entry described as the file calls do (owner and group named from
// the guest's account files). It ends as dirwatch.Watch does, its
// failures gRPC statuses (RESOURCE_EXHAUSTED when the kernel's queue
// overflowed or there are too many directories); send's errors end it
// as they are.
func watchDir(ctx context.Context, dir string, recursive bool, send func(*agentpb.WatchEvent) error) error {
	names := accounts.NewNames("/")
	var sendErr error
	err := dirwatch.Watch(ctx, dir, recursive, agentpb.MaxWatchDirs, func(ev dirwatch.Event) error {
		out := &agentpb.WatchEvent{Started: ev.Started, Op: watchOps[ev.Op], Name: ev.Name}
		if ev.Info != nil {
			out.Entry = fileInfo(filepath.Join(dir, ev.Name), ev.Info, names)
		}
		sendErr = send(out)
		return sendErr
	})
	var pe *fs.PathError
	switch {
	case err == nil || err == sendErr:
		return err
	case errors.Is(err, dirwatch.ErrOverflow):
		return status.Errorf(codes.ResourceExhausted, "watching %s: the kernel's event queue overflowed (changes were lost); watch again", dir)
	case errors.Is(err, dirwatch.ErrTooManyDirs):
		return status.Errorf(codes.ResourceExhausted, "watching %s: more than %d directories below it", dir, agentpb.MaxWatchDirs)
	case errors.As(err, &pe):
		return fsStatus("watching", pe.Path, pe.Err)
	}
	return status.Error(codes.Internal, err.Error())
}

// Watch streams the changes below a directory; see agentpb.AgentServer.
func (s *Server) Watch(req *agentpb.WatchRequest, stream agentpb.Agent_WatchServer) error {
	path, err := cleanPath(req.GetPath())
	if err != nil {
		return err
	}
	fi, err := os.Stat(path)
	if err != nil {
		return fsStatus("watching", path, err)
	}
	if !fi.IsDir() {
		return status.Errorf(codes.InvalidArgument, "watching %s: not a directory", path)
	}
	return watchDir(stream.Context(), path, req.GetRecursive(), stream.Send)
}
