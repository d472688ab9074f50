package main

import (
	"context"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// auth lets every caller on a Unix socket in (the socket's mode decides
// who can connect) and asks a TCP caller for the bearer token.
type auth struct {
	token []byte // empty: no TCP caller gets in
}

// readToken reads a token file: its first line, trimmed, at least 16
// bytes.
func readToken(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("token file: %w", err)
	}
	line, _, _ := strings.Cut(string(b), "\n")
	line = strings.TrimSpace(line)
	if len(line) < 16 {
		return nil, fmt.Errorf("token file %s: the token is %d bytes; want at least 16", path, len(line))
	}
	return []byte(line), nil
}

func (a auth) check(ctx context.Context) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return status.Error(codes.Unauthenticated, "no peer address")
	}
	switch p.Addr.(type) {
	case *net.UnixAddr, memAddr: // the socket's mode decides; kilnd itself (e2b.go)
		return nil
	}
	if len(a.token) == 0 {
		return status.Error(codes.Unauthenticated, "this daemon takes no TCP calls without --token-file")
	}
	md, _ := metadata.FromIncomingContext(ctx)
	vals := md.Get("authorization")
	if len(vals) != 1 {
		return status.Error(codes.Unauthenticated, "want one authorization: Bearer TOKEN header")
	}
	tok, ok := strings.CutPrefix(vals[0], "Bearer ")
	if !ok {
		return status.Error(codes.Unauthenticated, "the authorization header is not a bearer token")
	}
	if subtle.ConstantTimeCompare([]byte(tok), a.token) != 1 {
		return status.Error(codes.Unauthenticated, "wrong token")
	}
	return nil
}

func (a auth) unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, h grpc.UnaryHandler) (any, error) {
	if err := a.check(ctx); err != nil {
		return nil, err
	}
	return h(ctx, req)
}

func (a auth) stream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, h grpc.StreamHandler) error {
	if err := a.check(ss.Context()); err != nil {
		return err
	}
	return h(srv, ss)
}

var errNoToken = errors.New("a TCP --listen needs --token-file: TCP callers must present a bearer token")
