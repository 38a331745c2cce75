package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/cluster"
	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/defaults"
	"github.com/csiagent/csiagent/internal/unixsock"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/reclaim"
	"github.com/csiagent/csiagent/snapcat"
	"github.com/csiagent/csiagent/supervisor"
	"github.com/csiagent/csiagent/volumestats"
)

// Defaults of Config.
const (
	DefaultConfigDir       = "/etc/csi-agent/plugins.d"
	DefaultWorkDir         = "/var/lib/csi-agent"
	DefaultRuntimeDir      = "/run/csi-agent"
	DefaultShutdownTimeout = 10 * time.Second
	// DefaultLogMaxBytes caps each plugin log file before rotation.
	DefaultLogMaxBytes = 10 << 20
	// DefaultLogKeep rotated files are kept per log.
	DefaultLogKeep = 3
	// MaxAPIMessageSize caps a request to the agent API (gRPC's default,
	// set explicitly): a bigger one is refused with ResourceExhausted
	// before it is decoded.
	MaxAPIMessageSize = 4 << 20
	// logRotateInterval is how often plugin logs are checked for size.
	logRotateInterval = 30 * time.Second
)

// Config configures an Agent. Zero values take the defaults above.
type Config struct {
	ConfigDir  string
	WorkDir    string
	RuntimeDir string
	// APISocket defaults to <RuntimeDir>/agent.sock.
	APISocket string
	// NodeID is given to node plugins as MESOS_AGENT_ID.
	NodeID string
	// APIGroup, when >= 0, is a group whose members may call the API
	// besides root; the socket is then 0660 root:APIGroup.
	APIGroup int
	// APIGroupRoots are the directory prefixes (absolute, clean, not "/")
	// below which members of APIGroup may prepare a rootfs or sandbox;
	// none: members may not prepare (see apiserver.Members).
	APIGroupRoots []string

	ReadyTimeout    time.Duration
	ProbeInterval   time.Duration
	BackoffBase     time.Duration
	BackoffMax      time.Duration
	BackoffReset    time.Duration
	ShutdownTimeout time.Duration
	LogMaxBytes     int64
	LogKeep         int

	// SecretsDir resolves volumes' REFERENCE secrets.
	SecretsDir string
	// RPCTimeout bounds each node RPC step, retries included.
	RPCTimeout time.Duration
	// ResyncInterval is how often every volume and container is checked
	// and driven to where it should be (isolator.DefaultResyncInterval
	// when 0).
	ResyncInterval time.Duration
	// CrashPoint is for crash tests only: see isolator.Config.
	CrashPoint func(point string)
	// BootID is for reboot tests only: see isolator.Config; the work
	// dir's journals are replayed as after a power cut when it is not
	// the boot they were written in (atomicfile.Open).
	BootID string

	// ReclaimDefaults is the reclaim policy of plugins whose config does
	// not override it; ReclaimMaxConcurrent caps reclaims agent-wide.
	ReclaimDefaults      pervolume.Policy
	ReclaimMaxConcurrent int
	// KeyRotationDefaults schedules csi-addons EncryptionKeyRotate on the
	// published volumes of plugins that offer it, for plugins whose config
	// does not override it; Interval 0 (the default): not scheduled.
	// KeyRotationMaxConcurrent caps key rotations agent-wide (apart from
	// reclaims).
	KeyRotationDefaults      pervolume.Policy
	KeyRotationMaxConcurrent int
	// VolumeStatsInterval is how often each published volume's usage and
	// health are polled (plugins with GET_VOLUME_STATS or
	// GET_VOLUME_HEALTH); 0 turns periodic polling off: csi-agent volumes
	// --refresh-stats still polls.
	VolumeStatsInterval time.Duration
	// NoRepair turns off repair: a published volume whose target path is
	// found not mounted (by a volume stats poll or a resync pass) is then
	// only reported, not republished and re-bound into its containers.
	NoRepair bool
	// Cluster, with Endpoints, joins the fleet on etcd (package cluster):
	// volumes one host at a time may use are claimed there. Without: one
	// host, no claims.
	Cluster ClusterConfig

	// MetricsAddress, when set, is the host:port where Run serves
	// Prometheus metrics at /metrics (port 0: any; see MetricsAddr).
	MetricsAddress string
	// DebugAddress, when set, is the host:port where Run serves
	// net/http/pprof at /debug/pprof/ (off by default: profiles reveal
	// internals; bind it to localhost).
	DebugAddress string
	// TraceCalls lets API callers ask for a trace of their call (package
	// optrace): a unary call whose metadata has TraceHeader gets the
	// trace's table in its TraceTrailer. Off by default: for measuring
	// (the benchmarks), as pprof is.
	TraceCalls bool
	// DockerPluginSocket, when set, is where Run serves Docker's volume
	// plugin protocol for the named volumes (see package dockerplugin).
	DockerPluginSocket string
	// Activated are listening sockets the process was given (systemd
	// socket activation), by their FileDescriptorName: ActivatedAPI is
	// served as the API socket and ActivatedDockerPlugin as the Docker
	// volume plugin socket, each of which must listen at APISocket and
	// DockerPluginSocket. Their files stay when the agent stops: calls
	// made while it restarts wait in their backlog instead of failing.
	Activated map[string]*os.File
	// DockerHost, when set (unix:///path), is the Docker daemon whose
	// containers the agent checks every ResyncInterval, releasing Docker's
	// mounts of volumes no container of it holds any more (what dockerd
	// forgets when it is killed). A daemon that does not answer is
	// skipped: nothing is released on a guess.
	DockerHost string

	Logger *slog.Logger
}

