package isolator

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/bootid"
	"github.com/csiagent/csiagent/internal/defaults"
	"github.com/csiagent/csiagent/internal/keyedlock"
)

const (
	// DefaultRPCTimeout bounds one node RPC step, retries included.
	DefaultRPCTimeout = 2 * time.Minute
	// DefaultResyncInterval is how often volumes and containers that are
	// not where they should be (a plugin was down, a cleanup failed) are
	// driven there again.
	DefaultResyncInterval = 30 * time.Second
)

// Error classes; the API edge maps them to status codes. Errors returned by
// a plugin keep their gRPC status and are mapped from it.
var (
	// ErrInvalid: the request is malformed.
	ErrInvalid = errors.New("invalid request")
	// ErrPrecondition: the request conflicts with the agent's state.
	ErrPrecondition = errors.New("failed precondition")
	// ErrUnknownPlugin: no config defines the plugin.
	ErrUnknownPlugin = errors.New("unknown plugin")
	// ErrUnavailable: the plugin is not ready.
	ErrUnavailable = errors.New("plugin unavailable")
	// ErrLimit: the plugin's limit of volumes on this node is reached.
	ErrLimit = errors.New("volume limit reached")
)

// ErrNotPublished is what ReclaimSpace, ScheduleReclaim and
// ScheduleKeyRotation wrap when the volume is not published (any more).
var ErrNotPublished = errors.New("volume is not published")

// NodeClient is the part of a CSI node service the isolator calls.
type NodeClient interface {
	NodeStageVolume(ctx context.Context, in *csi.NodeStageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error)
	NodeUnstageVolume(ctx context.Context, in *csi.NodeUnstageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error)
	NodePublishVolume(ctx context.Context, in *csi.NodePublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodePublishVolumeResponse, error)
	NodeUnpublishVolume(ctx context.Context, in *csi.NodeUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnpublishVolumeResponse, error)
}

var _ NodeClient = csi.NodeClient(nil)

// ControllerClient is the part of a CSI controller service the isolator
// calls: attach and detach.
type ControllerClient interface {
	ControllerPublishVolume(ctx context.Context, in *csi.ControllerPublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error)
	ControllerUnpublishVolume(ctx context.Context, in *csi.ControllerUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error)
}

var _ ControllerClient = csi.ControllerClient(nil)

// Plugin is what the isolator needs to know of a plugin.
type Plugin struct {
	// Type is the plugin's type (volumes' plugin_name); Name its instance
	// name. Together they name its directory under the work dir.
	Type, Name string
	// TargetPathRoot, when set, holds staging and target paths.
	TargetPathRoot string
	// TargetPathExists (Mesos's meaning): the plugin expects the target
	// to exist, so the agent makes it before NodePublishVolume; false
	// (CSI): the agent makes only its parent.
	TargetPathExists bool
}

// Node is a ready plugin's node service.
type Node struct {
	Client NodeClient
	// StageUnstage: the plugin has STAGE_UNSTAGE_VOLUME.
	StageUnstage bool
	// MaxVolumes is NodeGetInfo's max_volumes_per_node: at most this many
	// of the plugin's volumes are staged or published on the node (0: no
	// limit). A volume that would pass it is refused (ErrLimit) before
	// any call.
	MaxVolumes int64
	// NodeID is NodeGetInfo's node id: the node_id of
	// ControllerPublishVolume and ControllerUnpublishVolume.
	NodeID string
	// Topology is NodeGetInfo's accessible_topology (nil: none reported).
	// A volume with an accessible_topology none of whose segments this
	// one has is refused (ErrPrecondition) before any call.
	Topology map[string]string
	// Controller, when set, attaches and detaches the plugin's volumes:
	// its controller has PUBLISH_UNPUBLISH_VOLUME. ControllerPublishVolume
	// goes before a volume's first node call, ControllerUnpublishVolume
	// after its last.
	Controller ControllerClient
	// PublishReadonly: the controller has PUBLISH_READONLY, so a
	// read-only volume is attached read-only.
	PublishReadonly bool
}

// Claims is the fleet's hold on volumes that one host at a time may use
// (package cluster, on etcd): Claim before a volume comes onto the node
// (before its first call), before any other way up (recovery, repair)
// and before each new user of a volume on it (a claim handed to another
// host while this one was away refuses new users; the volume's users
// keep it), Release once it is off the node: Release makes every change
// the isolator wrote before it durable (the teardown) before the claim
// leaves the fleet (package cluster's does: its record of the release
// is on the daemon's Committer, whose rounds are ordered). Claim's own
// record may become durable with the caller's next durable point. Claim decides from the capability whether a claim is needed;
// its refusals wrap ErrPrecondition (another node holds the volume) or
// ErrUnavailable (no quorum: fail closed); Release does not fail for
// want of etcd (it finishes the release later).
type Claims interface {
	Claim(ctx context.Context, plugin, volumeID string, capability *csi.VolumeCapability) error
	Release(ctx context.Context, plugin, volumeID string) error
}

