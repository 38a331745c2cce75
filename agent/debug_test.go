package agent

import (
	"context"
	"log/slog"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"

	"github.com/csiagent/csiagent/internal/optrace"
)

// trailerStream is the server side of a call, as far as SetTrailer needs.
type trailerStream struct {
	grpc.ServerTransportStream
	trailer metadata.MD
}

func (s *trailerStream) Method() string { return "/csiagent.agent.v1.Agent/Prepare" }

func (s *trailerStream) SetTrailer(md metadata.MD) error {
	s.trailer = metadata.Join(s.trailer, md)
	return nil
}

// TestTraceInterceptor: with TraceCalls, a call that sends TraceHeader
// runs with a trace and gets its table in TraceTrailer; a call that does
// not, or an agent without TraceCalls, runs untraced and gets nothing.
func TestTraceInterceptor(t *testing.T) {
	info := &grpc.UnaryServerInfo{FullMethod: "/csiagent.agent.v1.Agent/Prepare"}
	handler := func(ctx context.Context, _ any) (any, error) {
		optrace.Begin(ctx, optrace.Plugin, "NodeStageVolume")()
		return optrace.From(ctx) != nil, nil
	}
	for _, c := range []struct {
		name             string
		on, asks, traced bool
	}{
		{"asked", true, true, true},
		{"not asked", true, false, false},
		{"off", false, true, false},
	} {
		a := &Agent{cfg: Config{TraceCalls: c.on}, log: slog.New(slog.DiscardHandler)}
		st := &trailerStream{}
		ctx := grpc.NewContextWithServerTransportStream(context.Background(), st)
		if c.asks {
			ctx = metadata.NewIncomingContext(ctx, metadata.Pairs(TraceHeader, "1"))
		}
		got, err := a.traceInterceptor(ctx, nil, info, handler)
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if got.(bool) != c.traced {
			t.Errorf("%s: handler traced %v, want %v", c.name, got, c.traced)
		}
		table := st.trailer.Get(TraceTrailer)
		switch {
		case c.traced && (len(table) != 1 || !strings.Contains(table[0], "NodeStageVolume") || !strings.HasPrefix(table[0], info.FullMethod)):
			t.Errorf("%s: trailer %v, want the method and its trace", c.name, st.trailer)
		case !c.traced && len(table) != 0:
			t.Errorf("%s: trailer %v, want none", c.name, st.trailer)
		}
	}
}
