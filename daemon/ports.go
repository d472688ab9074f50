package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// Bounds of ForwardPort: the most bytes one request carries, the most
// connections one sandbox forwards at once (its guest's vsock device
// keeps room for the agent's own), how long a connection's dial may take,
// and the size of what one response carries.
const (
	MaxForwardData    = 1 << 20
	MaxForwardsPerBox = 256
	portDialTimeout   = 10 * time.Second
	forwardChunk      = 64 << 10
)

// ForwardPort carries one TCP connection to a port of a running
// sandbox's loopback (Instance.DialPort), as kiln.v1 describes.
func (s *Server) ForwardPort(stream kilnpb.Kiln_ForwardPortServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	port := first.GetPort()
	if port < 1 || port > 65535 {
		return status.Errorf(codes.InvalidArgument, "forward port: port %d: want 1 to 65535", port)
	}
	if len(first.GetData()) > MaxForwardData {
		return status.Errorf(codes.InvalidArgument, "forward port: a request carries at most %d bytes, not %d", MaxForwardData, len(first.GetData()))
	}
	b, inst, done, err := s.use(first.GetSandboxId())
	if err != nil {
		return err
	}
	defer done()
	defer b.following()()
	b.mu.Lock()
	if b.forwards >= MaxForwardsPerBox {
		b.mu.Unlock()
		return status.Errorf(codes.ResourceExhausted, "port %d of sandbox %s: it forwards %d connections already", port, b.id, MaxForwardsPerBox)
	}
	b.forwards++
	bctx := b.ctx
	b.mu.Unlock()
	defer func() {
		b.mu.Lock()
		b.forwards--
		b.mu.Unlock()
	}()
	what := fmt.Sprintf("port %d of sandbox %s", port, b.id)

	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()
	stop := context.AfterFunc(bctx, cancel) // the sandbox ended
	defer stop()
	dctx, dcancel := context.WithTimeout(ctx, portDialTimeout)
	conn, err := inst.DialPort(dctx, int(port))
	dcancel()
	if err != nil {
		if errors.Is(err, ErrPortRefused) {
			return status.Errorf(codes.Unavailable, "%s: %v", what, err)
		}
		return callErr(what, err)
	}
	defer conn.Close()
	closeConn := context.AfterFunc(ctx, func() { conn.Close() })
	defer closeConn()
	if err := stream.Send(&kilnpb.ForwardPortResponse{}); err != nil {
		return err
	}

	// The client's side: requests' data to the guest until CloseSend,
	// which half-closes the connection.
	var wg sync.WaitGroup
	var inErr error
	wg.Go(func() {
		data := first.GetData()
		for {
			if len(data) > 0 {
				if _, err := conn.Write(data); err != nil {
					inErr = fmt.Errorf("writing to the guest: %w", err)
					cancel()
					return
				}
			}
			req, err := stream.Recv()
			if err == io.EOF {
				if cw, ok := conn.(interface{ CloseWrite() error }); ok {
					cw.CloseWrite()
				}
				return
			}
			if err != nil {
				inErr = err
				cancel()
				return
			}
			if len(req.GetData()) > MaxForwardData {
				inErr = status.Errorf(codes.InvalidArgument, "%s: a request carries at most %d bytes, not %d", what, MaxForwardData, len(req.GetData()))
				cancel()
				return
			}
			data = req.GetData()
		}
	})

	// The guest's side: its data to the client until it ends.
	buf := make([]byte, forwardChunk)
	var outErr error
	for {
		n, err := conn.Read(buf)
		if n > 0 {
			if err := stream.Send(&kilnpb.ForwardPortResponse{Data: buf[:n]}); err != nil {
				outErr = err
				break
			}
		}
		if err == io.EOF {
			outErr = stream.Send(&kilnpb.ForwardPortResponse{Eof: true})
			break
		}
		if err != nil {
			outErr = err
			break
		}
	}
	if outErr != nil {
		cancel() // the client's side ends too
	}
	wg.Wait()
	switch {
	case bctx.Err() != nil:
		return status.Errorf(codes.Unavailable, "%s: the sandbox stopped running", what)
	case inErr != nil && status.Code(inErr) == codes.InvalidArgument:
		return inErr
	case stream.Context().Err() != nil:
		return status.FromContextError(stream.Context().Err()).Err()
	case outErr != nil && !errors.Is(outErr, net.ErrClosed):
		return status.Errorf(codes.Unavailable, "%s: the connection failed: %v", what, outErr)
	case inErr != nil:
		return status.Errorf(codes.Unavailable, "%s: the connection failed: %v", what, inErr)
	}
	return nil
}
