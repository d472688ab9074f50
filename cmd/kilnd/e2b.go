package main

// kilnd's E2B listener (--e2b-listen): package e2b's HTTP server, which
// reaches kilnd's own API in-process: a client of the same gRPC server
// over an in-memory listener (memListener), not a second implementation.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kilnvm/kiln/daemon/e2b"
	"github.com/kilnvm/kiln/daemon/kilnpb"
	"github.com/kilnvm/kiln/internal/ratelog"
)

// stringsFlag is a repeatable string flag; a config file gives it as an
// array of strings.
type stringsFlag struct{ p *[]string }

func (f *stringsFlag) String() string {
	if f.p == nil {
		return ""
	}
	return fmt.Sprintf("%d values", len(*f.p)) // never the values: they are keys
}

func (f *stringsFlag) Get() any { return append([]string{}, *f.p...) }

func (f *stringsFlag) Set(v string) error {
	*f.p = append(*f.p, v)
	return nil
}

// Defaults of the E2B listener's connection limits (--e2b-idle-timeout,
// --e2b-read-timeout, --e2b-write-timeout, --e2b-conns-per-client).
const (
	// defaultE2BIdleTimeout: a keep-alive connection with no request
	// under way is closed after this long.
	defaultE2BIdleTimeout = 60 * time.Second
	// defaultE2BReadTimeout: a control-plane request's headers and body
	// must arrive within this (envd's streams are not cut).
	defaultE2BReadTimeout = 30 * time.Second
	// defaultE2BWriteTimeout: a control-plane request must be answered
	// within this of its start: a create or a fork waits on boots and
	// restores, so it is long.
	defaultE2BWriteTimeout = 5 * time.Minute
	// defaultE2BConnsPerAddr: the most connections one client address
	// holds open at once; more are closed as they are accepted.
	defaultE2BConnsPerAddr = 128
	// e2bHeaderTimeout: every request's headers must arrive within this
	// (and within the read timeout on the control plane).
	e2bHeaderTimeout = 30 * time.Second
)

// addE2BFlags adds the E2B listener's flags to fs.
func addE2BFlags(fs *flag.FlagSet, cfg *config) {
	fs.Var(&hostPortValue{p: &cfg.e2bListen}, "e2b-listen", "`HOST:PORT` to serve E2B's API on, its control plane and envd (\"\": off); needs API keys")
	fs.StringVar(&cfg.e2bKeysFile, "e2b-api-keys", "", "`FILE` of E2B API keys, one \"KEY TENANT\" a line (# comments); re-read when it changes and on SIGHUP")
	fs.Var(&stringsFlag{p: &cfg.e2bKeys}, "e2b-api-key", "an E2B API key and its tenant, `'KEY TENANT'` (repeatable)")
	fs.DurationVar(&cfg.e2bTimeout, "e2b-default-timeout", 15*time.Second, "lifetime of an E2B sandbox whose create names no timeout (E2B's API gives 15s)")
	fs.StringVar(&cfg.e2bDomain, "e2b-domain", "", "`DOMAIN` the E2B API returns as sandboxes' domain, for PORT-ID.DOMAIN host names (\"\": none)")
	fs.DurationVar(&cfg.e2bIdleTimeout, "e2b-idle-timeout", defaultE2BIdleTimeout, "close an E2B API keep-alive connection idle this long")
	fs.DurationVar(&cfg.e2bReadTimeout, "e2b-read-timeout", defaultE2BReadTimeout, "most time a control-plane request's headers and body may take to arrive (envd's streams and file transfers are not cut)")
	fs.DurationVar(&cfg.e2bWriteTimeout, "e2b-write-timeout", defaultE2BWriteTimeout, "most time from a control-plane request to its reply written (envd's streams and file transfers are not cut)")
	cfg.e2bConnsPerAddr = defaultE2BConnsPerAddr
	fs.Var(&boundedUintValue{p: &cfg.e2bConnsPerAddr, min: 0, max: math.MaxInt32}, "e2b-conns-per-client", "most E2B API connections one client address holds open, `N` (0: no limit; behind a proxy every client has its address)")
	for _, q := range []struct {
		name, usage string
		p           *uint64
	}{
		{"e2b-tenant-sandboxes", "most live (running or paused) sandboxes, `N`, of each E2B tenant whose keys line sets none (0: no limit)", &cfg.e2bTenantDefault.Sandboxes},
		{"e2b-tenant-memory", "most guest memory in `MiB` of each E2B tenant's running sandboxes (0: no limit)", &cfg.e2bTenantDefault.MemoryMiB},
		{"e2b-tenant-hibernated", "most `MiB` each E2B tenant's paused sandboxes' state may take on disk, each counted as its memory and disk cap (0: no limit)", &cfg.e2bTenantDefault.HibernatedMiB},
		{"e2b-tenant-snapshots", "most snapshots, `N`, each E2B tenant keeps (0: no limit)", &cfg.e2bTenantDefault.Snapshots},
	} {
		fs.Var(&boundedUintValue{p: q.p, min: 0, max: e2b.MaxQuotaValue}, q.name, q.usage)
	}
}

