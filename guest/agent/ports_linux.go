package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/kilnvm/kiln/guest/agentpb"
)

// ServePorts forwards the connections ln accepts (the vsock port
// agentpb.ForwardPort) to TCP ports of the guest's loopback, as
// agentpb.ForwardPort describes, until ctx ends (then it closes ln and
// returns nil) or accepting fails. At most agentpb.MaxForwards
// connections are forwarded at once; one more is answered with an ERR.
func ServePorts(ctx context.Context, ln net.Listener, log *slog.Logger) error {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	slots := make(chan struct{}, agentpb.MaxForwards)
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("agent: forwarding ports on %s: %w", ln.Addr(), err)
		}
		select {
		case slots <- struct{}{}:
		default:
			wg.Go(func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(agentpb.ForwardDialTimeout))
				io.WriteString(c, fmt.Sprintf("ERR %d connections are forwarded already\n", agentpb.MaxForwards))
			})
			continue
		}
		wg.Go(func() {
			defer func() { <-slots }()
			forward(ctx, c, log)
		})
	}
}

// forward serves one forwarded connection: the request line, the
// connection to the guest's port, the reply, then the stream both ways.
func forward(ctx context.Context, c net.Conn, log *slog.Logger) {
	defer c.Close()
	c.SetDeadline(time.Now().Add(agentpb.ForwardDialTimeout))
	port, err := readForwardRequest(c)
	if err != nil {
		io.WriteString(c, "ERR "+oneLine(err.Error())+"\n")
		return
	}
	t, err := dialLoopback(ctx, port)
	if err != nil {
		io.WriteString(c, "ERR "+oneLine(err.Error())+"\n")
		return
	}
	defer t.Close()
	if _, err := io.WriteString(c, "OK\n"); err != nil {
		return
	}
	c.SetDeadline(time.Time{})
	stop := context.AfterFunc(ctx, func() { c.Close(); t.Close() })
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() { splice(t, c) })
	splice(c, t)
	wg.Wait()
	log.Debug("forwarded connection ended", "port", port)
}

// readForwardRequest reads "TCP <port>\n" from c, byte by byte so that
// none of the stream that follows is taken.
func readForwardRequest(c net.Conn) (int, error) {
	var line []byte
	var b [1]byte
	for {
		if _, err := c.Read(b[:]); err != nil {
			return 0, fmt.Errorf("reading the request: %w", err)
		}
		if b[0] == '\n' {
			break
		}
		if len(line) == agentpb.MaxForwardLine {
			return 0, fmt.Errorf("request longer than %d bytes", agentpb.MaxForwardLine)
		}
		line = append(line, b[0])
	}
	return ParseForwardRequest(string(line))
}

// ParseForwardRequest parses a forwarded connection's request line (its
// "\n" cut off): "TCP <port>", port 1 to 65535 in decimal.
func ParseForwardRequest(line string) (int, error) {
	rest, ok := strings.CutPrefix(strings.TrimSuffix(line, "\r"), "TCP ")
	if !ok {
		return 0, fmt.Errorf("bad request %q: want \"TCP <port>\"", truncate(line))
	}
	p, err := strconv.Atoi(rest)
	if err != nil || p < 1 || p > 65535 || strconv.Itoa(p) != rest {
		return 0, fmt.Errorf("bad port %q in the request: want 1 to 65535", truncate(rest))
	}
	return p, nil
}

// dialLoopback connects to port on 127.0.0.1, then on ::1 (a server that
// listens on IPv6's loopback only).
func dialLoopback(ctx context.Context, port int) (net.Conn, error) {
	d := net.Dialer{Timeout: agentpb.ForwardDialTimeout}
	p := strconv.Itoa(port)
	c, err := d.DialContext(ctx, "tcp4", net.JoinHostPort("127.0.0.1", p))
	if err == nil {
		return c, nil
	}
	if c6, err6 := d.DialContext(ctx, "tcp6", net.JoinHostPort("::1", p)); err6 == nil {
		return c6, nil
	}
	if errors.Is(err, syscall.ECONNREFUSED) {
		return nil, fmt.Errorf("nothing listens on port %d in the guest (connection refused)", port)
	}
	return nil, fmt.Errorf("connecting to port %d in the guest: %w", port, err)
}

// splice copies src to dst until src ends, then half-closes dst (or
// closes it, when it cannot be half-closed) and src's reading side.
func splice(dst, src net.Conn) {
	io.Copy(dst, src)
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		if cw.CloseWrite() == nil {
			if cr, ok := src.(interface{ CloseRead() error }); ok {
				cr.CloseRead()
			}
			return
		}
	}
	dst.Close()
}

// oneLine makes s fit a reply line.
func oneLine(s string) string {
	s = strings.ReplaceAll(s, "\n", " ")
	if len(s) > agentpb.MaxForwardLine-len("ERR \n") {
		s = s[:agentpb.MaxForwardLine-len("ERR \n")]
	}
	return s
}

// truncate shortens what quotes a peer's bytes.
func truncate(s string) string {
	if len(s) > 32 {
		return s[:32] + "…"
	}
	return s
}
