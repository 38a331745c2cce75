package agent

import (
	"context"
	"errors"
	"net"
	"net/http"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/dockerplugin"
	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
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

func (b engineBackend) Prepare(ctx context.Context, req *agentv1.PrepareRequest) (*agentv1.PrepareResponse, error) {
	if err := apiserver.WaitRecovered(ctx, b.a.iso); err != nil {
		return nil, err
	}
	resp, err := b.a.iso.Prepare(ctx, req)
	b.a.pokeSchedules()
	return resp, err
}

func (b engineBackend) Cleanup(ctx context.Context, id string) error {
	if err := apiserver.WaitRecovered(ctx, b.a.iso); err != nil {
		return err
	}
	err := b.a.iso.Cleanup(ctx, id, false)
	b.a.pokeSchedules()
	return err
}

func (b engineBackend) ListContainers() []*agentv1.ContainerStatus { return b.a.iso.ListContainers() }
func (b engineBackend) ListVolumes() []*agentv1.VolumeStatus       { return b.a.iso.ListVolumes() }

func (b engineBackend) CheckPlugin(typ string) error {
	_, err := plugins(b).Lookup(typ)
	return err
}

// peerCredKey holds a connection's peer credentials in its context.
type peerCredKey struct{}

// engineCallTimeout bounds one engine call (a Mount stages and publishes).
const engineCallTimeout = 2 * time.Minute

// startEngines serves the Docker volume plugin socket when configured.
func (a *Agent) startEngines() (stop func(), err error) {
	if a.cfg.DockerPluginSocket == "" {
		return func() {}, nil
	}
	store, err := namedvol.OpenStore(NamedVolumesDir(a.cfg.WorkDir))
	if err != nil {
		return nil, err
	}
	srv, err := dockerplugin.New(dockerplugin.Config{
		Store: store, Backend: engineBackend{a}, Dir: filepath.Join(a.cfg.WorkDir, engineMountsDir),
		Logger: a.log.With("component", "docker-plugin"),
	})
	if err != nil {
		return nil, err
	}
	lis, err := a.listenUnix(a.cfg.DockerPluginSocket, "--docker-plugin-socket")
	if err != nil {
		return nil, err
	}
	// Peer credentials are checked as on the API socket.
	handler := srv.Handler(engineCallTimeout)
	hs := &http.Server{
		ReadHeaderTimeout: 10 * time.Second,
		ConnContext: func(ctx context.Context, c net.Conn) context.Context {
			cred, err := apiserver.PeerCred(c)
			if err != nil {
				a.log.Warn("volume plugin socket", "error", err)
				return ctx
			}
			return context.WithValue(ctx, peerCredKey{}, cred)
		},
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			cred, _ := r.Context().Value(peerCredKey{}).(*unix.Ucred)
			if cred == nil || !a.access.Permitted(cred) {
				http.Error(w, `{"Err": "only root and members of the agent's --api-group may use this socket"}`, http.StatusForbidden)
				return
			}
			handler.ServeHTTP(w, r)
		}),
	}
	go func() {
		if err := hs.Serve(lis); err != nil && !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("docker volume plugin endpoint stopped", "error", err)
		}
	}()
	a.log.Info("serving the Docker volume plugin protocol", "socket", a.cfg.DockerPluginSocket)
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), a.cfg.ShutdownTimeout)
		defer cancel()
		if err := hs.Shutdown(ctx); err != nil {
			hs.Close()
		}
	}, nil
}
