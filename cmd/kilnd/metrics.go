package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"
)

// metricsService is a service that has Prometheus metrics to serve
// (*daemon.Server).
type metricsService interface {
	MetricsHandler() http.Handler
}

// metricsServer serves /metrics (and nothing else) on its own listener,
// apart from the API: a scraper needs no token and reaches no sandbox.
type metricsServer struct {
	ln  net.Listener
	srv *http.Server
	log *slog.Logger
}

// listenMetrics listens on addr (--metrics-listen) before kilnd takes its
// state over, so that a busy port fails the start at once.
func listenMetrics(addr string, log *slog.Logger) (*metricsServer, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("--metrics-listen %s: %w", addr, err)
	}
	if !loopback(addr) {
		log.Warn("kilnd: /metrics is served without authentication beyond loopback; it names templates and counts sandboxes", "metrics_listen", addr)
	}
	return &metricsServer{ln: ln, log: log}, nil
}

// start serves svc's metrics until stop.
func (m *metricsServer) start(svc service) error {
	ms, ok := svc.(metricsService)
	if !ok {
		return fmt.Errorf("--metrics-listen: this service (%T) has no metrics", svc)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", ms.MetricsHandler())
	m.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		if err := m.srv.Serve(m.ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			m.log.Error("kilnd: serving /metrics", "addr", m.ln.Addr().String(), "err", err)
		}
	}()
	m.log.Info("kilnd: serving /metrics", "addr", m.ln.Addr().String())
	return nil
}

// stop stops serving, waiting a little for scrapes in flight.
func (m *metricsServer) stop() {
	if m.srv == nil {
		m.ln.Close()
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	m.srv.Shutdown(ctx)
}
