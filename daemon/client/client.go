// Package client is the Go client of kilnd, the sandbox daemon: it dials
// the daemon's Unix socket or TCP address and wraps the kiln.v1 API
// (package kilnpb) in typed methods that stream files and process I/O
// from and to io.Reader and io.Writer.
//
// A call the daemon refuses returns an *Error, which keeps the gRPC
// status: status.Code(err) tells NotFound, InvalidArgument,
// FailedPrecondition and the others apart.
package client

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"iter"
	"net"
	"path"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// DefaultHost is where kilnd listens unless told otherwise.
const DefaultHost = "unix:/run/kiln/kilnd.sock"

// chunkSize is the most bytes one stdin or file message carries.
const chunkSize = 64 << 10

// Client is a connection to one kilnd. Its methods are safe for
// concurrent use.
type Client struct {
	conn *grpc.ClientConn
	api  kilnpb.KilnClient
}

// Option configures Dial.
type Option func(*options)

type options struct {
	token    string
	dialOpts []grpc.DialOption
}

// WithToken sends token as a bearer token on every call: kilnd requires
// one on TCP. It is sent in the clear, so use it on loopback or over a
// tunnel.
func WithToken(token string) Option {
	return func(o *options) { o.token = token }
}

// WithDialOptions adds gRPC dial options (interceptors, message sizes).
func WithDialOptions(opts ...grpc.DialOption) Option {
	return func(o *options) { o.dialOpts = append(o.dialOpts, opts...) }
}

// Address is a parsed kilnd host: Network is "unix" or "tcp".
type Address struct {
	Network string
	Addr    string
}

// String is the host in the form ParseHost reads: unix:///abs/path,
// unix:rel/path or tcp://HOST:PORT.
func (a Address) String() string {
	switch {
	case a.Network == "unix" && strings.HasPrefix(a.Addr, "/"):
		return "unix://" + a.Addr
	case a.Network == "unix":
		return "unix:" + a.Addr
	}
	return "tcp://" + a.Addr
}

// ParseHost parses a kilnd host: unix:///abs/path, unix:PATH or
// tcp://HOST:PORT.
func ParseHost(host string) (Address, error) {
	switch {
	case strings.HasPrefix(host, "unix://"):
		p := strings.TrimPrefix(host, "unix://")
		if !strings.HasPrefix(p, "/") {
			return Address{}, fmt.Errorf("client: host %q: unix:// needs an absolute path (unix:///path), or use unix:PATH", host)
		}
		return Address{Network: "unix", Addr: path.Clean(p)}, nil
	case strings.HasPrefix(host, "unix:"):
		p := strings.TrimPrefix(host, "unix:")
		if p == "" {
			return Address{}, fmt.Errorf("client: host %q names no socket path", host)
		}
		return Address{Network: "unix", Addr: path.Clean(p)}, nil
	case strings.HasPrefix(host, "tcp://"):
		hp := strings.TrimPrefix(host, "tcp://")
		h, port, err := net.SplitHostPort(hp)
		if err != nil || port == "" {
			return Address{}, fmt.Errorf("client: host %q: want tcp://HOST:PORT", host)
		}
		return Address{Network: "tcp", Addr: net.JoinHostPort(h, port)}, nil
	}
	return Address{}, fmt.Errorf("client: host %q: want unix:///path, unix:PATH or tcp://HOST:PORT", host)
}

