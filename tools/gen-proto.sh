#!/usr/bin/env bash
# gen-proto.sh: regenerate the Go code of the protobuf APIs:
# guest/agentpb/agent.proto, vmmproc/vmmpb/vmm.proto and daemon/kilnpb/kiln.proto;
# and daemon/e2b/envd/envdpb's E2B envd services (Connect, not gRPC).
#
# Needs protoc (Debian: protobuf-compiler). Installs the pinned Go plugins
# into $(go env GOPATH)/bin when they are missing or of another version.
set -euo pipefail

cd "$(dirname "$0")/.."

PROTOC_GEN_GO_VERSION=v1.36.12
PROTOC_GEN_GO_GRPC_VERSION=v1.5.1
PROTOC_GEN_CONNECT_GO_VERSION=v1.21.1

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
have protoc-gen-connect-go "$PROTOC_GEN_CONNECT_GO_VERSION" ||
  GOFLAGS= $GO install "connectrpc.com/connect/cmd/protoc-gen-connect-go@$PROTOC_GEN_CONNECT_GO_VERSION"

# gen DIR FILE: the Go code of DIR/FILE, beside it.
gen() {
  protoc \
    --proto_path="$1" \
    --go_out="$1" --go_opt=paths=source_relative \
    --go-grpc_out="$1" --go-grpc_opt=paths=source_relative \
    "$2"
  echo "gen-proto: regenerated $1"
}
gen guest/agentpb agent.proto
gen vmmproc/vmmpb vmm.proto
gen daemon/kilnpb kiln.proto

# genconnect DIR FILE: the Go code and Connect handlers of DIR/FILE.
genconnect() {
  protoc \
    --proto_path="$1" \
    --go_out="$1" --go_opt=paths=source_relative \
    --connect-go_out="$1" --connect-go_opt=paths=source_relative \
    "$2"
  echo "gen-proto: regenerated $1/$2"
}
genconnect daemon/e2b/envd/envdpb process/process.proto
genconnect daemon/e2b/envd/envdpb filesystem/filesystem.proto
