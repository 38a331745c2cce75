package apiserver

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/reclaim"
	"github.com/csiagent/csiagent/volumestats"
)

// The fakes of the interfaces Config names: canned answers, and a log of
// the calls that change something (shared, in order, with
// OnVolumesChanged as "changed").

// events is the calls the handlers made.
type events []string

func (e *events) add(format string, args ...any) { *e = append(*e, fmt.Sprintf(format, args...)) }

type fakeCore struct {
	log          *events
	notRecovered bool

	mounts                 []*statev1.ContainerMount
	prepareErr, cleanupErr error
	volumes                []isolator.VolumeInfo
	containers             []isolator.ContainerInfo
	reconciled             isolator.ReconcileResult
	offline                *statev1.ReclaimResult
	offlineErr             error

	prepared *statev1.PrepareRequest
	policy   retrypolicy.Policy
	secrets  map[string]string
	params   map[string]string
}

var _ Core = (*fakeCore)(nil)

func (f *fakeCore) WaitRecovered(ctx context.Context) error {
	if !f.notRecovered {
		return nil
	}
	<-ctx.Done()
	return fmt.Errorf("the agent is still recovering its volumes: %w", ctx.Err())
}

func (f *fakeCore) Prepare(_ context.Context, req *statev1.PrepareRequest) ([]*statev1.ContainerMount, error) {
	f.log.add("Prepare %s", req.GetContainerId())
	f.prepared = req
	return f.mounts, f.prepareErr
}

func (f *fakeCore) Cleanup(_ context.Context, id string, force bool) error {
	f.log.add("Cleanup %s force=%v", id, force)
	return f.cleanupErr
}

// CleanupIf asks allow about the container of the fake's list, if any.
func (f *fakeCore) CleanupIf(ctx context.Context, id string, force bool, allow func(isolator.ContainerInfo) error) error {
	for _, ci := range f.containers {
		if ci.ID == id && allow != nil {
			if err := allow(ci); err != nil {
				return err
			}
		}
	}
	return f.Cleanup(ctx, id, force)
}

func (f *fakeCore) Reconcile(_ context.Context, live []string, manager string) isolator.ReconcileResult {
	f.log.add("Reconcile [%s] manager=%q", strings.Join(live, " "), manager)
	return f.reconciled
}

func (f *fakeCore) ListVolumes() []isolator.VolumeInfo       { return f.volumes }
func (f *fakeCore) ListContainers() []isolator.ContainerInfo { return f.containers }

func (f *fakeCore) ReclaimOffline(_ context.Context, client isolator.ReclaimController, plugin, id string, secrets, params map[string]string, policy retrypolicy.Policy) (*statev1.ReclaimResult, error) {
	f.log.add("ReclaimOffline %s/%s client=%v", plugin, id, client != nil)
	f.secrets, f.params, f.policy = secrets, params, policy
	return f.offline, f.offlineErr
}

type fakePlugins struct {
	log      *events
	statuses []*agentv1.Plugin
	fileErrs []*pluginconfig.FileError
	// changes are the channels Changed returned, the last one open.
	changes []chan struct{}
	// offers are the "plugin service" pairs offered.
	offers  []string
	conn    *grpc.ClientConn
	connErr error
}

var _ Plugins = (*fakePlugins)(nil)

func (f *fakePlugins) Statuses() ([]*agentv1.Plugin, []*pluginconfig.FileError) {
	return f.statuses, f.fileErrs
}

func (f *fakePlugins) Changed() <-chan struct{} {
	f.changes = append(f.changes, make(chan struct{}))
	return f.changes[len(f.changes)-1]
}

func (f *fakePlugins) Offers(plugin, service string) bool {
	return slices.Contains(f.offers, plugin+" "+service)
}

func (f *fakePlugins) ControllerConn(_ context.Context, plugin, service string) (*grpc.ClientConn, error) {
	f.log.add("ControllerConn %s %s", plugin, service)
	return f.conn, f.connErr
}

