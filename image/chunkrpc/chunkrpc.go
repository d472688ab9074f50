// Package chunkrpc carries a jailed VMM process's requests for an image's
// missing chunks to its parent. The jailed process reads the image store
// through a read-only bind but has neither the registry's network nor
// write access to the store; its parent (kilnd, kiln run) serves a Unix
// socket beside the process's API socket, fetches what a request names
// (checked against the sandbox's own image: image.Root.FetchChunks) into
// the store, and answers. One request per connection, net/rpc with its
// JSON codec, every read bounded in bytes and time: the client may be a
// guest's.
package chunkrpc

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/rpc"
	"net/rpc/jsonrpc"
	"os"
	"sync"
	"time"

	"github.com/kilnvm/kiln/image"
)

const (
	// method is the one RPC the socket serves.
	method = "Chunks.Fetch"
	// maxRequestBytes bounds what the server reads of one connection:
	// a request of image.MaxChunkRequest chunks is under 200 KiB.
	maxRequestBytes = 512 << 10
	// maxConcurrent bounds the requests one socket serves at once.
	maxConcurrent = 8
)

// DefaultTimeout bounds one request on the server: its fetches (which
// have the parent's own fetch timeout) and its answer.
const DefaultTimeout = 2 * time.Minute

// Reply is the answer to a request: empty, its error says what failed.
type Reply struct{}

// Server serves chunk requests on a Unix socket.
type Server struct {
	l       net.Listener
	path    string
	f       image.ChunkFetcher
	log     *slog.Logger
	timeout time.Duration
	ctx     context.Context
	cancel  context.CancelFunc
	sem     chan struct{}
	wg      sync.WaitGroup
}

// Listen serves f's fetches on a new Unix socket at path (a stale socket
// there is replaced), owned by uid and gid (the jailed process's) with
// mode 0600 so that only that process can connect. timeout bounds each
// request (DefaultTimeout if zero).
func Listen(path string, uid, gid int, f image.ChunkFetcher, timeout time.Duration, log *slog.Logger) (*Server, error) {
	if f == nil {
		return nil, errors.New("chunkrpc: no fetcher")
	}
	if log == nil {
		log = slog.Default()
	}
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	if fi, err := os.Lstat(path); err == nil {
		if fi.Mode()&os.ModeSocket == 0 {
			return nil, fmt.Errorf("chunkrpc: %s exists and is not a socket", path)
		}
		os.Remove(path)
	}
	l, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("chunkrpc: %w", err)
	}
	if err := os.Chown(path, uid, gid); err != nil {
		l.Close()
		return nil, fmt.Errorf("chunkrpc: socket %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, fmt.Errorf("chunkrpc: socket %s: %w", path, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &Server{l: l, path: path, f: f, log: log, timeout: timeout, ctx: ctx, cancel: cancel, sem: make(chan struct{}, maxConcurrent)}
	s.wg.Add(1)
	go s.accept()
	return s, nil
}

// Close stops serving, cancels the requests in flight, waits for them and
// removes the socket.
func (s *Server) Close() error {
	err := s.l.Close()
	s.cancel()
	s.wg.Wait()
	if fi, lerr := os.Lstat(s.path); lerr == nil && fi.Mode()&os.ModeSocket != 0 {
		os.Remove(s.path)
	}
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

func (s *Server) accept() {
	defer s.wg.Done()
	for {
		conn, err := s.l.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.log.Warn("chunkrpc: accept", "socket", s.path, "err", err)
			}
			return
		}
		select {
		case s.sem <- struct{}{}:
		case <-s.ctx.Done():
			conn.Close()
			return
		}
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			defer func() { <-s.sem }()
			s.serve(conn)
		}()
	}
}

// serve answers the one request of conn.
func (s *Server) serve(conn net.Conn) {
	defer conn.Close()
	ctx, cancel := context.WithTimeout(s.ctx, s.timeout)
	defer cancel()
	conn.SetDeadline(time.Now().Add(s.timeout))
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })
	defer stop()
	srv := rpc.NewServer()
	if err := srv.RegisterName("Chunks", &service{ctx: ctx, f: s.f}); err != nil {
		s.log.Error("chunkrpc: register", "err", err)
		return
	}
	codec := jsonrpc.NewServerCodec(limitedConn{Reader: io.LimitReader(conn, maxRequestBytes), conn: conn})
	if err := srv.ServeRequest(codec); err != nil && !errors.Is(err, io.EOF) {
		s.log.Debug("chunkrpc: request", "socket", s.path, "err", err)
	}
}

// limitedConn reads at most so much of conn and writes to it.
type limitedConn struct {
	io.Reader
	conn net.Conn
}

func (c limitedConn) Write(p []byte) (int, error) { return c.conn.Write(p) }
func (c limitedConn) Close() error                { return c.conn.Close() }

// service is the RPC receiver of one connection.
type service struct {
	ctx context.Context
	f   image.ChunkFetcher
}

// Fetch fetches what req names.
func (v *service) Fetch(req image.ChunkRequest, _ *Reply) error {
	return v.f.FetchChunks(v.ctx, req)
}

// Client asks the server at Path to fetch chunks: an image.ChunkFetcher.
type Client struct {
	Path string
}

// FetchChunks sends req and waits for the answer, or for ctx.
func (c Client) FetchChunks(ctx context.Context, req image.ChunkRequest) error {
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", c.Path)
	if err != nil {
		return fmt.Errorf("chunkrpc: %w", err)
	}
	if dl, ok := ctx.Deadline(); ok {
		conn.SetDeadline(dl)
	}
	cl := jsonrpc.NewClient(conn)
	defer cl.Close()
	call := cl.Go(method, req, &Reply{}, make(chan *rpc.Call, 1))
	select {
	case <-call.Done:
		if call.Error != nil {
			return fmt.Errorf("chunkrpc: %w", call.Error)
		}
		return nil
	case <-ctx.Done():
		return fmt.Errorf("chunkrpc: %w", ctx.Err())
	}
}
