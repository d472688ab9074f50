#!/usr/bin/env bash
# gen-proto.sh: regenerate guest/agentpb/agent.pb.go and agent_grpc.pb.go
# from guest/agentpb/agent.proto.
#
# Needs protoc (Debian: protobuf-compiler). Installs the pinned Go plugins
# into $(go env GOPATH)/bin when they are missing or of another version.
set -euo pipefail

cd "$(dirname "$0")/.."

PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.5.1

GO=${GO:-go}
command -v protoc >/dev/null || { echo "gen-proto: no protoc: apt-get install protobuf-compiler" >&2; exit 1; }
gobin=$($GO env GOBIN)
[ -n "$gobin" ] || gobin="$($GO env GOPATH)/bin"
export PATH="$gobin:$PATH"

# have TOOL VERSION: the plugin is installed at that version.
have() {
  command -v "$1" >/dev/null && "$1" --version 2>/dev/null | grep -qF "${2#v}"
}
have protoc-gen-go "$PROTOC_GEN_GO_VERSION" ||
  GOFLAGS= $GO install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO_VERSION"
have protoc-gen-go-grpc "$PROTOC_GEN_GO_GRPC_VERSION" ||
  GOFLAGS= $GO install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC_VERSION"

protoc \
  --proto_path=guest/agentpb \
  --go_out=guest/agentpb --go_opt=paths=source_relative \
  --go-grpc_out=guest/agentpb --go-grpc_opt=paths=source_relative \
  agent.proto
echo "gen-proto: regenerated guest/agentpb"
