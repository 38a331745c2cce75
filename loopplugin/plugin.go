package loopplugin

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/unixsock"
	"github.com/csiagent/csiagent/proto/identity"
	"github.com/csiagent/csiagent/proto/reclaimspace"
	"github.com/csiagent/csiagent/proto/replication"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

// DefaultName is the plugin name GetPluginInfo reports unless configured.
const DefaultName = "loop.csiagent.io"

// Version is this plugin's version (GetPluginInfo's vendor_version).
const Version = "0.1.0"

// Server-side deadlines.
const (
	// callTimeout bounds an RPC whose client set no deadline, so that a
	// waiter for a volume's lock cannot wait forever. Nothing is retried
	// inside a call except EBUSY from unmount and from loop attach.
	callTimeout = 10 * time.Minute
	// gracefulStopTimeout is how long Serve lets in-flight calls finish
	// after its context ends before cutting them off.
	gracefulStopTimeout = 30 * time.Second
	// holdSweep is how often the held block devices are checked for an
	// autoclear mark a container left (see held.sweep).
	holdSweep = time.Second
)

// Config configures a Plugin.
type Config struct {
	// Pool is the directory that holds the volume images. Required.
	Pool string
	// NodeID is what NodeGetInfo reports, and the value of its volumes'
	// and node's TopologyKey segment. Required.
	NodeID string
	// MaxVolumesPerNode is what NodeGetInfo reports as
	// max_volumes_per_node (0: no limit; the CO enforces it).
	MaxVolumesPerNode int64
	// NodeOnly turns attach mode off (see attach.go): no
	// PUBLISH_UNPUBLISH_VOLUME, NodeStageVolume attaches the image itself;
	// for a CO that never calls ControllerPublishVolume.
	NodeOnly bool
	// SharedPool says the pool is on storage every node reaches (NFS, a
	// cluster filesystem): MULTI_NODE_READER_ONLY is offered too, each
	// node attaching the image read-only. Writers stay single-node (the
	// CO keeps them one node at a time: csi-agent's cluster claims). It
	// needs NodeOnly (attachments are recorded in the pool, per volume).
	SharedPool bool
	// Name and Version are what GetPluginInfo reports; DefaultName and
	// Version if empty.
	Name, Version string
	// ReplicaPool is the pool directory replicated volumes are copied to
	// (csi-addons replication). Optional: without it the replication
	// calls are Unimplemented. It must be another existing directory.
	ReplicaPool string
	// Logger receives the plugin's logs; slog.Default() if nil.
	Logger *slog.Logger
}

// Plugin is the CSI loop plugin: identity, controller (with snapshots and
// clones), group controller and node services, and the csi-addons
// ReclaimSpace, VolumeGroup and Replication services, over the volumes of
// one pool.
//
// It keeps no state in memory: which volume is attached, staged or
// published is read from the kernel (loop devices' backing files and the
// mount table) on every call, and groups, snapshots and replication state
// are records in the pool, so a restarted plugin carries on where the
// previous one stopped. The one thing it holds is an open descriptor of
// each block-access device (see held), re-opened at start.
type Plugin struct {
	name, version, nodeID string
	maxVolumes            int64
	nodeOnly              bool
	sharedPool            bool
	attachMu              sync.Mutex // see ControllerPublishVolume
	pool                  *Pool
	replica               *Pool // nil without a replica pool
	log                   *slog.Logger
	locks                 *volumeLocks
	held                  *held
	tools                 tools
	// replicationTick is how often the replication scheduler runs.
	replicationTick time.Duration
	// hooks are for tests; zero in production.
	hooks testHooks
}

// testHooks let tests inject failures at points that are otherwise hard to
// reach.
type testHooks struct {
	// beforeSnapshotCopy runs before each member image is copied, while
	// the members are frozen; an error fails the snapshot.
	beforeSnapshotCopy atomic.Pointer[func(ctx context.Context, volumeID string) error]
}