// runResult is a canned on-demand reclaim.
type runResult struct {
	res reclaim.Result
	err error
}

type fakeSchedules struct {
	log                     *events
	nextReclaim, nextRotate map[string]time.Time // by "plugin/id"
	reclaimable             []pervolume.Volume
	results                 map[string]runResult // by "plugin/id"; none: ok, 10 bytes freed
	summary                 reclaim.Summary
}

var _ Schedules = (*fakeSchedules)(nil)

func (f *fakeSchedules) NextReclaim(plugin, id string) (time.Time, bool) {
	t, ok := f.nextReclaim[plugin+"/"+id]
	return t, ok
}

func (f *fakeSchedules) NextKeyRotation(plugin, id string) (time.Time, bool) {
	t, ok := f.nextRotate[plugin+"/"+id]
	return t, ok
}

func (f *fakeSchedules) Reclaimable() []pervolume.Volume { return f.reclaimable }

func (f *fakeSchedules) ReclaimNow(_ context.Context, vols []pervolume.Volume, progress func(pervolume.Volume, reclaim.Result, error)) reclaim.Summary {
	var ids []string
	for _, v := range vols {
		ids = append(ids, v.Plugin+"/"+v.ID)
	}
	f.log.add("ReclaimNow [%s]", strings.Join(ids, " "))
	for _, v := range vols {
		r, ok := f.results[v.Plugin+"/"+v.ID]
		if !ok {
			r.res = reclaim.Result{PreUsage: 30, PostUsage: 20}
		}
		progress(v, r.res, r.err)
	}
	return f.summary
}

type fakeStats struct {
	log   *events
	stats map[string]volumestats.Stats // by "plugin/id"
}

var _ Stats = (*fakeStats)(nil)

func (f *fakeStats) Refresh(context.Context) { f.log.add("Refresh") }

func (f *fakeStats) Get(plugin, id string) (volumestats.Stats, bool) {
	s, ok := f.stats[plugin+"/"+id]
	return s, ok
}

// fixture is a Server on fakes.
type fixture struct {
	log       events
	core      fakeCore
	plugins   fakePlugins
	schedules fakeSchedules
	stats     fakeStats
	members   Members
	// configured is Config.Configured (closed unless a test opens it),
	// stopping Config.Stopping.
	configured, stopping chan struct{}
}

func newFixture() *fixture {
	f := &fixture{configured: make(chan struct{}), stopping: make(chan struct{})}
	close(f.configured)
	f.core.log, f.plugins.log, f.schedules.log, f.stats.log = &f.log, &f.log, &f.log, &f.log
	return f
}

// server is the Server on the fixture's fakes as they are now.
func (f *fixture) server() *Server {
	return New(Config{
		Core: &f.core, ConfigDir: "/etc/csi-agent/plugins.d", Plugins: &f.plugins,
		Configured: f.configured, Stopping: f.stopping, OnVolumesChanged: func() { f.log.add("changed") },
		Schedules: &f.schedules, Stats: &f.stats, Members: f.members,
	})
}

// caller is a context of a call by the peer cred (PeerCredentials).
func caller(cred *unix.Ucred) context.Context {
	return peer.NewContext(context.Background(), &peer.Peer{AuthInfo: peerInfo{cred: cred}})
}

var rootCred = &unix.Ucred{}

// fakeStream is a server stream of T's messages that records them.
type fakeStream[T any] struct {
	grpc.ServerStream // nil: only Context and Send are called
	ctx               context.Context
	sent              []*T
	sendErr           error
	// onSend, if set, is called after each message is recorded.
	onSend func()
}

func (s *fakeStream[T]) Context() context.Context { return s.ctx }

func (s *fakeStream[T]) Send(m *T) error {
	s.sent = append(s.sent, m)
	if s.onSend != nil {
		s.onSend()
	}
	return s.sendErr
}
