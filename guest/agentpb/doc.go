// Package agentpb is the gRPC API of kiln-agent, the static binary that runs
// as PID 1 inside a Kiln sandbox. The host reaches it over vsock: through
// the VM's host-side vsock Unix socket with Firecracker's "CONNECT <port>"
// convention (see package guest/client), on port [Port].
//
// agent.proto is the source; agent.pb.go and agent_grpc.pb.go are generated
// by tools/gen-proto.sh and must not be edited by hand. The service
// implementation is package guest/agent.
package agentpb

import "time"

// Port is the vsock port the agent listens on.
const Port = 1024

// ForwardPort is the vsock port on which the agent forwards connections to
// TCP ports of the guest's loopback (a sandbox's ports, as E2B's getHost
// and kiln sandbox port-forward reach them). The host writes
// "TCP <port>\n"; the agent connects to 127.0.0.1:<port> (then [::1]) and
// answers "OK\n", or "ERR <reason>\n" and closes. After OK the connection
// carries the TCP stream both ways, half-closes included. Nothing but the
// guest's loopback is reachable so: the sandbox's network is not opened.
const ForwardPort = 1025

// Bounds of a forwarded connection's handshake: the longest request or
// reply line, and how long the agent waits for the request and for its
// connection to the port. MaxForwards bounds the connections it forwards
// at once.
const (
	MaxForwardLine     = 256
	ForwardDialTimeout = 5 * time.Second
	MaxForwards        = 512
)

// MaxChunkSize is the largest data payload either side puts in one message
// (stdin, stdout, stderr, file data), well under gRPC's default 4 MiB
// message limit.
const MaxChunkSize = 1 << 20

// Transport sizes both sides use over vsock. Every vsock packet costs the
// guest an interrupt and the VMM a trip through the virtqueue, so the
// connection batches: writes of up to BufferSize, and HTTP/2 flow-control
// windows of StreamWindow per call and ConnWindow per connection, so that
// window updates (packets the other way) come once per hundreds of KiB
// rather than every few KiB. A fixed window also turns off gRPC's
// bandwidth probing pings.
const (
	BufferSize   = 256 << 10
	StreamWindow = 1 << 20
	ConnWindow   = 4 << 20
)

// Bounds of the detached processes (ExecStart.detach_id): how many the
// agent keeps, how long an ID may be, and how much of each output stream
// it keeps for WaitDetached.
const (
	MaxDetached      = 1024
	MaxDetachedIDLen = 128
	DetachedTailSize = 64 << 10
)

// Bounds of the file calls: how many entries one List returns in all
// (ListRequest.depth), how many directories a recursive Watch watches,
// and how many attachers (AttachDetached) one detached process has.
const (
	MaxListEntries   = 100_000
	MaxWatchDirs     = 8192
	MaxAttachers     = 16
	MaxPtyDimension  = 65535
	MaxUserNameBytes = 256
)

// MaxRootNameLen is the longest name of a container root (MountRoot) and
// of a tree or volume AddMounts names.
const MaxRootNameLen = 128

// ValidRootName reports whether name may name a container root, or a tree
// or volume of AddMounts: 1 to MaxRootNameLen bytes of A-Z a-z 0-9 . _ -,
// not "." or "..". The agent refuses any other; a host checks first.
func ValidRootName(name string) bool {
	if name == "" || len(name) > MaxRootNameLen || name == "." || name == ".." {
		return false
	}
	for _, c := range []byte(name) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// ValidDetachedID reports whether id may name a detached process
// (ExecStart.detach_id): 1 to MaxDetachedIDLen bytes of A-Z a-z 0-9 . _
// - :.
func ValidDetachedID(id string) bool {
	if id == "" || len(id) > MaxDetachedIDLen {
		return false
	}
	for _, c := range []byte(id) {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-' || c == ':') {
			return false
		}
	}
	return true
}