// New checks cfg and returns a plugin.
func New(cfg Config) (*Plugin, error) {
	if cfg.Name == "" {
		cfg.Name = DefaultName
	}
	if cfg.Version == "" {
		cfg.Version = Version
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if err := ValidatePluginName(cfg.Name); err != nil {
		return nil, err
	}
	if cfg.NodeID == "" {
		return nil, fmt.Errorf("%w: node id is required", ErrInvalid)
	}
	if cfg.SharedPool && !cfg.NodeOnly {
		return nil, fmt.Errorf("%w: a shared pool needs node-only mode (--node-only): attachments are recorded in the pool, one per volume, not per node", ErrInvalid)
	}
	if cfg.MaxVolumesPerNode < 0 {
		return nil, fmt.Errorf("%w: max volumes per node %d: 0 (no limit) or more", ErrInvalid, cfg.MaxVolumesPerNode)
	}
	pool, err := OpenPool(cfg.Pool)
	if err != nil {
		return nil, err
	}
	var replica *Pool
	if cfg.ReplicaPool != "" {
		if replica, err = OpenPool(cfg.ReplicaPool); err != nil {
			return nil, fmt.Errorf("replica %w", err)
		}
		if replica.Dir() == pool.Dir() {
			return nil, fmt.Errorf("%w: the replica pool must be another directory than the pool", ErrInvalid)
		}
	}
	return &Plugin{
		name:            cfg.Name,
		version:         cfg.Version,
		nodeID:          cfg.NodeID,
		maxVolumes:      cfg.MaxVolumesPerNode,
		nodeOnly:        cfg.NodeOnly,
		sharedPool:      cfg.SharedPool,
		pool:            pool,
		replica:         replica,
		log:             cfg.Logger,
		locks:           newVolumeLocks(),
		held:            &held{files: map[string]*os.File{}},
		tools:           findTools(),
		replicationTick: defaultReplicationTick,
	}, nil
}

// Register registers the plugin's services on s: CSI Identity, Controller,
// GroupController and Node, and csi-addons Identity (which says what the
// plugin offers: a CO need not call a service to find out),
// ReclaimSpaceController, ReclaimSpaceNode, VolumeGroup Controller and
// Replication Controller. Use NewServer unless s already maps errors
// through the plugin's interceptor.
func (p *Plugin) Register(s grpc.ServiceRegistrar) {
	csi.RegisterIdentityServer(s, &identityServer{p: p})
	identity.RegisterIdentityServer(s, &addonsIdentityServer{p: p})
	csi.RegisterControllerServer(s, &controllerServer{p: p})
	csi.RegisterGroupControllerServer(s, &groupControllerServer{p: p})
	csi.RegisterNodeServer(s, &nodeServer{p: p})
	reclaimspace.RegisterReclaimSpaceControllerServer(s, &reclaimControllerServer{p: p})
	reclaimspace.RegisterReclaimSpaceNodeServer(s, &reclaimNodeServer{p: p})
	volumegroup.RegisterControllerServer(s, &volumeGroupServer{p: p})
	replication.RegisterControllerServer(s, &replicationServer{p: p})
}

// NewServer returns a gRPC server with the plugin's services registered and
// its interceptor installed.
func (p *Plugin) NewServer() *grpc.Server {
	s := grpc.NewServer(grpc.UnaryInterceptor(p.intercept))
	p.Register(s)
	return s
}

// newAddonsServer is the server of a separate csi-addons endpoint (as
// ceph-csi's --csi-addons-endpoint): csi-addons identity, ReclaimSpace,
// VolumeGroup and Replication.
func (p *Plugin) newAddonsServer() *grpc.Server {
	s := grpc.NewServer(grpc.UnaryInterceptor(p.intercept))
	identity.RegisterIdentityServer(s, &addonsIdentityServer{p: p})
	reclaimspace.RegisterReclaimSpaceControllerServer(s, &reclaimControllerServer{p: p})
	reclaimspace.RegisterReclaimSpaceNodeServer(s, &reclaimNodeServer{p: p})
	volumegroup.RegisterControllerServer(s, &volumeGroupServer{p: p})
	replication.RegisterControllerServer(s, &replicationServer{p: p})
	return s
}

// readOnlyMethod reports whether a method only reads; such calls are logged
// at debug level when they succeed.
func readOnlyMethod(fullMethod string) bool {
	m := fullMethod[strings.LastIndexByte(fullMethod, '/')+1:]
	return strings.HasPrefix(m, "Get") || strings.HasPrefix(m, "List") ||
		strings.HasPrefix(m, "Validate") || strings.HasPrefix(m, "NodeGet") ||
		strings.HasSuffix(m, "GetCapabilities") || m == "Probe"
}

// intercept is the API edge: it bounds calls without a deadline, turns
// every error into a gRPC status (toStatus; never Unknown) and logs.
func (p *Plugin) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, callTimeout)
		defer cancel()
	}
	start := time.Now()
	resp, err := handler(ctx, req)
	err = toStatus(err)
	attrs := []any{"method", info.FullMethod, "duration", time.Since(start).Round(time.Microsecond)}
	if v, ok := req.(interface{ GetVolumeId() string }); ok && v.GetVolumeId() != "" {
		attrs = append(attrs, "volume", v.GetVolumeId())
	}
	switch {
	case err != nil:
		st := status.Convert(err)
		attrs = append(attrs, "code", st.Code().String(), "error", st.Message())
		p.log.Warn("call failed", attrs...)
	case readOnlyMethod(info.FullMethod):
		p.log.Debug("call", attrs...)
	default:
		p.log.Info("call", attrs...)
	}
	if err != nil {
		return nil, err
	}
	return resp, nil
}