// checkE2BConfig is parseFlags' check of the E2B flags.
func checkE2BConfig(cfg config) error {
	if cfg.e2bListen == "" {
		return nil
	}
	if cfg.e2bKeysFile == "" && len(cfg.e2bKeys) == 0 {
		return errors.New("--e2b-listen needs API keys: give --e2b-api-keys FILE or --e2b-api-key 'KEY TENANT'")
	}
	if cfg.e2bTimeout <= 0 {
		return fmt.Errorf("--e2b-default-timeout %v: want a positive duration", cfg.e2bTimeout)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"--e2b-idle-timeout", cfg.e2bIdleTimeout}, {"--e2b-read-timeout", cfg.e2bReadTimeout}, {"--e2b-write-timeout", cfg.e2bWriteTimeout}} {
		if d.v <= 0 {
			return fmt.Errorf("%s %v: want a positive duration", d.name, d.v)
		}
	}
	if strings.ContainsAny(cfg.e2bDomain, "/: \t") {
		return fmt.Errorf("--e2b-domain %q: want a host name", cfg.e2bDomain)
	}
	return nil
}

// e2bListener is the E2B API's listener and keys, made before kilnd
// takes its state folder over (a bad key or a busy port stops it first).
type e2bListener struct {
	ln   net.Listener
	keys *e2b.Keys
	mem  *memListener
}

func listenE2B(cfg config, log *slog.Logger) (*e2bListener, error) {
	keys, err := e2b.LoadKeys(cfg.e2bKeysFile, cfg.e2bKeys, cfg.e2bTenantDefault)
	if err != nil {
		return nil, err
	}
	if keys.Len() == 0 {
		return nil, fmt.Errorf("--e2b-listen: no API keys in %s", cfg.e2bKeysFile)
	}
	warnPythonSDKKeys(log, keys)
	ln, err := net.Listen("tcp", cfg.e2bListen)
	if err != nil {
		return nil, fmt.Errorf("--e2b-listen: %w", err)
	}
	if !loopback(cfg.e2bListen) {
		log.Warn("kilnd: the E2B API is plain HTTP: API keys and access tokens cross the network in the clear; prefer loopback behind a TLS proxy", "e2b-listen", cfg.e2bListen)
	}
	return &e2bListener{ln: newConnLimiter(ln, int(cfg.e2bConnsPerAddr), log), keys: keys, mem: newMemListener()}, nil
}

// warnPythonSDKKeys names (by file and line, never by value) the keys
// whose format E2B's Python SDK refuses before it sends them.
func warnPythonSDKKeys(log *slog.Logger, keys *e2b.Keys) {
	for _, where := range keys.PythonSDKRefuses() {
		log.Warn(`kilnd: E2B's Python SDK refuses this API key before sending it: it wants "e2b_" and lowercase hex (its clients need E2B_VALIDATE_API_KEY=false); the npm SDK takes it`, "key", where)
	}
}

