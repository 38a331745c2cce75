package cli

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"os/user"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"

	"github.com/coreos/go-systemd/v22/activation"
	"github.com/spf13/pflag"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/cluster"
	"github.com/csiagent/csiagent/internal/version"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/supervisor"
	"github.com/csiagent/csiagent/volumestats"
)

// serveCmd is csi-agent serve.
func (e *env) serveCmd(fs *pflag.FlagSet) runFunc {
	var cfg agent.Config
	fs.StringVar(&cfg.ConfigDir, "csi-plugin-config-dir", agent.DefaultConfigDir, "directory of CSIPluginInfo JSON files, watched for changes")
	fs.StringVar(&cfg.WorkDir, "work-dir", agent.DefaultWorkDir, "persistent state: plugin records, logs, volume checkpoints")
	fs.StringVar(&cfg.RuntimeDir, "runtime-dir", agent.DefaultRuntimeDir, "sockets and the lock (a tmpfs such as /run)")
	fs.StringVar(&cfg.APISocket, "api-socket", "", "the agent API socket (default <runtime-dir>/agent.sock)")
	fs.StringVar(&cfg.NodeID, "node-id", defaultNodeID(), "node id given to node plugins as MESOS_AGENT_ID (default $MESOS_AGENT_ID, else the hostname)")
	apiGroup := fs.String("api-group", "", "group (name or gid) whose members may use the API besides root (within --api-group-roots)")
	apiGroupRoots := fs.String("api-group-roots", "", "comma-separated absolute directory prefixes below which --api-group members may prepare a rootfs or sandbox (default none: members may not prepare)")
	logFormat := fs.String("log-format", "text", "log format: text or json")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn or error")
	fs.DurationVar(&cfg.ReadyTimeout, "plugin-ready-timeout", supervisor.DefaultReadyTimeout, "deadline for a plugin's socket, Probe and discovery")
	fs.DurationVar(&cfg.ProbeInterval, "plugin-probe-interval", supervisor.DefaultProbeInterval, "period of health probes of ready plugins")
	fs.StringVar(&cfg.SecretsDir, "secrets-dir", "", "directory for volumes' REFERENCE secrets: name is a file of JSON key/values in it")
	fs.DurationVar(&cfg.RPCTimeout, "node-rpc-timeout", isolator.DefaultRPCTimeout, "deadline of each node RPC step (stage, publish, ...), retries included")
	fs.DurationVar(&cfg.ResyncInterval, "resync-interval", isolator.DefaultResyncInterval, "how often every volume and container is checked: interrupted operations finished, published volumes whose target path is not mounted repaired")
	fs.DurationVar(&cfg.ReclaimDefaults.Interval, "reclaim-interval", agent.DefaultReclaimInterval, "default interval between two reclaims of a volume (0 disables); a plugin's config may override it")
	fs.DurationVar(&cfg.ReclaimDefaults.Timeout, "reclaim-timeout", agent.DefaultReclaimTimeout, "default deadline of one NodeReclaimSpace call")
	fs.IntVar(&cfg.ReclaimDefaults.MaxConcurrent, "reclaim-max-concurrent-per-plugin", agent.DefaultReclaimPluginMax, "default cap on one plugin's concurrent reclaims")
	fs.IntVar(&cfg.ReclaimMaxConcurrent, "reclaim-max-concurrent", agent.DefaultReclaimMaxConcurrent, "cap on concurrent reclaims agent-wide")
	fs.DurationVar(&cfg.KeyRotationDefaults.Interval, "key-rotation-interval", 0, "default interval between two scheduled csi-addons key rotations of a published volume (0, the default: off); a plugin's config may override it")
	fs.DurationVar(&cfg.KeyRotationDefaults.Timeout, "key-rotation-timeout", agent.DefaultKeyRotationTimeout, "default deadline of one scheduled EncryptionKeyRotate call")
	fs.IntVar(&cfg.KeyRotationDefaults.MaxConcurrent, "key-rotation-max-concurrent-per-plugin", agent.DefaultKeyRotationPluginMax, "default cap on one plugin's concurrent scheduled key rotations")
	fs.IntVar(&cfg.KeyRotationMaxConcurrent, "key-rotation-max-concurrent", agent.DefaultKeyRotationMaxConcurrent, "cap on concurrent scheduled key rotations agent-wide (apart from reclaims)")
	repair := fs.Bool("repair", true, "republish a published volume whose target path is found not mounted (by a resync pass or a volume stats poll) and re-bind it into its containers")
	fs.DurationVar(&cfg.VolumeStatsInterval, "volume-stats-interval", volumestats.DefaultInterval, "how often each published volume's usage and health are polled (NodeGetVolumeStats, NodeGetVolumeHealth); 0 turns periodic polling off")
	fs.StringVar(&cfg.MetricsAddress, "metrics-address", "", "host:port to serve Prometheus metrics on at /metrics, e.g. 127.0.0.1:9808 (default: off)")
	fs.StringVar(&cfg.DebugAddress, "debug-address", "", "host:port to serve net/http/pprof on at /debug/pprof/, e.g. 127.0.0.1:6060 (default: off)")
	fs.BoolVar(&cfg.TraceCalls, "debug-trace-calls", false, "answer API calls that ask for it (gRPC metadata "+agent.TraceHeader+") with a timed trace of their steps in the trailer "+agent.TraceTrailer+", for measuring (default: off)")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", agent.DefaultShutdownTimeout, "how long in-flight API calls may run after SIGTERM")
	fs.StringVar(&cfg.DockerPluginSocket, "docker-plugin-socket", "", "where to serve Docker's volume plugin protocol for named volumes, used by Docker and Podman (default <runtime-dir>/docker-plugin.sock; \"none\": off)")
	fs.StringSliceVar(&cfg.Cluster.Endpoints, "cluster-etcd-endpoints", nil, "etcd client URLs (comma-separated) of the fleet this host joins: volumes one host at a time may use (single-node and single-writer access modes) are claimed there before their first stage (default: none, one host)")
	fs.StringVar(&cfg.Cluster.TLS.CACert, "cluster-etcd-cacert", "", "with --cluster-etcd-endpoints: CA certificate verifying the etcd members")
	fs.StringVar(&cfg.Cluster.TLS.Cert, "cluster-etcd-cert", "", "with --cluster-etcd-endpoints: client certificate (with --cluster-etcd-key)")
	fs.StringVar(&cfg.Cluster.TLS.Key, "cluster-etcd-key", "", "with --cluster-etcd-endpoints: client key")
	fs.StringVar(&cfg.Cluster.Prefix, "cluster-prefix", "", "with --cluster-etcd-endpoints: the fleet's key prefix in etcd (default /csiagent)")
	fs.StringSliceVar(&cfg.Cluster.FenceCIDRs, "cluster-fence-cidrs", nil, "with --cluster-etcd-endpoints: the networks this host reaches its storage from, which 'csi-agent cluster release --fence-plugin' fences (csi-addons FenceClusterNetwork) before handing its claims over (default: the addresses of its interfaces that are up, each as a /32 or /128, loopback and link-local left out)")
	fs.DurationVar(&cfg.Cluster.LeaseTTL, "cluster-lease-ttl", cluster.DefaultLeaseTTL, "with --cluster-etcd-endpoints: this host's lease in etcd; it is listed down (and its claims releasable) this long after it stops answering")
	fs.DurationVar(&cfg.Cluster.CallTimeout, "cluster-etcd-timeout", cluster.DefaultCallTimeout, "with --cluster-etcd-endpoints: deadline of each etcd call; a new claim fails Unavailable when etcd does not answer within it")
	fs.StringVar(&cfg.DockerHost, "docker-host", defaultDockerHost, "the Docker daemon whose containers are checked every --resync-interval: its mounts of volumes none of them holds any more (dockerd was killed) are released (\"none\": off)")
	return func(ctx context.Context, name string, _ []string) int {
		cfg.NoRepair = !*repair
		roots, err := apiserver.ParseRoots(*apiGroupRoots)
		if err != nil {
			fmt.Fprintf(e.stderr, "%s: --api-group-roots: %v\n", name, err)
			return ExitUsage
		}
		if len(roots) > 0 && *apiGroup == "" {
			fmt.Fprintf(e.stderr, "%s: --api-group-roots needs --api-group (the members it is for)\n", name)
			return ExitUsage
		}
		cfg.APIGroupRoots = roots
		return e.serve(ctx, name, cfg, *apiGroup, *logFormat, *logLevel)
	}
}

