package agent

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/internal/unixsock"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// Directories of the work dir: named volume definitions and the engines'
// mounts.
const (
	namedVolumesDir = "named-volumes"
	engineMountsDir = "engine-mounts"
)

// NamedVolumesDir is where an agent with this work dir keeps named volume
// definitions.
func NamedVolumesDir(workDir string) string { return filepath.Join(workDir, namedVolumesDir) }

// engineBackend gives the engine endpoint the isolator: calls wait for the
// first recovery pass, as the API's do.
type engineBackend struct{ a *Agent }

func (b engineBackend) Prepare(ctx context.Context, req *statev1.PrepareRequest) ([]*statev1.ContainerMount, error) {
	if err := b.a.iso.WaitRecovered(ctx); err != nil {
		return nil, err
	}
	defer b.a.pokeSchedules()
	return b.a.iso.Prepare(ctx, req)
}

func (b engineBackend) Cleanup(ctx context.Context, id string) error {
	if err := b.a.iso.WaitRecovered(ctx); err != nil {
		return err
	}
	defer b.a.pokeSchedules()
	return b.a.iso.Cleanup(ctx, id, false)
}

func (b engineBackend) ListContainers() []isolator.ContainerInfo { return b.a.iso.ListContainers() }
func (b engineBackend) ListVolumes() []isolator.VolumeInfo       { return b.a.iso.ListVolumes() }

func (b engineBackend) CheckPlugin(typ string) error {
	_, err := plugins(b).Lookup(typ)
	return err
}

// startEngines loads the named volumes and the engines' mounts of them
// (a.named, which the API serves too) and serves the Docker volume plugin
// socket when configured.
func (a *Agent) startEngines(context.Context) (stop func(), err error) {
	store, err := namedvol.OpenStore(a.commit, NamedVolumesDir(a.cfg.WorkDir))
	if err != nil {
		return nil, err
	}
	srv, err := dockerplugin.New(dockerplugin.Config{
		Store: store, Backend: engineBackend{a}, Dir: filepath.Join(a.cfg.WorkDir, engineMountsDir), Commit: a.commit,
		Logger: a.log.With("component", "docker-plugin"), NodeID: a.cfg.NodeID, CrashPoint: a.cfg.CrashPoint,
		BootID: a.iso.BootID(),
	})
	if err != nil {
		return nil, err
	}
	a.named = srv
	// Engine mounts of a former boot: released once recovery has
	// brought their containers back.
	rctx, stopReleasing := context.WithCancel(context.Background())
	released := make(chan struct{})
	go func() {
		defer close(released)
		if a.iso.WaitRecovered(rctx) == nil {
			srv.ReleaseFormerBoot(rctx)
		}
	}()
	stopReleasingWait := func() { stopReleasing(); <-released }
	if a.cfg.DockerPluginSocket == "" {
		return stopReleasingWait, nil
	}
	// Root's alone (0600), whatever --api-group: the engines run as root,
	// and the protocol defines and removes named volumes, takes any
	// option (secret references included) and releases engine mounts by
	// id, none of which the API lets a member do.
	lis, err := a.listenUnix(a.cfg.DockerPluginSocket, "--docker-plugin-socket", ActivatedDockerPlugin, unixsock.Owner{GID: -1})
	if err != nil {
		stopReleasingWait()
		return nil, err
	}
	stopChecking := func() {}
	if a.cfg.DockerHost != "" {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); a.checkDocker(ctx) }()
		stopChecking = func() { cancel(); <-done }
	}
	// Peer credentials are checked (root only, as the socket's mode);
	// the limits bound each connection's time and how many are served at
	// once.
	lim := dockerplugin.DefaultLimits
	hs := lim.HTTPServer(apiserver.Access{Group: -1}.HTTP(engineTagged(srv.Handler(lim.CallTimeout))))
	hs.ConnContext = apiserver.ConnContext
	hs.ErrorLog = slog.NewLogLogger(a.log.Handler(), slog.LevelError)
	a.log.Info("serving the Docker volume plugin protocol", "socket", a.cfg.DockerPluginSocket)
	stopServing := a.serveHTTP(hs, lim.Listener(lis), "docker volume plugin")
	return func() { stopChecking(); stopServing(); stopReleasingWait() }, nil
}

