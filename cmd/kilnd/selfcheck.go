package main

// kilnd's check of itself, over its own socket: what READY=1 waits for
// and what each of systemd's watchdog pings needs.

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"time"

	sddaemon "github.com/coreos/go-systemd/v22/daemon"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"

	"github.com/kilnvm/kiln/daemon/kilnpb"
)

// selfClient calls kilnd's own API as a client would.
type selfClient struct {
	conn  *grpc.ClientConn
	addr  string // for logs
	token string // sent on TCP; "" on a Unix socket
}

// dialSelf makes a client of kilnd's first Unix listener, else of its
// first TCP one (with the bearer token). Nothing is dialled until a call.
func dialSelf(lns []net.Listener, a auth) (*selfClient, error) {
	var pick net.Listener
	for _, ln := range lns {
		if ln.Addr().Network() == "unix" {
			pick = ln
			break
		}
	}
	if pick == nil {
		for _, ln := range lns {
			if ln.Addr().Network() == "tcp" {
				pick = ln
				break
			}
		}
	}
	if pick == nil {
		return nil, fmt.Errorf("no unix or tcp listener among %d to check", len(lns))
	}
	network, addr := pick.Addr().Network(), pick.Addr().String()
	sc := &selfClient{addr: network + ":" + addr}
	if network == "tcp" {
		addr = loopbackOf(pick.Addr())
		sc.token = string(a.token)
	}
	conn, err := grpc.NewClient("passthrough:///kilnd-self",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		// Reconnect soon: gRPC's default backoff (up to 2 minutes) would
		// outlast systemd's watchdog after one failed connection.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: 10 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
			MinConnectTimeout: time.Second,
		}),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		}))
	if err != nil {
		return nil, fmt.Errorf("a client of %s: %w", sc.addr, err)
	}
	sc.conn = conn
	return sc, nil
}

// loopbackOf is a TCP listener's address to dial: a wildcard host
// (0.0.0.0, ::) becomes the loopback address of its family.
func loopbackOf(a net.Addr) string {
	ta, ok := a.(*net.TCPAddr)
	if !ok || !ta.IP.IsUnspecified() {
		return a.String()
	}
	ip := net.IPv6loopback
	if ta.IP.To4() != nil {
		ip = net.IPv4(127, 0, 0, 1)
	}
	return net.JoinHostPort(ip.String(), fmt.Sprint(ta.Port))
}

func (c *selfClient) Close() error { return c.conn.Close() }

func (c *selfClient) callContext(ctx context.Context) context.Context {
	if c.token != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+c.token)
	}
	return ctx
}

// check is one health check of kiln.v1.Kiln within timeout.
func (c *selfClient) check(ctx context.Context, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(c.callContext(ctx), timeout)
	defer cancel()
	resp, err := healthpb.NewHealthClient(c.conn).Check(ctx, &healthpb.HealthCheckRequest{Service: "kiln.v1.Kiln"}, grpc.WaitForReady(true))
	if err != nil {
		return fmt.Errorf("health check over %s: %w", c.addr, err)
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		return fmt.Errorf("health check over %s: %s", c.addr, resp.GetStatus())
	}
	return nil
}

// readyCheckTimeout bounds each try of waitReady's.
const readyCheckTimeout = 2 * time.Second

// waitReady checks until a check passes (true) or ctx ends (false).
func (c *selfClient) waitReady(ctx context.Context, log *slog.Logger) bool {
	for tries := 1; ; tries++ {
		err := c.check(ctx, readyCheckTimeout)
		if err == nil {
			log.Debug("kilnd: the API answers on its own socket", "addr", c.addr, "tries", tries)
			return true
		}
		if tries == 1 {
			log.Debug("kilnd: the API does not answer yet", "err", err)
		}
		select {
		case <-ctx.Done():
			return false
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// status is the STATUS= line of a serving kilnd: how many sandboxes live.
func (c *selfClient) status(ctx context.Context) string {
	ctx, cancel := context.WithTimeout(c.callContext(ctx), readyCheckTimeout)
	defer cancel()
	resp, err := kilnpb.NewKilnClient(c.conn).ListSandboxes(ctx, &kilnpb.ListSandboxesRequest{})
	if err != nil {
		return "serving"
	}
	n := len(resp.GetSandboxes())
	if n == 1 {
		return "serving: 1 sandbox"
	}
	return fmt.Sprintf("serving: %d sandboxes", n)
}

// watchdog pings systemd's watchdog every interval/2 while a check within
// interval/2 passes, until ctx ends: a kilnd that stops answering stops
// pinging, and systemd kills and restarts it.
func (c *selfClient) watchdog(ctx context.Context, interval time.Duration, log *slog.Logger) {
	every := interval / 2
	t := time.NewTicker(every)
	defer t.Stop()
	failing := false
	for {
		if err := c.check(ctx, every); err != nil {
			if ctx.Err() != nil {
				return
			}
			if !failing {
				log.Warn("kilnd: the self-check fails; not pinging systemd's watchdog", "err", err)
				failing = true
			}
		} else {
			if failing {
				log.Info("kilnd: the self-check passes again; pinging systemd's watchdog")
				failing = false
			}
			notify(log, sddaemon.SdNotifyWatchdog)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}
