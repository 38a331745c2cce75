package apiserver

import (
	"context"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/reclaim"
	"github.com/csiagent/csiagent/volumestats"
)

// Config is what the Agent service serves; the daemon fills every field.
type Config struct {
	Isolator *isolator.Isolator
	// ConfigDir is the plugin config directory (named in errors).
	ConfigDir string
	// Plugins reports the plugins' status, sorted by type, and the config
	// directory's refused files.
	Plugins func() ([]*agentv1.Plugin, []*pluginconfig.FileError)
	// Changed returns a channel closed at the next change of a plugin, a
	// volume or a container.
	Changed func() <-chan struct{}
	// Configured is closed once the config directory's first load is
	// applied (before, the plugin list would be empty, not true);
	// Stopping when shutdown begins (watch streams end).
	Configured, Stopping <-chan struct{}
	// OnVolumesChanged is called after every Prepare, Cleanup and
	// Reconcile (the schedules look at the published volumes again).
	OnVolumesChanged func()

	// Reclaimer and KeyRotator are the per-volume schedules;
	// ReclaimVolumes lists the volumes Reclaimer reclaims (published, of
	// plugins offering reclaim.NodeService).
	Reclaimer      *reclaim.Scheduler
	KeyRotator     Schedule
	ReclaimVolumes func() []pervolume.Volume
	// Stats is the volume stats poller; StatsVolumes the volumes it polls.
	Stats        *volumestats.Poller
	StatsVolumes func() []volumestats.Volume
	// Offers reports whether a plugin's ready instance answers a service
	// (a discovery name); ControllerConn waits for the plugin's controller
	// service and returns the connection serving it (status errors).
	Offers         func(plugin, service string) bool
	ControllerConn func(ctx context.Context, plugin, service string) (*grpc.ClientConn, error)
	// Named is the named volumes (and the engines' mounts of them).
	Named NamedVolumes
	// Members is what callers other than root (members of --api-group)
	// may do; root may do everything.
	Members Members
}

// Schedule is a per-volume schedule as ListVolumes sees it
// (pervolume.Scheduler).
type Schedule interface {
	// Next returns when the volume's next run is due; false if it is not
	// scheduled.
	Next(plugin, id string) (time.Time, bool)
}

// Server is the Agent gRPC service.
type Server struct {
	agentv1.UnimplementedAgentServer
	cfg Config
	iso *isolator.Isolator
}

var _ agentv1.AgentServer = (*Server)(nil)

// New makes the service; register it with agentv1.RegisterAgentServer.
func New(cfg Config) *Server {
	return &Server{cfg: cfg, iso: cfg.Isolator}
}

// ListPlugins answers once the config directory was first read.
func (s *Server) ListPlugins(ctx context.Context, _ *agentv1.ListPluginsRequest) (*agentv1.ListPluginsResponse, error) {
	select {
	case <-s.cfg.Configured:
		return s.list(), nil
	case <-ctx.Done():
		return nil, status.Errorf(codes.Unavailable, "the agent has not read its config directory yet: %v", ctx.Err())
	}
}

func (s *Server) list() *agentv1.ListPluginsResponse {
	plugins, errs := s.cfg.Plugins()
	resp := &agentv1.ListPluginsResponse{Plugins: plugins}
	for _, fe := range errs {
		resp.ConfigErrors = append(resp.ConfigErrors, &agentv1.ConfigError{File: fe.File, Error: fe.Err.Error()})
	}
	return resp
}

// WatchPlugins sends the plugin list now and after every change, until
// the caller leaves or the agent stops.
func (s *Server) WatchPlugins(_ *agentv1.ListPluginsRequest, stream grpc.ServerStreamingServer[agentv1.ListPluginsResponse]) error {
	for {
		changed := s.cfg.Changed()
		if err := stream.Send(s.list()); err != nil {
			return err
		}
		select {
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-s.cfg.Stopping:
			return status.Error(codes.Unavailable, "csi-agent is shutting down")
		case <-changed:
		}
	}
}

// GetPlugin reports one plugin.
func (s *Server) GetPlugin(_ context.Context, req *agentv1.GetPluginRequest) (*agentv1.GetPluginResponse, error) {
	if req.GetType() == "" {
		return nil, status.Error(codes.InvalidArgument, "type is required")
	}
	plugins, _ := s.cfg.Plugins()
	for _, p := range plugins {
		if p.Type == req.GetType() {
			return &agentv1.GetPluginResponse{Plugin: p}, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "no plugin of type %q in %s", req.GetType(), s.cfg.ConfigDir)
}