// Dial connects to kilnd at host (see ParseHost) and waits until the
// connection is up or ctx ends; a daemon that is not there is an error
// here rather than on the first call.
func Dial(ctx context.Context, host string, opts ...Option) (*Client, error) {
	addr, err := ParseHost(host)
	if err != nil {
		return nil, err
	}
	var o options
	for _, opt := range opts {
		opt(&o)
	}
	dialer := func(ctx context.Context, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, addr.Network, addr.Addr)
	}
	dopts := []grpc.DialOption{
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(dialer),
		// The socket path is no authority; name the daemon plainly.
		grpc.WithAuthority("kilnd"),
	}
	if o.token != "" {
		dopts = append(dopts, grpc.WithPerRPCCredentials(bearer(o.token)))
	}
	dopts = append(dopts, o.dialOpts...)
	conn, err := grpc.NewClient("passthrough:///kilnd", dopts...)
	if err != nil {
		return nil, fmt.Errorf("client: dial %s: %w", addr, err)
	}
	if err := waitReady(ctx, conn); err != nil {
		conn.Close()
		return nil, fmt.Errorf("client: cannot reach kilnd at %s: %w", addr, err)
	}
	return &Client{conn: conn, api: kilnpb.NewKilnClient(conn)}, nil
}

// waitReady connects conn and returns once it is ready, or with an error
// at the first failure to connect or when ctx ends.
func waitReady(ctx context.Context, conn *grpc.ClientConn) error {
	conn.Connect()
	for {
		s := conn.GetState()
		switch s {
		case connectivity.Ready:
			return nil
		case connectivity.TransientFailure, connectivity.Shutdown:
			return errors.New("connection failed (is kilnd running, and may this user open its socket?)")
		}
		if !conn.WaitForStateChange(ctx, s) {
			return ctx.Err()
		}
	}
}

// NewFromConn wraps an existing gRPC connection (in-process servers,
// custom transports). Close closes conn.
func NewFromConn(conn *grpc.ClientConn) *Client {
	return &Client{conn: conn, api: kilnpb.NewKilnClient(conn)}
}

// Close closes the connection.
func (c *Client) Close() error { return c.conn.Close() }

// API is the raw kiln.v1 client, for calls this package does not wrap.
func (c *Client) API() kilnpb.KilnClient { return c.api }

// Conn is the underlying gRPC connection (the health service, say).
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// bearer is a token sent as "authorization: Bearer TOKEN".
type bearer string

var _ credentials.PerRPCCredentials = bearer("")

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

// RequireTransportSecurity is false: kilnd's TCP listener is plain, meant
// for loopback.
func (b bearer) RequireTransportSecurity() bool { return false }

// stream yields what a server stream sends until it ends, then stops; an
// error is yielded once, last.
func stream[T any](recv func() (T, error)) iter.Seq2[T, error] {
	return func(yield func(T, error) bool) {
		for {
			m, err := recv()
			if errors.Is(err, io.EOF) {
				return
			}
			if err != nil {
				var zero T
				yield(zero, err)
				return
			}
			if !yield(m, nil) {
				return
			}
		}
	}
}

// Error is a call that failed with a gRPC status: what the client was
// doing, and the daemon's code and message. status.Code and
// status.FromError see through it (GRPCStatus).
type Error struct {
	Op   string // "create sandbox", "exec in sb-…"
	Code codes.Code
	Msg  string
	err  error
}

func (e *Error) Error() string { return "kiln: " + e.Op + ": " + e.Code.String() + ": " + e.Msg }

// Unwrap is the status error as gRPC returned it.
func (e *Error) Unwrap() error { return e.err }

// GRPCStatus is the call's status.
func (e *Error) GRPCStatus() *status.Status { return status.New(e.Code, e.Msg) }

// callErr wraps a failed call's error with what the call was.
func callErr(op string, err error) error {
	if s, ok := status.FromError(err); ok && s.Code() != codes.OK {
		return &Error{Op: op, Code: s.Code(), Msg: s.Message(), err: err}
	}
	return fmt.Errorf("kiln: %s: %w", op, err)
}

// NewRequestID returns a random request ID, for CreateSandbox, Fork and
// CreateTemplate requests that a caller retries itself; those calls make
// one when a request has none.
func NewRequestID() string {
	b := make([]byte, 16)
	rand.Read(b) // never fails (crypto/rand)
	return hex.EncodeToString(b)
}
