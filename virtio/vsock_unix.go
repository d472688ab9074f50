package virtio

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"strconv"
	"strings"
	"time"
)

// Host side limits.
const (
	// vsockFirstLocalPort is the first host port given to host-initiated
	// connections (Firecracker's convention).
	vsockFirstLocalPort = 1 << 30
	// vsockConnectTimeout bounds how long a host-initiated connection waits
	// for the guest's answer, and a guest-initiated one for the host
	// listener.
	vsockConnectTimeout = 10 * time.Second
	// vsockMaxConnectLine bounds the host's "CONNECT <port>\n" line.
	vsockMaxConnectLine = 32
)

// acceptLoop serves the host socket until it is closed.
func (v *Vsock) acceptLoop() {
	defer close(v.acceptDone)
	for {
		uc, err := v.ln.AcceptUnix()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				v.log.Error("accepting host connection", "err", err)
			}
			return
		}
		v.mu.Lock()
		if v.closed {
			v.mu.Unlock()
			uc.Close()
			return
		}
		v.pending[uc] = true
		v.mu.Unlock()
		go v.hostConnect(uc)
	}
}

// hostConnect reads a host connection's CONNECT line and starts the
// connection to the guest.
func (v *Vsock) hostConnect(uc *net.UnixConn) {
	port, err := readConnectLine(uc)
	v.mu.Lock()
	delete(v.pending, uc)
	if err != nil {
		v.mu.Unlock()
		v.log.Warn("host connection", "err", err)
		uc.Close()
		return
	}
	if v.closed || !v.active || len(v.conns) >= vsockMaxConns {
		active, n := v.active, len(v.conns)
		v.mu.Unlock()
		// Before the guest's driver is up this is routine (a client
		// waiting for the guest to boot retries): only a full table is
		// worth a warning.
		level := slog.LevelDebug
		if n >= vsockMaxConns {
			level = slog.LevelWarn
		}
		v.log.Log(context.Background(), level, "host connection refused", "port", port, "active", active, "conns", n)
		uc.Close()
		return
	}
	local := v.allocPortLocked()
	c := v.newConnLocked(vsockKey{local: local, peer: port}, uc, vsockConnecting)
	c.okLine = fmt.Appendf(nil, "OK %d\n", local)
	c.wantRequest = true
	c.connectTimeout = time.AfterFunc(vsockConnectTimeout, func() {
		v.mu.Lock()
		defer v.mu.Unlock()
		if !c.gone && c.state == vsockConnecting {
			v.log.Warn("guest did not answer a connection request", "port", port)
			v.resetLocked(c)
		}
	})
	v.scheduleLocked(c)
	v.mu.Unlock()
	v.hostReader(c)
}

// readConnectLine reads "CONNECT <port>\n" byte by byte (so nothing after
// it is consumed) within vsockConnectTimeout.
func readConnectLine(uc *net.UnixConn) (uint32, error) {
	uc.SetReadDeadline(time.Now().Add(vsockConnectTimeout))
	defer uc.SetReadDeadline(time.Time{})
	var line []byte
	b := make([]byte, 1)
	for {
		if _, err := io.ReadFull(uc, b); err != nil {
			return 0, fmt.Errorf("reading CONNECT line: %w", err)
		}
		if b[0] == '\n' {
			break
		}
		line = append(line, b[0])
		if len(line) > vsockMaxConnectLine {
			return 0, fmt.Errorf("CONNECT line longer than %d bytes", vsockMaxConnectLine)
		}
	}
	return parseConnectLine(string(line))
}

// parseConnectLine parses "CONNECT <port>" (without the newline; a
// trailing carriage return is accepted).
func parseConnectLine(line string) (uint32, error) {
	arg, ok := strings.CutPrefix(strings.TrimSuffix(line, "\r"), "CONNECT ")
	if !ok {
		return 0, fmt.Errorf("bad CONNECT line %q: want \"CONNECT <port>\"", line)
	}
	port, err := strconv.ParseUint(arg, 10, 32)
	if err != nil {
		return 0, fmt.Errorf("bad port in CONNECT line %q: %w", line, err)
	}
	return uint32(port), nil
}

// allocPortLocked returns a host port no connection uses.
func (v *Vsock) allocPortLocked() uint32 {
	for {
		p := v.nextPort
		v.nextPort++
		if v.nextPort < vsockFirstLocalPort {
			v.nextPort = vsockFirstLocalPort
		}
		used := false
		for k := range v.conns {
			if k.local == p {
				used = true
				break
			}
		}
		if !used {
			return p
		}
	}
}

// guestConnect dials Path_P (or has the device's dialer dial it) for a
// guest connection request.
func (v *Vsock) guestConnect(c *vsockConn) {
	uc, err := v.dialHost(c.key.local)
	v.mu.Lock()
	defer v.mu.Unlock()
	if err != nil {
		if !c.gone {
			v.log.Debug("guest connection refused", "port", c.key.local, "err", err)
			v.resetLocked(c)
		}
		return
	}
	if c.gone {
		uc.Close()
		return
	}
	c.host = uc
	c.wantResponse = true
	v.startRelayLocked(c, true)
}

// dialHost connects to the host listener of the host's port, within
// vsockConnectTimeout.
func (v *Vsock) dialHost(port uint32) (*net.UnixConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), vsockConnectTimeout)
	defer cancel()
	if v.dial != nil {
		uc, err := v.dial(ctx, port)
		if err == nil && uc == nil {
			err = errors.New("the dialer gave no connection")
		}
		return uc, err
	}
	var d net.Dialer
	nc, err := d.DialContext(ctx, "unix", fmt.Sprintf("%s_%d", v.path, port))
	if err != nil {
		return nil, err
	}
	return nc.(*net.UnixConn), nil
}
