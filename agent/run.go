package agent

import (
	"context"
	"fmt"
	"os"
	"sync"
	"time"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/internal/unixsock"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// component is one part of the running agent: start brings it up (ctx
// ends at shutdown) and returns how to bring it down.
type component struct {
	name  string
	start func(ctx context.Context) (stop func(), err error)
}

// Run serves until ctx ends, then shuts down gracefully: the API stops
// accepting calls and in-flight ones get ShutdownTimeout to finish.
// Managed plugins keep running so that the next agent adopts them.
//
// The components start in order and stop in reverse, after serving or at
// the first that fails to start: the engine endpoint answers before the
// API, so that the API being up means the agent is (API calls are what
// tests and the hooks watch), and the API stops first at shutdown.
func (a *Agent) Run(ctx context.Context) error {
	defer a.unlockWork()
	defer a.checkpoint()
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	var stops []func()
	defer func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}()
	for _, c := range []component{
		{"directories", a.startDirs},
		{"thaw after crash", a.thawAfterCrash},
		{"metrics endpoint", a.startMetrics},
		{"debug endpoint", a.startDebug},
		{"plugins", a.startPlugins},
		{"cluster", a.startCluster},
		{"volume workers", a.startWorkers},
		{"config watcher", a.startWatcher},
		{"engine endpoint", a.startEngines},
		{"API", a.startAPI},
	} {
		a.log.Debug("starting", "component", c.name)
		stop, err := c.start(runCtx)
		if err != nil {
			return err // each says what failed
		}
		stops = append(stops, stop)
	}
	return a.serve(runCtx)
}

// serve runs the agent's loop until ctx ends or the API server or the
// config watcher fails: config updates, log rotation, readiness and the
// systemd watchdog.
func (a *Agent) serve(ctx context.Context) error {
	sd := newSDNotifier(a)
	defer func() {
		a.log.Info("csi-agent shutting down")
		sd.stopping()
	}()
	sd.send("STATUS=recovering volumes and starting plugins")
	var watchdog <-chan time.Time
	if sd.watchdog > 0 {
		t := time.NewTicker(sd.watchdog)
		defer t.Stop()
		watchdog = t.C
	}
	recovered := a.iso.Recovered()
	swept := false // the unclaimed plugin processes stopped
	rotate := time.NewTicker(logRotateInterval)
	defer rotate.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case err := <-a.apiErr:
			return fmt.Errorf("API server: %w", err)
		case u, ok := <-a.watcher.Updates():
			if !ok {
				return nil
			}
			a.apply(ctx, u)
			select {
			case <-a.configured:
			default:
				// Recovery needs the plugins the first update defines.
				close(a.configured)
			}
			if !swept {
				swept = a.stopUnclaimed(ctx, u)
			}
		case <-rotate.C:
			a.set.RotateLogs(a.cfg.LogMaxBytes, a.cfg.LogKeep)
		case <-recovered:
			// Serving, and every checkpoint recovered: ready.
			recovered = nil
			a.log.Info("recovery done; ready")
			sd.ready()
		case <-watchdog:
			// Fed from this loop, so a wedged agent stops feeding it.
			sd.alive()
		}
	}
}

// startDirs makes the config and runtime directories and locks the
// runtime directory.
func (a *Agent) startDirs(context.Context) (stop func(), err error) {
	if err := os.MkdirAll(a.cfg.ConfigDir, 0o755); err != nil {
		return nil, fmt.Errorf("creating %s: %w", a.cfg.ConfigDir, err)
	}
	// The API group and plugins run as other users reach their sockets
	// through the runtime dir, so it is searchable whatever the umask.
	if err := unixsock.MkdirAll(a.cfg.RuntimeDir); err != nil {
		return nil, err
	}
	return lockDir(a.cfg.RuntimeDir, "--runtime-dir")
}

// thawAfterCrash thaws the filesystems a group snapshot of a container
// froze when the agent stopped before thawing them (see package snapcat),
// before anything else runs. One that cannot be thawed is logged, its
// record kept for the next start: the agent still serves the rest.
func (a *Agent) thawAfterCrash(context.Context) (stop func(), err error) {
	if err := a.snapshots.ThawRecorded(a.log); err != nil {
		a.log.Error("thawing the filesystems a crash left frozen failed: their writers stay blocked until they are thawed (fsfreeze -u PATH); the next start tries again", "error", err)
	}
	return func() {}, nil
}

// startPlugins starts nothing (the first config update does) but stops
// supervising every plugin at the end; managed processes keep running.
func (a *Agent) startPlugins(context.Context) (stop func(), err error) {
	return a.set.StopAll, nil
}

// startWorkers runs, once the first config update is applied (recovery
// needs the plugins it defines), the isolator's recovery and resync, the
// stats poller and, after recovery (they would only compete with it for
// volume locks and the disk), the reclaim and key rotation schedules.
func (a *Agent) startWorkers(ctx context.Context) (stop func(), err error) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	afterRecovery := func(run func(context.Context)) func() {
		return func() {
			select {
			case <-a.iso.Recovered():
				run(ctx)
			case <-ctx.Done():
			}
		}
	}
	wg.Go(func() {
		select {
		case <-a.configured:
		case <-ctx.Done():
			return
		}
		wg.Go(afterRecovery(a.reclaimer.Run))
		wg.Go(afterRecovery(a.keyRotator.Run))
		wg.Go(func() { a.stats.Run(ctx) })
		a.iso.Run(ctx)
	})
	return func() { cancel(); wg.Wait() }, nil
}

