package main

// kiln sandbox port-forward: local TCP ports carried to ports of a
// sandbox's loopback (kiln.v1 ForwardPort, through the guest's agent), as
// kubectl port-forward does for a pod's.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strconv"
	"strings"
	"sync"

	"github.com/spf13/cobra"

	kilnclient "github.com/kilnvm/kiln/daemon/client"
)

// portSpec is one port-forward argument: where to listen on this host
// and the sandbox's port that each accepted connection reaches.
type portSpec struct {
	addr      string // host or IP to listen on (no brackets)
	localPort int    // 0: a free port
	port      int    // in the sandbox, 1 to 65535
}

// listenAddr is where the spec listens, for net.Listen.
func (s portSpec) listenAddr() string {
	return net.JoinHostPort(s.addr, strconv.Itoa(s.localPort))
}

// parsePortSpec parses [ADDR:]LOCALPORT:PORT, or PORT alone (the same
// port here). ADDR defaults to 127.0.0.1 and is an IPv6 address in
// brackets ([::1]:8080:80); an empty LOCALPORT (":80") is 0, a free one.
func parsePortSpec(s string) (portSpec, error) {
	spec := portSpec{addr: "127.0.0.1"}
	bad := func(format string, args ...any) (portSpec, error) {
		return portSpec{}, fmt.Errorf("port %q: %s; want [ADDR:]LOCALPORT:PORT or PORT", s, fmt.Sprintf(format, args...))
	}
	rest, portStr := "", s
	if i := strings.LastIndexByte(s, ':'); i >= 0 {
		rest, portStr = s[:i], s[i+1:]
	}
	port, ok := parsePortNumber(portStr)
	if !ok || port == 0 {
		return bad("the sandbox's port %q is not 1 to 65535", portStr)
	}
	spec.port = port
	if !strings.Contains(s, ":") {
		spec.localPort = port
		return spec, nil
	}
	localStr := rest
	if i := strings.LastIndexByte(rest, ':'); i >= 0 {
		addr := rest[:i]
		localStr = rest[i+1:]
		switch {
		case strings.HasPrefix(addr, "[") && strings.HasSuffix(addr, "]"):
			addr = addr[1 : len(addr)-1]
			if ip, err := netip.ParseAddr(addr); err != nil || !ip.Is6() {
				return bad("only an IPv6 address goes in brackets, not %q", addr)
			}
		case strings.ContainsAny(addr, ":[]"):
			return bad("an IPv6 address goes in brackets, as [::1]:8080:80")
		case addr == "" || strings.Trim(addr, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.-_") != "":
			return bad("the address %q is not a host name or IP address", addr)
		}
		spec.addr = addr
	}
	if localStr != "" {
		lp, ok := parsePortNumber(localStr)
		if !ok {
			return bad("the local port %q is not 0 to 65535", localStr)
		}
		spec.localPort = lp
	}
	return spec, nil
}

// parsePortNumber parses a port number, decimal digits only: 0 to 65535.
func parsePortNumber(s string) (int, bool) {
	if s == "" || len(s) > 5 || strings.Trim(s, "0123456789") != "" {
		return 0, false
	}
	n, err := strconv.Atoi(s)
	return n, err == nil && n <= 65535
}

func (a *cli) portForwardCmd() *cobra.Command {
	var specs []portSpec
	return &cobra.Command{
		Use:   "port-forward ID [ADDR:]LOCALPORT:PORT...",
		Short: "forward local TCP ports to ports of a sandbox's loopback, until interrupted",
		Long: `Listen on local TCP ports and carry each connection to a TCP port of the
sandbox's loopback, through its agent (not its network, which stays as its
egress policy says). PORT alone listens on the same port; LOCALPORT 0 (or
empty, as in :PORT) picks a free one. ADDR defaults to 127.0.0.1; an IPv6
address goes in brackets ([::1]:8080:80). Each listener prints
"forwarding ADDR:LOCALPORT -> ID:PORT"; a connection that the sandbox
refuses (nothing listens there) is reported and the others go on.
Ctrl-C stops.`,
		Example:           "  kiln sandbox port-forward $id 8080:80\n  kiln sandbox port-forward $id 0:8888 3000",
		Args:              args(cobra.MinimumNArgs(2)),
		ValidArgsFunction: a.completeSandboxes,
		PreRunE: func(_ *cobra.Command, argv []string) error {
			specs = specs[:0]
			for _, s := range argv[1:] {
				spec, err := parsePortSpec(s)
				if err != nil {
					return usagef("sandbox port-forward: %v", err)
				}
				specs = append(specs, spec)
			}
			return nil
		},
		RunE: a.call(func(ctx context.Context, c *kilnclient.Client, argv []string) error {
			id := argv[0]
			// A mistyped ID fails now, not on the first connection.
			if _, err := c.GetSandbox(ctx, id); err != nil {
				return err
			}
			var lns []net.Listener
			defer func() {
				for _, ln := range lns {
					ln.Close()
				}
			}()
			var lc net.ListenConfig
			for _, s := range specs {
				ln, err := lc.Listen(ctx, "tcp", s.listenAddr())
				if err != nil {
					return fmt.Errorf("sandbox port-forward: %w", err)
				}
				lns = append(lns, ln)
			}
			var mu sync.Mutex // over stdout and stderr
			report := func(err error) {
				mu.Lock()
				defer mu.Unlock()
				a.printErr(err)
			}
			var wg sync.WaitGroup
			for i, ln := range lns {
				port := specs[i].port
				mu.Lock()
				fmt.Fprintf(a.stdout, "forwarding %s -> %s:%d\n", ln.Addr(), id, port)
				mu.Unlock()
				wg.Go(func() {
					dial := func(ctx context.Context) (net.Conn, error) { return c.DialPort(ctx, id, port) }
					if err := forwardPorts(ctx, ln, dial, report); err != nil {
						report(err)
					}
				})
			}
			wg.Wait()
			return nil
		}),
	}
}

// forwardPorts accepts connections on ln until ctx ends (then it closes
// ln, ends the connections it carries and returns nil) or accepting
// fails. Each connection is carried to one that dial makes, both ways; a
// failed dial is reported and the connection closed.
func forwardPorts(ctx context.Context, ln net.Listener, dial func(context.Context) (net.Conn, error), report func(error)) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		local, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return fmt.Errorf("sandbox port-forward: accepting on %s: %w", ln.Addr(), err)
		}
		wg.Go(func() {
			defer local.Close()
			remote, err := dial(ctx)
			if err != nil {
				if ctx.Err() == nil {
					report(err)
				}
				return
			}
			defer remote.Close()
			if err := carry(ctx, local, remote); err != nil && ctx.Err() == nil {
				report(err)
			}
		})
	}
}

