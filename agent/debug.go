package agent

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/csiagent/csiagent/internal/optrace"
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

// The metadata of a traced API call (Config.TraceCalls): the caller sends
// TraceHeader (any value) and gets the trace's table (optrace.Trace's
// String) in the trailer TraceTrailer (binary metadata: the table has
// line breaks).
const (
	TraceHeader  = "csiagent-trace"
	TraceTrailer = "csiagent-trace-bin"
)

// traceInterceptor, with Config.TraceCalls, runs a unary call that asks
// for it (TraceHeader) with a trace in its context and sends the trace's
// table back in TraceTrailer. It is the innermost interceptor: the trace
// covers the handler, after the access check.
func (a *Agent) traceInterceptor(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if !a.cfg.TraceCalls {
		return handler(ctx, req)
	}
	if md, _ := metadata.FromIncomingContext(ctx); len(md.Get(TraceHeader)) == 0 {
		return handler(ctx, req)
	}
	ctx, tr := optrace.With(ctx)
	resp, err := handler(ctx, req)
	tr.Finish()
	if serr := grpc.SetTrailer(ctx, metadata.Pairs(TraceTrailer, info.FullMethod+"\n"+tr.String())); serr != nil {
		a.log.Warn("sending a call's trace", "method", info.FullMethod, "error", serr)
	}
	return resp, err
}