// Plugins is how the isolator finds plugins; the agent implements it.
type Plugins interface {
	// Lookup returns the plugin's config; ErrUnknownPlugin if none.
	Lookup(pluginType string) (Plugin, error)
	// Node waits until the plugin's node service is ready, or ctx ends
	// (then an error wrapping ErrUnavailable that says why).
	Node(ctx context.Context, pluginType string) (Node, error)
}

// Config configures an Isolator.
type Config struct {
	// WorkDir holds checkpoints (and default mount roots).
	WorkDir string
	// SecretsDir resolves REFERENCE secrets: name is a file in it, key a
	// key of the JSON object it holds. Empty: REFERENCE secrets are an
	// error.
	SecretsDir string
	Plugins    Plugins
	// RPCTimeout bounds each node RPC step, retries included;
	// DefaultRPCTimeout when 0.
	RPCTimeout time.Duration
	// ResyncInterval: DefaultResyncInterval when 0.
	ResyncInterval time.Duration
	Logger         *slog.Logger
	// OnChange, when set, is called after every change of a volume or a
	// container (checkpoints, reclaims starting and ending).
	OnChange func()
	// NoRepair turns repair off: a published volume whose target path is
	// found not mounted (unmounted outside the agent) is then only
	// reported (a warning), not republished and re-bound into its
	// containers (see Repair).
	NoRepair bool
	// OnRepair, when set, is called with the outcome of each repair
	// attempted (a target found not mounted, repair on), outside any
	// lock: for metrics.
	OnRepair func(pluginType, volumeID string, outcome RepairOutcome)
	// CrashPoint, for crash tests only, is called after every checkpoint
	// and every RPC with a name for the point; it may kill the process.
	CrashPoint func(point string)
	// BootID, for reboot tests only, replaces the kernel's boot id
	// (/proc/sys/kernel/random/boot_id) when set: a value other than the
	// one in the checkpoints makes recovery treat the host as rebooted.
	BootID string
	// Commit writes the checkpoints: the daemon's one Committer of the
	// work dir (shared with whatever else records state there). Nil: the
	// isolator makes its own (tests).
	Commit *atomicfile.Committer
	// Fsync, for durability tests only, replaces the fsync of checkpoint
	// files of the Committer the isolator makes when Commit is nil.
	Fsync func(path string) error
	// Mounts does the mount work; nil: package mount, the kernel's.
	Mounts Mounter
	// Claims, when set, claims volumes across the fleet (see Claims);
	// nil: one host, no claims.
	Claims Claims
	// Deferred runs the work an answer need not wait for (the removals a
	// cleanup or a teardown leaves: see removal); nil: a goroutine each.
	// The fake world's crash tests run it on the calling goroutine.
	Deferred func(func())
}

// Isolator prepares and cleans up containers' CSI volumes.
type Isolator struct {
	cfg    Config
	log    *slog.Logger
	bootID string
	mounts Mounter

	// commit writes checkpoints: visible at once, durable in shared
	// commit rounds.
	commit *atomicfile.Committer

	volumeLocks    keyedlock.Map
	containerLocks keyedlock.Map
	// limitMu makes a volume's check of its plugin's volume limit and its
	// first step onto the node one (enterState).
	limitMu sync.Mutex

	mu sync.Mutex
	// volumes caches every volume checkpoint in memory, by key; the disk
	// is the truth, written before this is updated.
	volumes map[volumeKey]*volume
	// containers likewise caches container checkpoints.
	containers map[string]*container
	// reclaiming holds the cancel of the reclaim running or waiting for
	// its volume's lock (one per volume); reclaimActive the volumes whose
	// reclaim RPC runs; releasing counts the cleanups removing a volume's
	// last user, which keep reclaims off it.
	reclaiming    map[volumeKey]context.CancelFunc
	reclaimActive map[volumeKey]bool
	releasing     map[volumeKey]int
	// recovered is closed when the first recovery pass has run.
	recovered chan struct{}
	// corrupt counts the record files found corrupt (moveAside).
	corrupt atomic.Uint64
	// rebuildLeft: a missing volume record could not be rebuilt yet
	// (rebuildMissingVolumes).
	rebuildLeft atomic.Bool
	// removals are the forgotten records and mount directories not
	// removed yet.
	removals removals
	// pools holds each mount root's spare volume directories (treePool).
	pools sync.Map
}