// startWatcher watches the config directory (its updates are served by
// serve) until ctx ends.
func (a *Agent) startWatcher(ctx context.Context) (stop func(), err error) {
	ctx, cancel := context.WithCancel(ctx)
	w, err := pluginconfig.Watch(ctx, pluginconfig.WatchConfig{Dir: a.cfg.ConfigDir, Logger: a.log})
	if err != nil {
		cancel()
		return nil, err
	}
	a.watcher = w
	return cancel, nil
}

// startAPI serves the agent API on its socket; its stop ends watch
// streams, stops accepting calls and lets in-flight ones finish within
// the shutdown timeout.
func (a *Agent) startAPI(context.Context) (stop func(), err error) {
	lis, err := a.listenUnix(a.cfg.APISocket, "API socket", ActivatedAPI, unixsock.Owner{GID: a.cfg.APIGroup})
	if err != nil {
		return nil, err
	}
	a.ignoreUnknownSockets()
	srv := grpc.NewServer(grpc.Creds(apiserver.PeerCredentials{}), grpc.MaxRecvMsgSize(MaxAPIMessageSize),
		grpc.ChainUnaryInterceptor(a.metrics.serverInterceptor, a.access.Unary, a.traceInterceptor),
		grpc.ChainStreamInterceptor(a.metrics.serverStreamInterceptor, a.access.Stream))
	agentv1.RegisterAgentServer(srv, apiserver.New(apiserver.Config{
		Core: a.iso, ConfigDir: a.cfg.ConfigDir, Plugins: apiPlugins{controllerPlugins{a}},
		Configured: a.configured, Stopping: a.stopping, OnVolumesChanged: a.pokeSchedules,
		Schedules: apiSchedules{a}, Stats: apiStats{a},
		Named: a.named, Members: apiserver.Members{Roots: a.cfg.APIGroupRoots}, Cluster: a.apiCluster(), Fence: a.ctrlops.Fence,
	}))
	agentv1.RegisterControllerServer(srv, a.ctrlops)
	a.apiErr = make(chan error, 1)
	go func() { a.apiErr <- srv.Serve(lis) }()
	a.log.Info("csi-agent serving", "api_socket", a.cfg.APISocket, "config_dir", a.cfg.ConfigDir, "node_id", a.cfg.NodeID)
	return func() {
		close(a.stopping)
		a.stopAPI(srv)
	}, nil
}

// ignoreUnknownSockets closes, with a warning, the sockets systemd passed
// under a name that is none of the agent's.
func (a *Agent) ignoreUnknownSockets() {
	for name, f := range a.cfg.Activated {
		if name != ActivatedAPI && (name != ActivatedDockerPlugin || a.cfg.DockerPluginSocket == "") {
			a.log.Warn("ignoring a socket systemd passed: its name is none of the agent's", "name", name, "want", ActivatedAPI+", "+ActivatedDockerPlugin)
			f.Close()
		}
	}
}

// stopAPI stops accepting calls and lets in-flight ones finish within the
// shutdown timeout, then cancels them. The socket is removed unless
// systemd passed it (its unit keeps it, and queues calls while the agent
// restarts).
func (a *Agent) stopAPI(srv *grpc.Server) {
	if _, activated := a.cfg.Activated[ActivatedAPI]; !activated {
		defer os.Remove(a.cfg.APISocket)
	}
	done := make(chan struct{})
	go func() {
		srv.GracefulStop()
		close(done)
	}()
	t := time.NewTimer(a.cfg.ShutdownTimeout)
	defer t.Stop()
	select {
	case <-done:
	case <-t.C:
		a.log.Warn("in-flight API calls did not finish in time; cancelling them", "timeout", a.cfg.ShutdownTimeout)
		srv.Stop()
		<-done
	}
}

// checkpointTimeout bounds the checkpoint of a clean stop.
const checkpointTimeout = 10 * time.Second

// checkpoint leaves, once everything has stopped, every record in its own
// file and no journal (atomicfile.Committer.Checkpoint): a release before
// the journal reads the work dir whole. One that fails or is cut short
// leaves the journal, which the next start replays. Then the start image
// (atomicfile.Committer.WriteImage) for the next start.
func (a *Agent) checkpoint() {
	// The records a cleanup left to remove go first: else the next start
	// finds them, and finishes those cleanups again. A disk slow enough
	// to need more than their own bound leaves them to it, and the
	// checkpoint its whole bound.
	sctx, scancel := context.WithTimeout(context.Background(), checkpointTimeout/2)
	err := a.iso.SettleRemovals(sctx)
	scancel()
	if err != nil {
		a.log.Warn("removing the records of finished cleanups at stop; the next start finishes them", "error", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), checkpointTimeout)
	defer cancel()
	if err := a.commit.Checkpoint(ctx); err != nil {
		a.log.Error("checkpointing the work dir at stop; the next start replays its journal", "error", err)
		return
	}
	// With the journal gone, the next start may read its records from
	// one file (a cache it checks against each record file's stat),
	// written once nothing writes records any more.
	if n := a.iso.RemovalsPending(); n > 0 {
		a.log.Warn("no start image at stop: removals still running; the next start reads every record file", "removals", n)
		return
	}
	start := time.Now()
	n, err := a.commit.WriteImage(ctx)
	if err != nil {
		a.log.Warn("writing the start image at stop; the next start reads every record file", "error", err)
		return
	}
	a.log.Info("start image written", "records", n, "took", time.Since(start))
}
