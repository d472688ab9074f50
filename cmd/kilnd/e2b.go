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

// addE2BFlags adds the E2B listener's flags to fs.
func addE2BFlags(fs *flag.FlagSet, cfg *config) {
	fs.Var(&hostPortValue{p: &cfg.e2bListen}, "e2b-listen", "`HOST:PORT` to serve E2B's API on, its control plane and envd (\"\": off); needs API keys")
	fs.StringVar(&cfg.e2bKeysFile, "e2b-api-keys", "", "`FILE` of E2B API keys, one \"KEY TENANT\" a line (# comments); re-read when it changes and on SIGHUP")
	fs.Var(&stringsFlag{p: &cfg.e2bKeys}, "e2b-api-key", "an E2B API key and its tenant, `'KEY TENANT'` (repeatable)")
	fs.DurationVar(&cfg.e2bTimeout, "e2b-default-timeout", 15*time.Second, "lifetime of an E2B sandbox whose create names no timeout (E2B's API gives 15s)")
	fs.StringVar(&cfg.e2bDomain, "e2b-domain", "", "`DOMAIN` the E2B API returns as sandboxes' domain, for PORT-ID.DOMAIN host names (\"\": none)")
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
	keys, err := e2b.LoadKeys(cfg.e2bKeysFile, cfg.e2bKeys)
	if err != nil {
		return nil, err
	}
	if keys.Len() == 0 {
		return nil, fmt.Errorf("--e2b-listen: no API keys in %s", cfg.e2bKeysFile)
	}
	ln, err := net.Listen("tcp", cfg.e2bListen)
	if err != nil {
		return nil, fmt.Errorf("--e2b-listen: %w", err)
	}
	if !loopback(cfg.e2bListen) {
		log.Warn("kilnd: the E2B API is plain HTTP: API keys and access tokens cross the network in the clear; prefer loopback behind a TLS proxy", "e2b-listen", cfg.e2bListen)
	}
	return &e2bListener{ln: ln, keys: keys, mem: newMemListener()}, nil
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
	hs := &http.Server{Handler: srv.Handler(), ReadHeaderTimeout: 30 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
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