// New makes an Isolator; Run recovers its state and keeps it converged.
func New(cfg Config) (*Isolator, error) {
	if cfg.WorkDir == "" || cfg.Plugins == nil {
		return nil, errors.New("isolator: WorkDir and Plugins are required")
	}
	defaults.Set(&cfg.RPCTimeout, DefaultRPCTimeout)
	defaults.Set(&cfg.ResyncInterval, DefaultResyncInterval)
	cfg.Logger = defaults.Logger(cfg.Logger)
	if cfg.OnChange == nil {
		cfg.OnChange = func() {}
	}
	if cfg.CrashPoint == nil {
		cfg.CrashPoint = func(string) {}
	}
	if cfg.OnRepair == nil {
		cfg.OnRepair = func(string, string, RepairOutcome) {}
	}
	if cfg.Mounts == nil {
		cfg.Mounts = kernelMounts{}
	}
	bootID := cfg.BootID
	if bootID == "" {
		var err error
		if bootID, err = bootid.Current(); err != nil {
			return nil, err
		}
	}
	iso := &Isolator{
		cfg:           cfg,
		log:           cfg.Logger,
		bootID:        bootID,
		mounts:        cfg.Mounts,
		volumes:       map[volumeKey]*volume{},
		containers:    map[string]*container{},
		reclaiming:    map[volumeKey]context.CancelFunc{},
		reclaimActive: map[volumeKey]bool{},
		releasing:     map[volumeKey]int{},
		recovered:     make(chan struct{}),
		commit:        cfg.Commit,
	}
	if err := syncWorkDir(cfg.WorkDir); err != nil {
		return nil, err
	}
	if iso.commit == nil {
		if err := atomicfile.MkdirAll(cfg.WorkDir, 0o755); err != nil {
			return nil, fmt.Errorf("creating the work directory: %w", err)
		}
		c, err := atomicfile.Open(cfg.WorkDir, bootID)
		if err != nil {
			return nil, err
		}
		c.Fsync = cfg.Fsync
		iso.commit = c
	}
	start := time.Now()
	err := iso.load()
	// Every record of the work dir the isolator needs is read: the start
	// image (atomicfile.Committer.ReadRecord) is no longer needed.
	iso.commit.ReleaseImage()
	if err != nil {
		return nil, err
	}
	iso.log.Info("records loaded", "containers", len(iso.containers), "volumes", len(iso.volumes), "from_start_image", iso.commit.ImageReads(), "took", time.Since(start))
	return iso, nil
}

// Run recovers every volume and container (finishing or rolling back what
// a crash interrupted, republishing after a reboot), then resyncs
// periodically until ctx ends.
func (iso *Isolator) Run(ctx context.Context) {
	iso.resync(ctx, true)
	close(iso.recovered)
	// Repairs of the published volumes a pass found with their target
	// path not mounted run beside the passes, on a worker of their own: a
	// repair waits for its volume's and containers' locks, which a pass
	// must not (it skips what is busy). While the worker is busy, a pass's
	// batch is dropped: the next pass finds those volumes again.
	repairs := make(chan []volumeKey, 1)
	var worker sync.WaitGroup
	worker.Go(func() {
		for batch := range repairs {
			iso.repairUnmounted(ctx, batch)
		}
	})
	t := time.NewTicker(iso.cfg.ResyncInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			close(repairs)
			worker.Wait()
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), finalSyncTimeout)
			if err := iso.commit.Sync(sctx); err != nil {
				iso.log.Error("making the last checkpoint changes durable", "error", err)
			}
			cancel()
			return
		case <-t.C:
			if batch := iso.resync(ctx, false); len(batch) > 0 {
				select {
				case repairs <- batch:
				default:
				}
			}
		}
	}
}

// finalSyncTimeout bounds the wait, on stop, for the last checkpoint
// changes to become durable.
const finalSyncTimeout = 10 * time.Second

// syncWorkDir commits the work directory's filesystem (syncfs) before
// any checkpoint is read: a predecessor that crashed may have left
// checkpoint changes visible but not yet durable; operations resumed from
// them (a cleanup acknowledged once its intent is durable) count on their
// durability, and checkpoint writes count on the newest version found
// being durable (see atomicfile). If that fails, the agent does not start:
// trusting those changes could lose an acknowledged container at the next
// power cut.
func syncWorkDir(dir string) error {
	err := atomicfile.SyncFS(dir)
	if err == nil || errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	return fmt.Errorf("syncing the work directory's filesystem (%s): %w; refusing to start on checkpoints that may not be durable (check the disk, then restart)", dir, err)
}

// Recovered is closed once the first recovery pass has finished.
func (iso *Isolator) Recovered() <-chan struct{} { return iso.recovered }

// BootID is the boot the isolator runs in (Config.BootID, or the
// kernel's).
func (iso *Isolator) BootID() string { return iso.bootID }

// WaitRecovered waits for the first recovery pass (callers that must not
// act on state recovery has not rebuilt yet), or for ctx's end.
func (iso *Isolator) WaitRecovered(ctx context.Context) error {
	select {
	case <-iso.recovered:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("the agent is still recovering its volumes: %w", ctx.Err())
	}
}