// dockerCheckTimeout bounds one look at Docker's containers.
const dockerCheckTimeout = 10 * time.Second

// checkDocker releases, every resync interval until ctx ends, Docker's
// mounts of volumes that no container of the Docker daemon at DockerHost
// holds any more, last mounted more than two intervals ago. A daemon that
// does not answer is logged when that changes, and nothing is released.
func (a *Agent) checkDocker(ctx context.Context) {
	interval := cmp.Or(a.cfg.ResyncInterval, isolator.DefaultResyncInterval)
	t := time.NewTicker(interval)
	defer t.Stop()
	lastErr := ""
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if !a.named.HasMounts(namedvol.EngineDocker) {
			continue // nothing to ask Docker about
		}
		qctx, cancel := context.WithTimeout(ctx, dockerCheckTimeout)
		root, known, inUse, err := dockerplugin.DockerVolumes(qctx, a.cfg.DockerHost)
		cancel()
		if err != nil {
			if msg := err.Error(); msg != lastErr {
				level := slog.LevelWarn
				if errors.Is(err, syscall.ENOENT) {
					level = slog.LevelDebug // no Docker on this host
				}
				a.log.Log(ctx, level, "cannot ask Docker which volumes its containers hold; its mounts are kept", "docker_host", a.cfg.DockerHost, "error", err)
				lastErr = msg
			}
			continue
		}
		lastErr = ""
		released, failed := a.named.ReleaseUnused(ctx, namedvol.EngineDocker, root, known, inUse, 2*interval)
		for _, r := range released {
			a.log.Info("released a Docker mount no container of it holds (dockerd forgot it)", "mount", r)
		}
		for m, why := range failed {
			a.log.Warn("releasing a Docker mount no container of it holds", "mount", m, "error", why)
		}
		if len(released) > 0 {
			a.pokeSchedules()
		}
	}
}

// dockerDataRoot is the data root of the dockerd with this pid, from the
// volume database it keeps open (<data-root>/volumes/metadata.db), "" if
// none is found: it tells one daemon's mounts from another's. Found once
// per daemon process (pid and start time): dockerd has many descriptors,
// and every call of the engine socket is tagged.
func dockerDataRoot(pid int32) string {
	ticks, err := supervisor.StartTicks(int(pid))
	if err != nil {
		return ""
	}
	key := fmt.Sprintf("%d/%d", pid, ticks)
	if root, ok := dockerRoots.Load(key); ok {
		return root.(string)
	}
	fds, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	for _, fd := range fds {
		target, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, fd.Name()))
		if root, ok := strings.CutSuffix(target, "/volumes/metadata.db"); err == nil && ok {
			dockerRoots.Store(key, root)
			return root
		}
	}
	return ""
}

// dockerRoots caches dockerDataRoot by "pid/start time".
var dockerRoots sync.Map

// engineOfExe is the engine whose daemon (or CLI, for Podman) exe is.
func engineOfExe(exe string) string {
	switch filepath.Base(strings.TrimSuffix(exe, " (deleted)")) {
	case "dockerd":
		return namedvol.EngineDocker
	case "podman":
		return namedvol.EnginePodman
	}
	return ""
}

// engineTagged tells the handler which engine calls (dockerplugin.WithEngine),
// from the executable of the socket's peer: dockerd is Docker's (the daemon
// told by its data root), podman Podman's; anything else is no known engine.
func engineTagged(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		engine, instance := "", ""
		if cred := apiserver.HTTPPeer(r); cred != nil {
			exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", cred.Pid))
			if engine = engineOfExe(exe); engine == namedvol.EngineDocker {
				instance = dockerDataRoot(cred.Pid)
			}
		}
		h.ServeHTTP(w, r.WithContext(dockerplugin.WithEngine(r.Context(), engine, instance)))
	})
}
