package controllerops

import (
	"context"
	"log/slog"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/internal/keyedlock"
	"github.com/csiagent/csiagent/internal/redact"
	"github.com/csiagent/csiagent/internal/retrypolicy"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/snapcat"
)

// The csi-addons and CSI services the controller operations call, as
// discovery names them.
const (
	VolumeGroupService     = "volumegroup.Controller"
	ReplicationService     = "replication.Controller"
	GroupControllerService = "csi.v1.GroupController"
	// ControllerService is CSI's Controller, on the CSI endpoint.
	ControllerService = "csi.v1.Controller"
)

// Plugins is what the operations need of the daemon's plugin set.
type Plugins interface {
	// ControllerConn waits (until ctx ends) for the plugin's controller
	// and returns the connection that serves service (one of the *Service
	// names): csi-addons may be served on an endpoint of its own. Its
	// errors are status errors; Unavailable is retried.
	ControllerConn(ctx context.Context, plugin, service string) (*grpc.ClientConn, error)
	// Offers reports whether discovery found service on the plugin.
	Offers(plugin, service string) bool
	// LogDir is where the plugin's logs are, "" when the agent keeps none.
	LogDir(plugin string) string
	// NodeConn is ControllerConn for the plugin's node service.
	NodeConn(ctx context.Context, plugin, service string) (*grpc.ClientConn, error)
	// Published is where a volume published on this host is; false when
	// it is not published here.
	Published(plugin, volumeID string) (PublishedVolume, bool)
	// Publishing are the plugins that publish a volume of that id on
	// this host.
	Publishing(volumeID string) []string
	// NodeCapabilities are the node capabilities discovery found, e.g.
	// EXPAND_VOLUME.
	NodeCapabilities(plugin string) []string
	// NamedVolume is the plugin and volume id of a named volume.
	NamedVolume(name string) (plugin, volumeID string, err error)
	// ContainerVolumes are the volumes the agent gave a container, each
	// once; false when it knows no such container.
	ContainerVolumes(containerID string) ([]VolumeRef, bool)
}

// VolumeRef names one volume of one plugin.
type VolumeRef struct{ Plugin, ID string }

// PublishedVolume is where a volume is published on this host.
type PublishedVolume struct {
	TargetPath, StagingPath string
	Block                   bool
	// Capability is the one the volume was staged and published with.
	Capability *csi.VolumeCapability
}

// Server is the Controller API service.
type Server struct {
	agentv1.UnimplementedControllerServer
	plugins Plugins
	cat     *snapcat.Catalogue
	log     *slog.Logger
	crash   func(point string)
	// locks keeps one operation in flight per plugin object in this
	// agent; fleet, when the agent is in a cluster, across the fleet.
	locks keyedlock.Map
	fleet FleetLocks
}

// FleetLocks keeps one call in flight per object across the agents of a
// fleet (package cluster's Lock on etcd).
type FleetLocks interface {
	// Lock takes the fleet-wide lock of one object, waiting until ctx
	// (which carries the operation's deadline) ends; waiting is called
	// once, with the holding node, when another holds it. held is ctx,
	// ended when the lock may be lost (the node's lease gone): the
	// operation runs under it. Its errors are status errors (Unavailable
	// when the fleet's store does not answer).
	Lock(ctx context.Context, kind, id string, waiting func(holder string)) (held context.Context, unlock func(), err error)
}

var _ agentv1.ControllerServer = (*Server)(nil)

// Config is what the service needs.
type Config struct {
	Plugins Plugins
	// Catalogue records the snapshots and group snapshots, and the
	// filesystems frozen for them.
	Catalogue *snapcat.Catalogue
	Log       *slog.Logger
	// CrashPoint is for crash tests only (nil: none): it is called with
	// "group snapshot frozen" once a container's filesystems are frozen.
	CrashPoint func(point string)
	// Fleet, when set, extends each operation's per-object lock across
	// the fleet; nil on one host.
	Fleet FleetLocks
}

// New returns the Controller API service.
func New(cfg Config) *Server {
	crash := cfg.CrashPoint
	if crash == nil {
		crash = func(string) {}
	}
	return &Server{plugins: cfg.Plugins, cat: cfg.Catalogue, log: cfg.Log, crash: crash, fleet: cfg.Fleet}
}

// request is what every Controller API request carries.
type request interface {
	proto.Message
	GetPluginName() string
	GetRetry() *agentv1.RetryPolicy
}

// serve runs one API operation: it validates the plugin name and retry
// policy, logs the request (secrets stripped), bounds the operation by the
// policy's timeout, runs body with progress sent on stream (wrapped by
// wrap), and logs how it ended, always returning a status error.
func serve[Reply any](s *Server, method string, req request, stream grpc.ServerStreamingServer[Reply],
	wrap func(*agentv1.Progress) *Reply, body func(ctx context.Context, o *op) error) error {
	return s.run(stream.Context(), method, req, func(p *agentv1.Progress) error { return stream.Send(wrap(p)) }, body)
}

// run is serve with progress sent to progress.
func (s *Server) run(ctx context.Context, method string, req request, progress func(*agentv1.Progress) error, body func(ctx context.Context, o *op) error) error {
	plugin := req.GetPluginName()
	if plugin == "" {
		return status.Error(codes.InvalidArgument, "plugin_name is required: the plugin's type, as 'csi-agent plugins' lists it")
	}
	rp, err := retrypolicy.Parse(req.GetRetry())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	log := s.log.With("method", method, "plugin", plugin)
	log.Info("controller operation", "request", redact.Value(req))
	ctx, cancel := context.WithTimeout(ctx, rp.Timeout)
	defer cancel()
	o := &op{s: s, plugin: plugin, policy: rp, progress: progress}
	err = body(ctx, o)
	if err == nil {
		log.Info("controller operation done")
		return nil
	}
	err = asStatus(err)
	log.Warn("controller operation failed", "code", status.Code(err), "error", status.Convert(err).Message())
	return err
}

// asStatus keeps status errors; a context's end becomes its code, anything
// else Internal (never Unknown).
func asStatus(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	if st := status.FromContextError(err); st.Code() != codes.Unknown {
		return st.Err()
	}
	return status.Error(codes.Internal, err.Error())
}

func invalid(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, format, args...)
}

// The progress messages of each reply type.

func operationProgress(p *agentv1.Progress) *agentv1.OperationReply {
	return &agentv1.OperationReply{Progress: p}
}

func volumeGroupProgress(p *agentv1.Progress) *agentv1.VolumeGroupReply {
	return &agentv1.VolumeGroupReply{Progress: p}
}

func listProgress(p *agentv1.Progress) *agentv1.ListVolumeGroupsReply {
	return &agentv1.ListVolumeGroupsReply{Progress: p}
}

func replicationProgress(p *agentv1.Progress) *agentv1.ReplicationReply {
	return &agentv1.ReplicationReply{Progress: p}
}

func groupSnapshotProgress(p *agentv1.Progress) *agentv1.GroupSnapshotReply {
	return &agentv1.GroupSnapshotReply{Progress: p}
}
