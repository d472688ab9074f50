package agent

import (
	"github.com/kilnvm/kiln/dirwatch"
	"github.com/kilnvm/kiln/filetree"
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

// Watch streams the changes below a directory (filetree.Tree.Watch); see
// agentpb.AgentServer.
func (s *Server) Watch(req *agentpb.WatchRequest, stream agentpb.Agent_WatchServer) error {
	return guestTree.Watch(stream.Context(), req.GetPath(), req.GetRecursive(), func(ev filetree.Event) error {
		out := &agentpb.WatchEvent{Started: ev.Started, Op: watchOps[ev.Op], Name: ev.Name}
		if ev.Entry != nil {
			out.Entry = fileInfo(*ev.Entry)
		}
		return stream.Send(out)
	})
}