func (c *Config) setDefaults() {
	defaults.Set(&c.ConfigDir, DefaultConfigDir)
	defaults.Set(&c.WorkDir, DefaultWorkDir)
	defaults.Set(&c.RuntimeDir, DefaultRuntimeDir)
	defaults.Set(&c.APISocket, filepath.Join(c.RuntimeDir, "agent.sock"))
	defaults.Set(&c.ShutdownTimeout, DefaultShutdownTimeout)
	defaults.Set(&c.LogMaxBytes, DefaultLogMaxBytes)
	defaults.Set(&c.LogKeep, DefaultLogKeep)
	c.Logger = defaults.Logger(c.Logger)
	defaults.Set(&c.ReclaimDefaults.Timeout, DefaultReclaimTimeout)
	defaults.Set(&c.KeyRotationDefaults.Timeout, DefaultKeyRotationTimeout)
	defaults.Set(&c.ReclaimDefaults.MaxConcurrent, DefaultReclaimPluginMax)
	defaults.Set(&c.ReclaimMaxConcurrent, DefaultReclaimMaxConcurrent)
	defaults.Set(&c.KeyRotationDefaults.MaxConcurrent, DefaultKeyRotationPluginMax)
	defaults.Set(&c.KeyRotationMaxConcurrent, DefaultKeyRotationMaxConcurrent)
}

// Agent is the csiagent daemon.
type Agent struct {
	cfg Config
	log *slog.Logger
	// set supervises the configured plugins; its Changed channel also
	// wakes on volume and container changes (WatchPlugins streams both).
	set     *supervisor.Set
	access  apiserver.Access
	watcher *pluginconfig.Watcher
	iso     *isolator.Isolator
	// reclaimer schedules reclaim-space calls on published volumes.
	reclaimer *reclaim.Scheduler
	// keyRotator schedules key rotations on published volumes.
	keyRotator *pervolume.Scheduler[keyRotation]
	// ctrlops serves the Controller API; the key rotation schedule calls
	// it too.
	ctrlops *controllerops.Server
	// stats polls published volumes' usage and health.
	stats *volumestats.Poller
	// named is the named volumes and the engines' mounts of them
	// (startEngines).
	named *dockerplugin.Server
	// stopping is closed when shutdown begins, ending watch streams.
	stopping chan struct{}
	// apiErr receives the API server's error if it stops serving.
	apiErr chan error
	// configured is closed once the config directory's first load is
	// applied: before, the plugin list would be empty, not true.
	configured chan struct{}
	// metrics is the agent's Prometheus registry (metrics.go).
	metrics *metrics
	// commit writes every record under the work dir (see
	// atomicfile.Committer); unlockWork releases the work dir's lock.
	commit *atomicfile.Committer
	// snapshots is the snapshot catalogue (WORK_DIR/snapshots).
	snapshots *snapcat.Catalogue
	// cluster is the fleet, once joined (nil: one host, or not yet).
	cluster    atomic.Pointer[cluster.Cluster]
	unlockWork func()
}

