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

// serve serves svc, with the health and reflection services, on every
// listener until ctx ends, then stops: calls in flight get shutdownGrace,
// and svc is closed, which leaves its sandboxes running. It tells systemd
// READY=1 once it serves and STOPPING=1 when it stops.
func serve(ctx context.Context, lns []net.Listener, a auth, svc service, log *slog.Logger) error {
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
	if ok, err := sddaemon.SdNotify(false, sddaemon.SdNotifyReady); err != nil {
		log.Warn("kilnd: telling systemd it is ready", "err", err)
	} else if ok {
		log.Debug("kilnd: told systemd READY=1")
	}

	var serr error
	select {
	case <-ctx.Done():
		log.Info("kilnd: stopping; sandboxes keep running")
	case serr = <-errc:
		log.Error("kilnd: stopping", "err", serr)
	}
	sddaemon.SdNotify(false, sddaemon.SdNotifyStopping)
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
