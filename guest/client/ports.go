package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// PortError is a guest's refusal of a forwarded connection
// (agentpb.ForwardPort): nothing listens on the port, or the agent
// forwards too many connections already. Reason is the agent's.
type PortError struct {
	Port   int
	Reason string
}

func (e *PortError) Error() string {
	return fmt.Sprintf("port %d in the guest: %s", e.Port, e.Reason)
}

// DialPort connects to TCP port port on the guest's loopback through the
// agent's forwarder (agentpb.ForwardPort), over the VM's host-side vsock
// Unix socket at vsockUDS. The returned connection carries the stream; it
// is a *net.UnixConn (CloseWrite half-closes). A guest that refuses says
// why in a *PortError. The handshake is bounded by ctx and by
// agentpb.ForwardDialTimeout and a second.
func DialPort(ctx context.Context, vsockUDS string, port int) (net.Conn, error) {
	if port < 1 || port > 65535 {
		return nil, fmt.Errorf("client: port %d: want 1 to 65535", port)
	}
	timeout := agentpb.ForwardDialTimeout + time.Second
	c, err := VsockDialer(vsockUDS, agentpb.ForwardPort, timeout)(ctx)
	if err != nil {
		return nil, err
	}
	if err := forwardHandshake(ctx, c, port, timeout); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// forwardHandshake sends the request for port and reads the agent's reply.
func forwardHandshake(ctx context.Context, c net.Conn, port int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := io.WriteString(c, "TCP "+strconv.Itoa(port)+"\n"); err != nil {
		if errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
			return fmt.Errorf("client: port %d in the guest: the agent closed the connection (an agent that forwards no ports?)", port)
		}
		return fmt.Errorf("client: port %d in the guest: %w", port, ctxErr(ctx, err))
	}
	line, err := readForwardReply(c)
	if err != nil {
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("client: port %d in the guest: the agent closed the connection (an agent that forwards no ports?)", port)
		}
		return fmt.Errorf("client: port %d in the guest: reading the agent's reply (got %q): %w", port, line, ctxErr(ctx, err))
	}
	switch {
	case line == "OK":
	case strings.HasPrefix(line, "ERR "):
		return &PortError{Port: port, Reason: strings.TrimPrefix(line, "ERR ")}
	default:
		return fmt.Errorf("client: port %d in the guest: unexpected reply %q", port, line)
	}
	if !stop() {
		return fmt.Errorf("client: port %d in the guest: %w", port, ctx.Err())
	}
	return c.SetDeadline(time.Time{})
}

// readForwardReply reads one reply line (its "\n" cut off), byte by byte
// so that none of the stream that follows is taken.
func readForwardReply(r io.Reader) (string, error) {
	var line []byte
	var b [1]byte
	for {
		n, err := r.Read(b[:])
		if n == 1 {
			if b[0] == '\n' {
				return string(line), nil
			}
			if len(line) == agentpb.MaxForwardLine {
				return string(line), fmt.Errorf("reply longer than %d bytes", agentpb.MaxForwardLine)
			}
			line = append(line, b[0])
			continue
		}
		if err != nil {
			return string(line), err
		}
	}
}