// New checks cfg, makes and locks the work dir (released when Run
// returns), loads the volume checkpoints and makes an Agent; Run starts it.
func New(cfg Config) (*Agent, error) {
	cfg.setDefaults()
	for name, dir := range map[string]string{"--work-dir": cfg.WorkDir, "--runtime-dir": cfg.RuntimeDir, "--csi-plugin-config-dir": cfg.ConfigDir} {
		if !filepath.IsAbs(dir) {
			return nil, fmt.Errorf("%s %q: must be an absolute path", name, dir)
		}
	}
	if cfg.NodeID == "" {
		return nil, errors.New("node id is empty: set --node-id or MESOS_AGENT_ID")
	}
	if cfg.MetricsAddress != "" {
		if _, _, err := net.SplitHostPort(cfg.MetricsAddress); err != nil {
			return nil, fmt.Errorf("--metrics-address %q: %w", cfg.MetricsAddress, err)
		}
	}
	if cfg.DebugAddress != "" {
		if _, _, err := net.SplitHostPort(cfg.DebugAddress); err != nil {
			return nil, fmt.Errorf("--debug-address %q: %w", cfg.DebugAddress, err)
		}
	}
	// The work dir is this agent's alone (two agents would overwrite
	// each other's records), made durably, before any record is read.
	if err := atomicfile.MkdirAll(cfg.WorkDir, 0o755); err != nil {
		return nil, fmt.Errorf("--work-dir: %w", err)
	}
	unlockWork, err := lockDir(cfg.WorkDir, "--work-dir")
	if err != nil {
		return nil, err
	}
	a, err := newAgent(cfg)
	if err != nil {
		unlockWork()
		return nil, err
	}
	a.unlockWork = unlockWork
	return a, nil
}

// newAgent makes the Agent of New, its work dir locked.
func newAgent(cfg Config) (*Agent, error) {
	commit, err := atomicfile.Open(cfg.WorkDir, cfg.BootID)
	if err != nil {
		return nil, err
	}
	a := &Agent{cfg: cfg, log: cfg.Logger, stopping: make(chan struct{}), configured: make(chan struct{}), access: apiserver.Access{Group: cfg.APIGroup}, commit: commit}
	a.stats = volumestats.New(volumestats.Config{Source: statsSource{a}, Interval: cfg.VolumeStatsInterval, Logger: cfg.Logger})
	a.metrics = newMetrics(a)
	a.set = supervisor.NewSet(supervisor.Config{
		WorkDir: cfg.WorkDir, RuntimeDir: cfg.RuntimeDir, NodeID: cfg.NodeID, Commit: commit,
		ReadyTimeout: cfg.ReadyTimeout, ProbeInterval: cfg.ProbeInterval,
		BackoffBase: cfg.BackoffBase, BackoffMax: cfg.BackoffMax, BackoffReset: cfg.BackoffReset,
		Logger: a.log, Limits: supervisor.NewLimiter(a.log), Interceptor: a.metrics.clientInterceptor,
		OnReady: func(typ string) {
			a.reclaimer.ResetPlugin(typ)
			a.keyRotator.ResetPlugin(typ)
			a.pokeSchedules()
		},
	})
	iso, err := isolator.New(isolator.Config{
		WorkDir: cfg.WorkDir, SecretsDir: cfg.SecretsDir, Plugins: plugins{a}, Commit: commit,
		RPCTimeout: cfg.RPCTimeout, ResyncInterval: cfg.ResyncInterval, Logger: cfg.Logger, CrashPoint: cfg.CrashPoint,
		OnChange: a.set.Notify, BootID: cfg.BootID, NoRepair: cfg.NoRepair, Claims: a.claims(),
		OnRepair: func(plugin, _ string, outcome isolator.RepairOutcome) {
			a.metrics.repairs.WithLabelValues(plugin, string(outcome)).Inc()
		},
	})
	if err != nil {
		return nil, err
	}
	a.iso = iso
	a.reclaimer = reclaim.New(pervolume.Config[reclaim.Result]{
		Name: reclaimJobName, Job: reclaimJob{a}, Policy: a.reclaimPolicy, MaxConcurrent: cfg.ReclaimMaxConcurrent,
		PokeSettle: schedulePokeSettle, Logger: cfg.Logger,
	})
	a.keyRotator = pervolume.New(pervolume.Config[keyRotation]{
		Name: keyRotationJobName, Job: keyRotationJob{a}, Policy: a.keyRotationPolicy, MaxConcurrent: cfg.KeyRotationMaxConcurrent,
		PokeSettle: schedulePokeSettle, Logger: cfg.Logger,
	})
	cat, err := snapcat.Open(filepath.Join(cfg.WorkDir, snapshotsDir), a.log)
	if err != nil {
		return nil, err
	}
	a.snapshots = cat
	a.ctrlops = controllerops.New(controllerops.Config{Plugins: controllerPlugins{a}, Catalogue: cat, Log: a.log, CrashPoint: cfg.CrashPoint, Fleet: a.fleetLocks()})
	return a, nil
}