// defaultDockerHost is Docker's own default socket.
const defaultDockerHost = "unix:///var/run/docker.sock"

// serve runs the daemon until ctx ends.
func (e *env) serve(ctx context.Context, name string, cfg agent.Config, apiGroup, logFormat, logLevel string) int {
	if cfg.DockerHost == "none" {
		cfg.DockerHost = ""
	}
	// systemd socket activation (deploy/csi-agent-*.socket): the
	// sockets, by FileDescriptorName.
	cfg.Activated = map[string]*os.File{}
	for name, files := range activation.FilesWithNames() {
		cfg.Activated[name] = files[0]
		for _, extra := range files[1:] {
			extra.Close()
		}
	}
	switch cfg.DockerPluginSocket {
	case "":
		cfg.DockerPluginSocket = filepath.Join(cfg.RuntimeDir, "docker-plugin.sock")
	case "none":
		cfg.DockerPluginSocket = ""
	}
	logger, err := newLogger(e, logFormat, logLevel)
	if err != nil {
		fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
		return ExitUsage
	}
	cfg.Logger = logger
	cfg.APIGroup = -1
	if apiGroup != "" {
		if cfg.APIGroup, err = lookupGroup(apiGroup); err != nil {
			fmt.Fprintf(e.stderr, "%s: --api-group: %v\n", name, err)
			return ExitUsage
		}
	}
	// CSIAGENT_TEST_BOOT_ID, for reboot tests only (see agent.Config):
	// the host is taken as rebooted since the records were written.
	cfg.BootID = os.Getenv("CSIAGENT_TEST_BOOT_ID")
	if cfg.CrashPoint, err = crashPointFromEnv(); err != nil {
		fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
		return ExitUsage
	}
	// Before New, which reads every checkpoint.
	logger.Info("csi-agent starting", "version", version.Version, "pid", os.Getpid())
	a, err := agent.New(cfg)
	if err != nil {
		fmt.Fprintf(e.stderr, "%s: %v\n", name, err)
		return ExitUsage
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	go func() {
		for {
			select {
			case <-ctx.Done():
				return
			case <-hup:
				logger.Info("SIGHUP: rescanning the plugin config directory")
				a.Rescan()
			}
		}
	}()
	if err := a.Run(ctx); err != nil {
		logger.Error("csi-agent stopped", "error", err)
		return ExitProblem
	}
	logger.Info("csi-agent stopped")
	return ExitOK
}

func defaultNodeID() string {
	if id := os.Getenv("MESOS_AGENT_ID"); id != "" {
		return id
	}
	h, _ := os.Hostname()
	return h
}

func newLogger(e *env, format, level string) (*slog.Logger, error) {
	var lv slog.Level
	if err := lv.UnmarshalText([]byte(level)); err != nil {
		return nil, fmt.Errorf("--log-level %q: expected debug, info, warn or error", level)
	}
	opts := &slog.HandlerOptions{Level: lv}
	switch format {
	case "text":
		return slog.New(slog.NewTextHandler(e.stderr, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(e.stderr, opts)), nil
	}
	return nil, fmt.Errorf("--log-format %q: expected text or json", format)
}

func lookupGroup(s string) (int, error) {
	if gid, err := strconv.Atoi(s); err == nil && gid >= 0 {
		return gid, nil
	}
	g, err := user.LookupGroup(s)
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(g.Gid)
}

// crashPointFromEnv makes the crash-test hook, for tests only:
// CSIAGENT_TEST_CRASH_TRACE=FILE appends each crash point's name to FILE;
// CSIAGENT_TEST_CRASH_AT=N kills the agent with SIGKILL at the N-th point;
// CSIAGENT_TEST_CRASH_ON=POINT at the first point of that name (e.g.
// "group snapshot frozen"). None set (production): nil.
func crashPointFromEnv() (func(string), error) {
	trace, at, on := os.Getenv("CSIAGENT_TEST_CRASH_TRACE"), os.Getenv("CSIAGENT_TEST_CRASH_AT"), os.Getenv("CSIAGENT_TEST_CRASH_ON")
	if trace == "" && at == "" && on == "" {
		return nil, nil
	}
	n := 0
	if at != "" {
		var err error
		if n, err = strconv.Atoi(at); err != nil || n < 1 {
			return nil, fmt.Errorf("CSIAGENT_TEST_CRASH_AT=%q: expected a positive integer", at)
		}
	}
	var mu sync.Mutex
	count := 0
	return func(point string) {
		mu.Lock()
		defer mu.Unlock()
		count++
		if trace != "" {
			if f, err := os.OpenFile(trace, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600); err == nil {
				fmt.Fprintln(f, point)
				f.Close()
			}
		}
		if count == n || point == on {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}, nil
}
