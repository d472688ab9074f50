package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	sddaemon "github.com/coreos/go-systemd/v22/daemon"
	"google.golang.org/grpc"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/reflection"
)

// service is what kilnd serves: *daemon.Server.
type service interface {
	Register(grpc.ServiceRegistrar)
	Close(context.Context) error
}

// shutdownGrace is how long a clean shutdown waits for calls in flight
// (execs, streams of events) before cutting them.
const shutdownGrace = 5 * time.Second

// serveOptions are serve's knobs from its environment.
type serveOptions struct {
	// watchdog is systemd's watchdog interval (WATCHDOG_USEC), 0 for none:
	// kilnd pings every half of it while its self-check passes.
	watchdog time.Duration
	// beforeStop, when set, is called once serving is to stop, before
	// the gRPC server stops (the E2B API, a client of it, stops first).
	beforeStop func(context.Context)
}

// serve serves svc, with the health and reflection services, on every
// listener until ctx ends, then stops: calls in flight get shutdownGrace,
// and svc is closed, which leaves its sandboxes running. It tells systemd
// READY=1 once the API answers on its own socket, pings systemd's watchdog
// while it keeps answering, and says STOPPING=1 when it stops.
func serve(ctx context.Context, lns []net.Listener, a auth, svc service, log *slog.Logger, opts serveOptions) error {
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(a.unary),
		grpc.ChainStreamInterceptor(a.stream),
	)
	svc.Register(srv)
	hs := health.NewServer()
	healthpb.RegisterHealthServer(srv, hs)
	reflection.Register(srv)
	hs.SetServingStatus("", healthpb.HealthCheckResponse_SERVING)
	hs.SetServingStatus("kiln.v1.Kiln", healthpb.HealthCheckResponse_SERVING)

	errc := make(chan error, len(lns))
	var wg sync.WaitGroup
	for _, ln := range lns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := srv.Serve(ln); err != nil && !errors.Is(err, grpc.ErrServerStopped) {
				errc <- fmt.Errorf("serving on %s: %w", ln.Addr(), err)
			}
		}()
		log.Info("kilnd: listening", "addr", ln.Addr().Network()+":"+ln.Addr().String())
	}

	// READY=1 once a call over kilnd's own socket is answered, and the
	// watchdog's pings while calls are.
	runCtx, stopRun := context.WithCancel(ctx)
	defer stopRun()
	var bg sync.WaitGroup
	self, err := dialSelf(lns, a)
	if err != nil {
		log.Error("kilnd: no self-check: systemd is told READY=1 unchecked and its watchdog is not pinged", "err", err)
		notify(log, sddaemon.SdNotifyReady+"\nSTATUS=serving (unchecked)")
	} else {
		defer self.Close()
		bg.Go(func() {
			if !self.waitReady(runCtx, log) {
				return
			}
			notify(log, sddaemon.SdNotifyReady+"\nSTATUS="+self.status(runCtx))
			if opts.watchdog > 0 {
				self.watchdog(runCtx, opts.watchdog, log)
			}
		})
	}

	var serr error
	select {
	case <-ctx.Done():
		log.Info("kilnd: stopping; sandboxes keep running")
	case serr = <-errc:
		log.Error("kilnd: stopping", "err", serr)
	}
	stopRun()
	bg.Wait()
	notify(log, sddaemon.SdNotifyStopping+"\nSTATUS=stopping; sandboxes keep running")
	if opts.beforeStop != nil {
		bctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
		opts.beforeStop(bctx)
		cancel()
	}
	hs.Shutdown()
	stopped := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(stopped)
	}()
	select {
	case <-stopped:
	case <-time.After(shutdownGrace):
		srv.Stop()
		<-stopped
	}
	wg.Wait()
	cctx, cancel := context.WithTimeout(context.Background(), shutdownGrace)
	defer cancel()
	if err := svc.Close(cctx); err != nil {
		return errors.Join(serr, fmt.Errorf("closing the daemon: %w", err))
	}
	return serr
}

// notify sends state to systemd (NOTIFY_SOCKET); without systemd it does
// nothing.
func notify(log *slog.Logger, state string) {
	if ok, err := sddaemon.SdNotify(false, state); err != nil {
		log.Warn("kilnd: telling systemd", "state", state, "err", err)
	} else if ok {
		log.Debug("kilnd: told systemd", "state", state)
	}
}