// Rescan re-reads the config directory now (SIGHUP).
func (a *Agent) Rescan() {
	if a.watcher != nil {
		a.watcher.Rescan()
	}
}

// snapshotsDir is the snapshot catalogue's directory in the work dir.
const snapshotsDir = "snapshots"

// Names of the sockets in Config.Activated.
const (
	ActivatedAPI          = "api"
	ActivatedDockerPlugin = "docker-plugin"
)

// listenUnix creates one of the agent's sockets, or takes the one
// activated under name: 0600 root (0660 root:APIGroup).
func (a *Agent) listenUnix(path, what, name string, o unixsock.Owner) (net.Listener, error) {
	var lis net.Listener
	var err error
	if f, ok := a.cfg.Activated[name]; ok {
		if lis, err = unixsock.Inherit(f, path, o); err == nil {
			a.log.Info("serving on a socket systemd passed", "socket", path, "name", name)
		}
	} else {
		lis, err = unixsock.Listen(path, o)
	}
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	return lis, nil
}

// lockDir takes the exclusive lock of one of the agent's directories
// (flag names it): <dir>/agent.lock, holding the holder's pid. A second
// agent on the same directory refuses to start, naming the holder.
func lockDir(dir, flag string) (func(), error) {
	path := filepath.Join(dir, "agent.lock")
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening %s: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		holder, _ := io.ReadAll(io.LimitReader(f, 32))
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("another csi-agent (pid %s) is running with %s %s (%s is locked)", cmp.Or(strings.TrimSpace(string(holder)), "unknown"), flag, dir, path)
		}
		return nil, fmt.Errorf("locking %s: %w", path, err)
	}
	_ = f.Truncate(0)
	_, _ = f.WriteAt([]byte(strconv.Itoa(os.Getpid())+"\n"), 0)
	return func() { f.Close() }, nil
}

// apply turns one config update into started, rolled and stopped plugins.
func (a *Agent) apply(ctx context.Context, u pluginconfig.Update) {
	for _, typ := range a.set.Apply(ctx, u) {
		// A new config may implement reclaim where the old did not.
		a.reclaimer.ResetPlugin(typ)
		a.keyRotator.ResetPlugin(typ)
	}
	a.pokeSchedules()
}

// stopUnclaimed stops the processes of managed plugins that no config has
// now (Set.StopUnclaimed), at an update that leaves no file of the config
// directory invalid: one half-saved, or unreadable for a moment, may be
// the config of a plugin still running, which the sweep would stop. It
// reports whether it swept.
func (a *Agent) stopUnclaimed(ctx context.Context, u pluginconfig.Update) bool {
	if len(u.Errors) > 0 {
		a.log.Warn("plugin processes that no config has now are stopped once no file of the config directory is invalid", "invalid_files", len(u.Errors))
		return false
	}
	a.set.StopUnclaimed(ctx)
	return true
}

// schedulePokeSettle spaces the per-volume schedules' rescans that
// pokes ask for (pervolume.Config.PokeSettle): every Prepare and Cleanup
// pokes, and a rescan reads every volume; a new volume is scheduled that
// much later at most.
const schedulePokeSettle = 100 * time.Millisecond

// pokeSchedules tells the per-volume schedules (reclaim, key rotation)
// that volumes or policies changed.
func (a *Agent) pokeSchedules() {
	a.reclaimer.Poke()
	a.keyRotator.Poke()
}

// snapshot lists the plugins' status, sorted by type, with their reclaim
// schedules.
func (a *Agent) snapshot() ([]*agentv1.Plugin, []*pluginconfig.FileError) {
	ps, errs := a.set.Statuses()
	out := make([]*agentv1.Plugin, 0, len(ps))
	for _, p := range ps {
		ap := apiserver.Plugin(p)
		ap.Reclaim = a.reclaimTotals(p.Type)
		out = append(out, ap)
	}
	return out, errs
}