// Serve listens on endpoint (see ParseEndpoint; a stale socket left by a
// dead plugin is removed) and serves until ctx ends, then stops gracefully,
// giving in-flight calls up to gracefulStopTimeout. With addonsEndpoint
// (optional) it also serves csi-addons, with its identity, there. It
// returns nil after a stop through ctx. Volumes stay staged and published
// across restarts.
func (p *Plugin) Serve(ctx context.Context, endpoint, addonsEndpoint string) error {
	path, err := ParseEndpoint(endpoint)
	if err != nil {
		return err
	}
	lis, err := listenUnix(path)
	if err != nil {
		return err
	}
	// The csi-addons socket exists before the CSI one answers: a CO that
	// finds the plugin ready looks for it then (csi-agent does).
	var alis net.Listener
	if addonsEndpoint != "" {
		apath, err := ParseEndpoint(addonsEndpoint)
		if err == nil {
			alis, err = listenUnix(apath)
		}
		if err != nil {
			lis.Close()
			return err
		}
		p.log.Info("serving csi-addons", "endpoint", apath)
	}
	if err := p.holdAttached(); err != nil {
		p.log.Warn("cannot list loop devices", "error", err)
	}
	srv := p.NewServer()
	served := make(chan error, 2)
	if alis != nil {
		asrv := p.newAddonsServer()
		go func() { served <- asrv.Serve(alis) }()
		defer asrv.Stop() // after the CSI server's graceful stop below
	}
	go func() { served <- srv.Serve(lis) }()
	schedCtx, stopSched := context.WithCancel(ctx)
	schedDone := make(chan struct{})
	go func() { defer close(schedDone); p.runReplication(schedCtx) }()
	sweepDone := make(chan struct{})
	go func() { defer close(sweepDone); every(schedCtx, holdSweep, func() { p.held.sweep(p.log) }) }()
	defer func() { stopSched(); <-schedDone; <-sweepDone; p.held.sweep(p.log) }()
	replica := ""
	if p.replica != nil {
		replica = p.replica.Dir()
	}
	p.log.Info("serving", "endpoint", path, "pool", p.pool.Dir(), "replica_pool", replica, "node_id", p.nodeID,
		"name", p.name, "version", p.version, "fs_types", strings.Join(p.tools.fsTypes(), ","))
	select {
	case err := <-served:
		return fmt.Errorf("serve %s: %w", path, err)
	case <-ctx.Done():
	}
	p.log.Info("stopping", "endpoint", path)
	stopped := make(chan struct{})
	go func() { srv.GracefulStop(); close(stopped) }()
	t := time.NewTimer(gracefulStopTimeout)
	defer t.Stop()
	select {
	case <-stopped:
	case <-t.C:
		p.log.Warn("in-flight calls did not finish in time; cutting them off", "timeout", gracefulStopTimeout)
		srv.Stop()
	}
	<-served
	return nil
}

// every calls f every d until ctx ends.
func every(ctx context.Context, d time.Duration, f func()) {
	t := time.NewTicker(d)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			f()
		}
	}
}

// holdAttached reports the volumes found attached at start (the state a
// previous run left, which this one carries on from) and holds the devices
// whose node is bind-mounted (block access given out; see held) and the
// controller's attachments (attach.go), clearing
// an autoclear mark someone set meanwhile. Others are left as they are: a
// filesystem's device is held by its mount, and one being detached (an
// unstage's LOOP_CLR_FD waiting for a last opener) must stay so.
func (p *Plugin) holdAttached() error {
	attached, err := loopdev.List(p.pool.Dir())
	if err != nil {
		return err
	}
	handedOut, err := loopdev.BoundNodes()
	if err != nil {
		return err
	}
	for _, a := range attached {
		id := strings.TrimSuffix(filepath.Base(a.BackingFile), imageSuffix)
		p.log.Info("found attached volume", "volume", id, "device", a.Path)
		rec, recorded, err := p.attachmentOf(id)
		if err != nil {
			return err
		}
		if !handedOut[a.Rdev()] && (!recorded || rec.rdev() != a.Rdev()) {
			continue
		}
		f, err := loopdev.Hold(a.Device, a.BackingFile)
		if err != nil {
			p.log.Warn("cannot hold a block device open: a container it is published to could detach it", "volume", id, "device", a.Path, "error", err)
			continue
		}
		p.held.keep(a.Name, f)
	}
	return nil
}

// ParseEndpoint returns the socket path of a CSI endpoint: "unix:///abs/path",
// "unix:/abs/path", "unix://rel/path" and a bare path are accepted. Other
// schemes are not: CSI plugins serve on a local socket.
func ParseEndpoint(endpoint string) (string, error) {
	path := endpoint
	if rest, ok := strings.CutPrefix(endpoint, "unix:"); ok {
		path = strings.TrimPrefix(rest, "//")
	} else if i := strings.Index(endpoint, "://"); i >= 0 {
		return "", invalidf("endpoint %q: only unix sockets are supported", endpoint)
	}
	if path == "" {
		return "", invalidf("endpoint %q has no socket path", endpoint)
	}
	return filepath.Clean(path), nil
}

// listenUnix listens on the socket at path, creating its directory
// (unixsock.Listen): the socket is 0600, the plugin's user's, from the
// moment it appears. A socket file nobody accepts on is stale (its plugin
// died) and is replaced; a live one, or anything that is not a socket, is
// an error.
func listenUnix(path string) (net.Listener, error) {
	lis, err := unixsock.Listen(path, unixsock.Owner{GID: -1})
	if err != nil {
		return nil, fmt.Errorf("listen: %w", err)
	}
	return lis, nil
}
