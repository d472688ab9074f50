package client

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// maxReplyLine bounds the handshake reply ("OK 4294967295\n" is 14 bytes).
const maxReplyLine = 64

// VsockDialer returns a DialFunc that connects to a guest vsock port through
// the VM's host-side vsock Unix socket at udsPath, Firecracker-style: it
// writes "CONNECT <port>\n" and expects "OK <hostport>\n", after which the
// connection carries the guest's stream. The handshake is bounded by the
// context's deadline or, if none is earlier, by timeout.
func VsockDialer(udsPath string, port uint32, timeout time.Duration) DialFunc {
	return func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		conn, err := d.DialContext(ctx, "unix", udsPath)
		if err != nil {
			return nil, fmt.Errorf("client: vsock %s port %d: %w", udsPath, port, err)
		}
		if err := Handshake(ctx, conn, port, timeout); err != nil {
			conn.Close()
			return nil, fmt.Errorf("client: vsock %s: %w", udsPath, err)
		}
		return conn, nil
	}
}

// Handshake performs the CONNECT handshake on conn, a fresh connection to a
// host-side vsock Unix socket. It reads the reply byte by byte so that none of the guest's
// stream, which may follow at once, is consumed.
func Handshake(ctx context.Context, conn net.Conn, port uint32, timeout time.Duration) error {
	var deadline time.Time // zero: none
	if timeout > 0 {
		deadline = time.Now().Add(timeout)
	}
	if d, ok := ctx.Deadline(); ok && (deadline.IsZero() || d.Before(deadline)) {
		deadline = d
	}
	if err := conn.SetDeadline(deadline); err != nil {
		return fmt.Errorf("CONNECT %d: %w", port, err)
	}
	// Cancelling ctx interrupts the handshake.
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	if _, err := io.WriteString(conn, "CONNECT "+strconv.FormatUint(uint64(port), 10)+"\n"); err != nil {
		return fmt.Errorf("CONNECT %d: %w", port, ctxErr(ctx, err))
	}
	line, err := readLine(conn)
	if err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return fmt.Errorf("CONNECT %d: connection closed before a reply (got %q; is the guest listening on port %d?)", port, line, port)
		}
		return fmt.Errorf("CONNECT %d: reading the reply (got %q): %w", port, line, ctxErr(ctx, err))
	}
	if _, err := ParseConnectReply(line); err != nil {
		return fmt.Errorf("CONNECT %d: %w", port, err)
	}
	if !stop() {
		return fmt.Errorf("CONNECT %d: %w", port, ctx.Err())
	}
	if err := conn.SetDeadline(time.Time{}); err != nil {
		return fmt.Errorf("CONNECT %d: %w", port, err)
	}
	return nil
}

// ctxErr prefers ctx's error to err, which its cancellation caused.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return err
}

// readLine reads up to and including '\n', at most maxReplyLine bytes. On
// error it returns what it read so far.
func readLine(r io.Reader) (string, error) {
	var buf [maxReplyLine]byte
	var b [1]byte
	n := 0
	for {
		m, err := r.Read(b[:])
		if m == 1 {
			buf[n] = b[0]
			n++
			if b[0] == '\n' {
				return string(buf[:n]), nil
			}
			if n == len(buf) {
				return string(buf[:n]), fmt.Errorf("reply longer than %d bytes", maxReplyLine)
			}
			continue
		}
		if err == nil {
			continue
		}
		if err == io.EOF && n > 0 {
			err = io.ErrUnexpectedEOF
		}
		return string(buf[:n]), err
	}
}

// ParseConnectReply parses the reply to CONNECT: "OK <hostport>\n", where
// hostport is the decimal host-side port of the connection. Anything else
// is an error that quotes the reply.
func ParseConnectReply(line string) (hostPort uint32, err error) {
	body, ok := strings.CutSuffix(line, "\n")
	if !ok {
		return 0, fmt.Errorf("unterminated reply %q", line)
	}
	body = strings.TrimSuffix(body, "\r")
	rest, ok := strings.CutPrefix(body, "OK ")
	if !ok {
		return 0, fmt.Errorf("unexpected reply %q", line)
	}
	p, err := strconv.ParseUint(rest, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("unexpected reply %q: bad port", line)
	}
	return uint32(p), nil
}