// carry copies local to remote and remote to local until both
// directions have ended or ctx ends. A side that ends (EOF) half-closes
// the other (CloseWrite), so that a request-then-answer protocol works
// through it. The first failure either way ends both. carry returns it
// when it is the remote side's (the call failed: the sandbox stopped,
// say), not when it is the local client's (which went away).
func carry(ctx context.Context, local, remote net.Conn) error {
	var (
		mu    sync.Mutex
		ended bool
		first error
	)
	end := func(err error) {
		mu.Lock()
		defer mu.Unlock()
		if ended {
			return // this side's failure is the other's closing
		}
		ended, first = true, err
		local.Close()
		remote.Close()
	}
	stop := context.AfterFunc(ctx, func() { end(nil) })
	defer stop()
	var wg sync.WaitGroup
	wg.Go(func() {
		if err := copyHalf(remote, local); err != nil {
			var re readError
			if errors.As(err, &re) {
				err = nil // reading the local client
			}
			end(err)
		}
	})
	if err := copyHalf(local, remote); err != nil {
		var re readError
		if errors.As(err, &re) {
			err = re.err
		} else {
			err = nil // writing to the local client
		}
		end(err)
	}
	wg.Wait()
	mu.Lock()
	defer mu.Unlock()
	return first
}

// readError marks a copy's failure as its source's.
type readError struct{ err error }

func (e readError) Error() string { return e.err.Error() }

// copyHalf copies src to dst until src's EOF, then half-closes dst (or
// closes it, if it cannot be half-closed). A failure reading src is a
// readError.
func copyHalf(dst, src net.Conn) error {
	buf := make([]byte, 64<<10)
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			if _, err := dst.Write(buf[:n]); err != nil {
				return err
			}
		}
		if rerr == io.EOF {
			break
		}
		if rerr != nil {
			return readError{rerr}
		}
	}
	if cw, ok := dst.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return dst.Close()
}
