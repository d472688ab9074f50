// Package agentpb is the gRPC API of kiln-agent, the static binary that runs
// as PID 1 inside a Kiln sandbox. The host reaches it over vsock: through
// the VM's host-side vsock Unix socket with Firecracker's "CONNECT <port>"
// convention (see package guest/client), on port [Port].
//
// agent.proto is the source; agent.pb.go and agent_grpc.pb.go are generated
// by tools/gen-proto.sh and must not be edited by hand. The service
// implementation is package guest/agent.
package agentpb

// Port is the vsock port the agent listens on.
const Port = 1024

// MaxChunkSize is the largest data payload either side puts in one message
// (stdin, stdout, stderr, file data), well under gRPC's default 4 MiB
// message limit.
const MaxChunkSize = 1 << 20
