package apiserver

import (
	"context"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/reclaim"
	"github.com/csiagent/csiagent/volumestats"
)

// Core is the isolator as the handlers use it (*isolator.Isolator): the
// containers it prepared and the volumes it tracks.
type Core interface {
	// WaitRecovered waits for the first recovery pass, or ctx's end.
	WaitRecovered(ctx context.Context) error
	Prepare(ctx context.Context, req *statev1.PrepareRequest) ([]*statev1.ContainerMount, error)
	Cleanup(ctx context.Context, id string, force bool) error
	// CleanupIf is Cleanup of a container allow accepts once it is
	// locked (isolator.Isolator.CleanupIf).
	CleanupIf(ctx context.Context, id string, force bool, allow func(isolator.ContainerInfo) error) error
	// Reconcile cleans up the containers (of manager, "" any) not in live.
	Reconcile(ctx context.Context, live []string, manager string) isolator.ReconcileResult
	ListVolumes() []isolator.VolumeInfo
	ListContainers() []isolator.ContainerInfo
	// ReclaimOffline reclaims the space of a volume not published on this
	// host through client, its plugin's controller, retrying per policy;
	// the result is nil when no call was made.
	ReclaimOffline(ctx context.Context, client isolator.ReclaimController, plugin, id string, secrets, params map[string]string, policy retrypolicy.Policy) (*statev1.ReclaimResult, error)
}

// Plugins is the agent's plugin set as the handlers use it.
type Plugins interface {
	// Statuses reports the plugins' status, sorted by type, and the config
	// directory's refused files.
	Statuses() ([]*agentv1.Plugin, []*pluginconfig.FileError)
	// Changed returns a channel closed at the next change of a plugin, a
	// volume or a container.
	Changed() <-chan struct{}
	// Offers reports whether a plugin's ready instance answers a service
	// (a discovery name).
	Offers(plugin, service string) bool
	// ControllerConn waits for the plugin's controller service and returns
	// the connection serving service (status errors).
	ControllerConn(ctx context.Context, plugin, service string) (*grpc.ClientConn, error)
}

// Schedules is the per-volume schedules (reclaim, key rotation) as the
// handlers use them.
type Schedules interface {
	// NextReclaim and NextKeyRotation report when a volume's next
	// scheduled run is due; false if it is not scheduled.
	NextReclaim(plugin, id string) (time.Time, bool)
	NextKeyRotation(plugin, id string) (time.Time, bool)
	// Reclaimable lists the volumes the reclaim schedule reclaims
	// (published, of plugins offering reclaim.NodeService).
	Reclaimable() []pervolume.Volume
	// ReclaimNow reclaims vols now, calls progress once per volume (one
	// call at a time) and returns the totals when every volume is done or
	// ctx ends.
	ReclaimNow(ctx context.Context, vols []pervolume.Volume, progress func(pervolume.Volume, reclaim.Result, error)) reclaim.Summary
}

// Stats is the volume stats poller as the handlers use it.
type Stats interface {
	// Refresh polls the volumes it polls now and returns when all are done
	// or ctx ends.
	Refresh(ctx context.Context)
	// Get returns a volume's last result.
	Get(plugin, id string) (volumestats.Stats, bool)
}

// Config is what the Agent service serves; the daemon fills every field.
type Config struct {
	Core Core
	// ConfigDir is the plugin config directory (named in errors).
	ConfigDir string
	Plugins   Plugins
	// Configured is closed once the config directory's first load is
	// applied (before, the plugin list would be empty, not true);
	// Stopping when shutdown begins (watch streams end).
	Configured, Stopping <-chan struct{}
	// OnVolumesChanged is called after every Prepare, Cleanup and
	// Reconcile (the schedules look at the published volumes again).
	OnVolumesChanged func()
	Schedules        Schedules
	Stats            Stats
	// Named is the named volumes (and the engines' mounts of them).
	Named NamedVolumes
	// Members is what callers other than root (members of --api-group)
	// may do; root may do everything.
	Members Members
	// Cluster, when set (the agent joins a fleet), returns the fleet once
	// joined (nil before).
	Cluster func() Cluster
	// Fence runs a csi-addons FenceClusterNetwork (ClusterRelease fences
	// a dead node with it); nil: the agent cannot fence.
	Fence func(ctx context.Context, req *agentv1.FenceRequest) error
}

// Server is the Agent gRPC service.
type Server struct {
	agentv1.UnimplementedAgentServer
	cfg  Config
	core Core
}

var _ agentv1.AgentServer = (*Server)(nil)

// New makes the service; register it with agentv1.RegisterAgentServer.
func New(cfg Config) *Server {
	return &Server{cfg: cfg, core: cfg.Core}
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
	plugins, errs := s.cfg.Plugins.Statuses()
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
		changed := s.cfg.Plugins.Changed()
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
func (s *Server) GetPlugin(ctx context.Context, req *agentv1.GetPluginRequest) (*agentv1.GetPluginResponse, error) {
	if req.GetType() == "" {
		return nil, status.Error(codes.InvalidArgument, "type is required")
	}
	plugins, _ := s.cfg.Plugins.Statuses()
	for _, p := range plugins {
		if p.Type == req.GetType() {
			if offersCapacity(p) {
				p = proto.CloneOf(p) // the status is not ours to change
				p.Capacity = s.capacity(ctx, p.Type)
			}
			return &agentv1.GetPluginResponse{Plugin: p}, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "no plugin of type %q in %s", req.GetType(), s.cfg.ConfigDir)
}

// capacityTimeout bounds GetPlugin's GetCapacity call, waiting for the
// controller included.
const capacityTimeout = 5 * time.Second

// csiController is the discovery name of CSI's controller service.
const csiController = "csi.v1.Controller"

// offersCapacity reports whether an instance of p says GET_CAPACITY.
func offersCapacity(p *agentv1.Plugin) bool {
	for _, in := range p.GetInstances() {
		if slices.Contains(in.GetControllerCapabilities(), csi.ControllerServiceCapability_RPC_GET_CAPACITY.String()) {
			return true
		}
	}
	return false
}

// capacity asks the plugin's controller GetCapacity (no parameters, no
// topology: the plugin's whole capacity), or says why it could not.
func (s *Server) capacity(ctx context.Context, plugin string) *agentv1.Capacity {
	ctx, cancel := context.WithTimeout(ctx, capacityTimeout)
	defer cancel()
	conn, err := s.cfg.Plugins.ControllerConn(ctx, plugin, csiController)
	if err != nil {
		return &agentv1.Capacity{Error: status.Convert(err).Message()}
	}
	r, err := csi.NewControllerClient(conn).GetCapacity(ctx, &csi.GetCapacityRequest{})
	if err != nil {
		return &agentv1.Capacity{Error: "GetCapacity: " + status.Convert(err).Message()}
	}
	return &agentv1.Capacity{AvailableBytes: r.GetAvailableCapacity(),
		MaximumVolumeBytes: r.GetMaximumVolumeSize().GetValue(), MinimumVolumeBytes: r.GetMinimumVolumeSize().GetValue()}
}
