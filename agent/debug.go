package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
)

// startDebug serves net/http/pprof on DebugAddress, when set, so that
// operators can profile the daemon in place. Off by default.
func (a *Agent) startDebug(context.Context) (stop func(), err error) {
	if a.cfg.DebugAddress == "" {
		return func() {}, nil
	}
	lis, err := net.Listen("tcp", a.cfg.DebugAddress)
	if err != nil {
		return nil, fmt.Errorf("--debug-address %s: %w", a.cfg.DebugAddress, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	// No write timeout: CPU profiles and traces stream for their duration.
	srv := &http.Server{
		Handler:           mux,
		ReadHeaderTimeout: metricsReadHeaderTimeout,
		IdleTimeout:       metricsIdleTimeout,
		MaxHeaderBytes:    16 << 10,
		ErrorLog:          slog.NewLogLogger(a.log.Handler(), slog.LevelError),
	}
	a.log.Info("serving pprof", "address", "http://"+lis.Addr().String()+"/debug/pprof/")
	return a.serveHTTP(srv, lis, "debug"), nil
}

// serveHTTP serves srv on lis in the background; a serving error after
// start is logged, not fatal (it must not take volumes down). The stop it
// returns shuts the server down within the shutdown timeout.
func (a *Agent) serveHTTP(srv *http.Server, lis net.Listener, what string) (stop func()) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(lis); !errors.Is(err, http.ErrServerClosed) {
			a.log.Error(what+" server stopped; the agent goes on without it", "address", lis.Addr().String(), "error", err)
		}
	}()
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), a.cfg.ShutdownTimeout)
		defer cancel()
		if err := srv.Shutdown(ctx); err != nil {
			srv.Close()
		}
		<-done
	}
}