// start serves the E2B API on l until stop is called.
func (l *e2bListener) start(cfg config, log *slog.Logger) (stop func(context.Context), err error) {
	conn, err := grpc.NewClient("passthrough:///kilnd-in-process",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) { return l.mem.dial(ctx) }))
	if err != nil {
		return nil, fmt.Errorf("the E2B API's client of kilnd: %w", err)
	}
	hc := healthpb.NewHealthClient(conn)
	srv, err := e2b.New(e2b.Config{
		Kiln:     kilnpb.NewKilnClient(conn),
		Keys:     l.keys,
		StateDir: filepath.Join(cfg.stateDir, "e2b"),
		Domain:   cfg.e2bDomain,
		Logger:   log,
		// The lifetime of a create that names none.
		DefaultTimeout: cfg.e2bTimeout,
		// The control plane's deadlines (envd's are its own: streams).
		ReadTimeout:  cfg.e2bReadTimeout,
		WriteTimeout: cfg.e2bWriteTimeout,
		Health: func(ctx context.Context) error {
			r, err := hc.Check(ctx, &healthpb.HealthCheckRequest{Service: "kiln.v1.Kiln"})
			if err == nil && r.GetStatus() != healthpb.HealthCheckResponse_SERVING {
				err = fmt.Errorf("kiln.v1 is %s", r.GetStatus())
			}
			return err
		},
	})
	if err != nil {
		conn.Close()
		return nil, err
	}
	// No server-wide ReadTimeout or WriteTimeout: they would cut envd's
	// streams (process output, file transfers); the control plane sets
	// its own per request (e2b.Config).
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: e2bHeaderTimeout, IdleTimeout: cfg.e2bIdleTimeout,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := hs.Serve(l.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("kilnd: the E2B API stopped", "err", err)
		}
	}()
	log.Info("kilnd: serving the E2B API", "addr", l.ln.Addr().String(), "keys", l.keys.Len())
	// SIGHUP re-reads the keys file.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	hupDone := make(chan struct{})
	go func() {
		for {
			select {
			case <-hup:
				if err := srv.ReloadKeys(); err != nil {
					log.Error("kilnd: re-reading the E2B API keys; the keys read before still hold", "err", err)
				} else {
					log.Info("kilnd: re-read the E2B API keys", "keys", l.keys.Len())
					warnPythonSDKKeys(log, l.keys)
				}
			case <-hupDone:
				return
			}
		}
	}()
	return func(ctx context.Context) {
		signal.Stop(hup)
		close(hupDone)
		if err := hs.Shutdown(ctx); err != nil {
			hs.Close()
		}
		<-done
		conn.Close()
	}, nil
}

// memListener is a listener whose connections are in-memory pipes that
// its dial makes: kilnd's gRPC server serves it as any listener, and the
// E2B API is its client.
type memListener struct {
	conns chan net.Conn
	done  chan struct{}
	once  sync.Once
}

func newMemListener() *memListener {
	return &memListener{conns: make(chan net.Conn), done: make(chan struct{})}
}

func (l *memListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.done:
		return nil, net.ErrClosed
	}
}

func (l *memListener) Close() error {
	l.once.Do(func() { close(l.done) })
	return nil
}

func (l *memListener) Addr() net.Addr { return memAddr{} }

func (l *memListener) dial(ctx context.Context) (net.Conn, error) {
	client, server := net.Pipe()
	select {
	case l.conns <- memConn{server}:
		return client, nil
	case <-l.done:
	case <-ctx.Done():
	}
	client.Close()
	server.Close()
	if ctx.Err() != nil {
		return nil, ctx.Err()
	}
	return nil, net.ErrClosed
}

// memConn is the server's end of a memListener's pipe: its peer is
// memAddr, which kilnd's auth lets in.
type memConn struct{ net.Conn }

func (memConn) LocalAddr() net.Addr  { return memAddr{} }
func (memConn) RemoteAddr() net.Addr { return memAddr{} }

// memAddr is a memListener's address: callers over it are kilnd itself.
type memAddr struct{}

func (memAddr) Network() string { return "mem" }
func (memAddr) String() string  { return "kilnd-in-process" }

// connLimiter is a listener that lets each client address (the IP, any
// port) hold at most max connections open: one more is closed as soon as
// it is accepted, so an unauthenticated client cannot pin the server's
// goroutines and descriptors with connections it never uses.
type connLimiter struct {
	net.Listener
	max int // 0: no limit
	log *slog.Logger

	mu   sync.Mutex
	open map[string]int // by address
}

// newConnLimiter wraps ln; a client can cause its log line, so log is
// rate-limited (one line in 10 s, the rest counted).
func newConnLimiter(ln net.Listener, max int, log *slog.Logger) *connLimiter {
	log = ratelog.Wrap(log, ratelog.Options{Burst: 1, Interval: 10 * time.Second})
	return &connLimiter{Listener: ln, max: max, log: log, open: map[string]int{}}
}

func (l *connLimiter) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil || l.max == 0 {
			return c, err
		}
		addr := c.RemoteAddr().String()
		if h, _, err := net.SplitHostPort(addr); err == nil {
			addr = h
		}
		l.mu.Lock()
		if l.open[addr] >= l.max {
			l.mu.Unlock()
			c.Close()
			l.log.Warn("kilnd: closed an E2B API connection: its client holds the most it may", "remote", addr, "max", l.max)
			continue
		}
		l.open[addr]++
		l.mu.Unlock()
		return &limitedConn{Conn: c, release: func() { l.release(addr) }}, nil
	}
}

func (l *connLimiter) release(addr string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.open[addr]--; l.open[addr] <= 0 {
		delete(l.open, addr)
	}
}

// limitedConn gives its slot back when it is first closed.
type limitedConn struct {
	net.Conn
	once    sync.Once
	release func()
}

func (c *limitedConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.release)
	return err
}
