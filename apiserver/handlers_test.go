package apiserver

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/volumestats"
)

// checkStatus fails unless err has code and a message containing want
// (codes.OK: no error).
func checkStatus(t *testing.T, err error, code codes.Code, want string) {
	t.Helper()
	if code == codes.OK {
		if err != nil {
			t.Fatalf("error %v, want none", err)
		}
		return
	}
	if _, ok := status.FromError(err); !ok || status.Code(err) != code || !strings.Contains(status.Convert(err).Message(), want) {
		t.Fatalf("error %v, want %v containing %q", err, code, want)
	}
}

// checkEvents fails unless the handlers made exactly the calls want.
func checkEvents(t *testing.T, got events, want ...string) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Fatalf("calls %q, want %q", got, want)
	}
}

// memberRoots makes an --api-group-roots prefix with a container's rootfs
// below it.
func memberRoots(t *testing.T) (roots, rootfs string) {
	roots = t.TempDir()
	rootfs = filepath.Join(roots, "c1", "rootfs")
	if err := os.MkdirAll(rootfs, 0o755); err != nil {
		t.Fatal(err)
	}
	return roots, rootfs
}

func TestPrepareHandler(t *testing.T) {
	roots, rootfs := memberRoots(t)
	vol := &agentv1.Volume{ContainerPath: "/data", Source: &agentv1.Volume_Source{
		Type: agentv1.Volume_Source_CSI_VOLUME, CsiVolume: &agentv1.CSIVolume{PluginName: "loop", StaticProvisioning: &agentv1.StaticProvisioning{VolumeId: "v1"}}}}
	req := func(change func(*agentv1.PrepareRequest)) *agentv1.PrepareRequest {
		r := &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: rootfs, Manager: "nomad", Volumes: []*agentv1.Volume{vol}}
		if change != nil {
			change(r)
		}
		return r
	}
	inside := &statev1.ContainerMount{PluginName: "loop", VolumeId: "v1", ContainerPath: "/data", MountPoint: rootfs + "/data", HostPath: "/var/lib/t", Readonly: true}
	outside := &statev1.ContainerMount{PluginName: "loop", VolumeId: "v1", ContainerPath: "/data", MountPoint: "/etc/cron.d"}
	for _, c := range []struct {
		name   string
		ctx    context.Context
		req    *agentv1.PrepareRequest
		core   func(*fakeCore)
		code   codes.Code
		msg    string
		events []string
	}{
		{name: "root prepares", ctx: caller(rootCred), req: req(nil), core: func(f *fakeCore) { f.mounts = []*statev1.ContainerMount{inside} },
			events: []string{"Prepare c1", "changed"}},
		{name: "an engine mount's id", ctx: caller(rootCred), req: req(func(r *agentv1.PrepareRequest) { r.ContainerId = namedvol.EngineMountPrefix + "x" }),
			code: codes.InvalidArgument, msg: "container_id"},
		{name: "a manager too long", ctx: caller(rootCred), req: req(func(r *agentv1.PrepareRequest) { r.Manager = strings.Repeat("m", 65) }),
			code: codes.InvalidArgument, msg: "manager"},
		{name: "a manager with a space", ctx: caller(rootCred), req: req(func(r *agentv1.PrepareRequest) { r.Manager = "my manager" }),
			code: codes.InvalidArgument, msg: `manager "my manager"`},
		{name: "no peer credentials", ctx: context.Background(), req: req(nil), code: codes.Unauthenticated, msg: "no peer credentials"},
		{name: "not recovered yet", ctx: cancelled(caller(rootCred)), req: req(nil), core: func(f *fakeCore) { f.notRecovered = true },
			code: codes.Unavailable, msg: "still recovering"},
		{name: "the isolator refuses a field", ctx: caller(rootCred), req: req(nil),
			core: func(f *fakeCore) {
				f.prepareErr = fmt.Errorf("%w: volumes[0].container_path is empty", isolator.ErrInvalid)
			},
			code: codes.InvalidArgument, msg: "volumes[0].container_path is empty",
			events: []string{"Prepare c1", "changed"}},
		{name: "the work dir is full", ctx: caller(rootCred), req: req(nil),
			core: func(f *fakeCore) { f.prepareErr = fmt.Errorf("writing checkpoint: %w", syscall.ENOSPC) },
			code: codes.ResourceExhausted, msg: "writing checkpoint",
			events: []string{"Prepare c1", "changed"}},
		{name: "the plugin's volume limit on this node", ctx: caller(rootCred), req: req(nil),
			core: func(f *fakeCore) { f.prepareErr = fmt.Errorf("volume loop/v1: %w: at most 2", isolator.ErrLimit) },
			code: codes.ResourceExhausted, msg: "volume loop/v1: volume limit reached: at most 2",
			events: []string{"Prepare c1", "changed"}},
		{name: "a member prepares below the roots", ctx: caller(memberCred), req: req(nil), core: func(f *fakeCore) { f.mounts = []*statev1.ContainerMount{inside} },
			events: []string{"Prepare c1", "changed"}},
		{name: "a member's rootfs outside the roots", ctx: caller(memberCred), req: req(func(r *agentv1.PrepareRequest) { r.Rootfs = "/etc" }),
			code: codes.PermissionDenied, msg: `rootfs "/etc" is not under any --api-group-roots prefix`},
		{name: "a member's mount lands outside: undone", ctx: caller(memberCred), req: req(nil), core: func(f *fakeCore) { f.mounts = []*statev1.ContainerMount{outside} },
			code: codes.PermissionDenied, msg: "the prepare was undone",
			events: []string{"Prepare c1", "changed", "Cleanup c1 force=true", "changed"}},
		{name: "a member's mount lands outside, undoing fails", ctx: caller(memberCred), req: req(nil),
			core: func(f *fakeCore) { f.mounts, f.cleanupErr = []*statev1.ContainerMount{outside}, errors.New("busy") },
			code: codes.PermissionDenied, msg: "(and undoing it failed: busy)",
			events: []string{"Prepare c1", "changed", "Cleanup c1 force=true"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture()
			f.members = Members{Roots: []string{roots}}
			if c.core != nil {
				c.core(&f.core)
			}
			resp, err := f.server().Prepare(c.ctx, c.req)
			checkStatus(t, err, c.code, c.msg)
			checkEvents(t, f.log, c.events...)
			if err != nil {
				return
			}
			// A member's request goes on confined (rootfs and sandbox
			// opened with no symlink on the way), root's does not.
			prepared := proto.Clone(f.core.prepared).(*statev1.PrepareRequest)
			if member := strings.Contains(c.name, "member"); prepared.GetConfined() != member {
				t.Errorf("confined %v; want %v", prepared.GetConfined(), member)
			}
			prepared.Confined = false
			sameJSON(t, "PrepareRequest", c.req, prepared)
			if len(resp.GetMounts()) != 1 {
				t.Fatalf("mounts %v, want the isolator's one", resp.GetMounts())
			}
			sameJSON(t, "ContainerMount", inside, resp.GetMounts()[0])
		})
	}
}

// cancelled is ctx, cancelled.
func cancelled(ctx context.Context) context.Context {
	ctx, cancel := context.WithCancel(ctx)
	cancel()
	return ctx
}

// resolvingNamed resolves every named mount to a volume of plugin loop
// named after it, or fails with err.
type resolvingNamed struct {
	failingNamed
	err error
}

func (r resolvingNamed) Resolve(_ context.Context, mounts []namedvol.Mount, _ bool, use func([]*statev1.Volume) error) error {
	if r.err != nil {
		return r.err
	}
	var vols []*statev1.Volume
	for _, m := range mounts {
		vols = append(vols, &statev1.Volume{ContainerPath: m.ContainerPath, Source: &statev1.Volume_Source{
			CsiVolume: &statev1.CSIVolume{PluginName: "loop", StaticProvisioning: &statev1.StaticProvisioning{VolumeId: m.Name}}}})
	}
	return use(vols)
}

// TestPrepareNamedMounts: named mounts reach the isolator as volumes
// after the request's own; a member's are checked as any volume.
func TestPrepareNamedMounts(t *testing.T) {
	roots, rootfs := memberRoots(t)
	_, sandbox := memberRoots(t) // outside roots
	named := []*agentv1.NamedMount{{Name: "data", ContainerPath: "/named"}}
	for _, c := range []struct {
		name    string
		ctx     context.Context
		req     *agentv1.PrepareRequest
		named   resolvingNamed
		refusal error
		code    codes.Code
		msg     string
		events  []string
	}{
		{name: "root", ctx: caller(rootCred), req: &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: "/x", NamedMounts: named, Volumes: []*agentv1.Volume{{ContainerPath: "/own"}}},
			events: []string{"Prepare c1", "changed"}},
		{name: "a member's named mount on a host path", ctx: caller(memberCred),
			req:  &agentv1.PrepareRequest{ContainerId: "c1", Sandbox: filepath.Join(roots, "c1"), NamedMounts: named},
			code: codes.PermissionDenied, msg: `named_mounts[0].container_path "/named" is absolute and the request has no rootfs`},
		{name: "a member, below the roots", ctx: caller(memberCred), req: &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: rootfs, NamedMounts: named},
			events: []string{"Prepare c1", "changed"}},
		{name: "a member, its sandbox outside", ctx: caller(memberCred), req: &agentv1.PrepareRequest{ContainerId: "c1", Sandbox: sandbox, NamedMounts: named},
			code: codes.PermissionDenied, msg: "is not under any --api-group-roots prefix"},
		{name: "no such name", ctx: caller(rootCred), req: &agentv1.PrepareRequest{ContainerId: "c1", NamedMounts: named},
			named: resolvingNamed{err: fmt.Errorf("%w: data", namedvol.ErrNotFound)}, code: codes.NotFound, msg: "data"},
		{name: "the isolator refuses a named mount's volume", ctx: caller(rootCred),
			req:     &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: "/x", NamedMounts: named, Volumes: []*agentv1.Volume{{ContainerPath: "/own"}}},
			refusal: &isolator.VolumeError{Index: 1, Err: fmt.Errorf("%w: container_path contains a NUL byte", isolator.ErrInvalid)},
			code:    codes.InvalidArgument, msg: "invalid request: named_mounts[0] (data): container_path contains a NUL byte",
			events: []string{"Prepare c1", "changed"}},
		{name: "the isolator refuses a volume of the request's own", ctx: caller(rootCred),
			req:     &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: "/x", NamedMounts: named, Volumes: []*agentv1.Volume{{ContainerPath: "/own"}}},
			refusal: &isolator.VolumeError{Index: 0, Err: fmt.Errorf("%w: mode is required", isolator.ErrInvalid)},
			code:    codes.InvalidArgument, msg: "invalid request: volumes[0]: mode is required",
			events: []string{"Prepare c1", "changed"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture()
			f.members = Members{Roots: []string{roots}}
			f.core.prepareErr = c.refusal
			s := f.server()
			s.cfg.Named = c.named
			_, err := s.Prepare(c.ctx, c.req)
			checkStatus(t, err, c.code, c.msg)
			checkEvents(t, f.log, c.events...)
			if err != nil {
				return
			}
			var paths []string
			for _, v := range f.core.prepared.GetVolumes() {
				paths = append(paths, v.GetContainerPath()+"="+v.GetSource().GetCsiVolume().GetStaticProvisioning().GetVolumeId())
			}
			if want := len(c.req.GetVolumes()) + 1; len(paths) != want || paths[want-1] != "/named=data" {
				t.Errorf("the isolator was asked for %q, want the request's volumes, then /named=data", paths)
			}
		})
	}
}

func TestCleanupHandler(t *testing.T) {
	containers := []isolator.ContainerInfo{
		{ID: "mine", Rootfs: "/srv/roots/a/rootfs", Mounts: []*statev1.ContainerMount{{MountPoint: "/srv/roots/a/rootfs/data"}}},
		{ID: "theirs", Rootfs: "/var/lib/x/rootfs"},
	}
	for _, c := range []struct {
		name   string
		ctx    context.Context
		req    *agentv1.CleanupRequest
		core   func(*fakeCore)
		code   codes.Code
		msg    string
		events []string
	}{
		{name: "root", ctx: caller(rootCred), req: &agentv1.CleanupRequest{ContainerId: "theirs", Force: true}, events: []string{"Cleanup theirs force=true", "changed"}},
		{name: "an engine mount's id", ctx: caller(rootCred), req: &agentv1.CleanupRequest{ContainerId: namedvol.EngineMountPrefix + "m1"},
			code: codes.InvalidArgument, msg: "release them through the engine"},
		{name: "no peer credentials", ctx: context.Background(), req: &agentv1.CleanupRequest{ContainerId: "mine"}, code: codes.Unauthenticated},
		{name: "not recovered yet", ctx: cancelled(caller(rootCred)), req: &agentv1.CleanupRequest{ContainerId: "mine"}, core: func(f *fakeCore) { f.notRecovered = true },
			code: codes.Unavailable, msg: "still recovering"},
		{name: "the isolator refuses", ctx: caller(rootCred), req: &agentv1.CleanupRequest{ContainerId: "mine"},
			core: func(f *fakeCore) { f.cleanupErr = fmt.Errorf("%w: a volume is busy", isolator.ErrPrecondition) },
			code: codes.FailedPrecondition, msg: "a volume is busy", events: []string{"Cleanup mine force=false", "changed"}},
		{name: "a member's own container", ctx: caller(memberCred), req: &agentv1.CleanupRequest{ContainerId: "mine"}, events: []string{"Cleanup mine force=false", "changed"}},
		{name: "a member, another's container", ctx: caller(memberCred), req: &agentv1.CleanupRequest{ContainerId: "theirs"},
			code: codes.PermissionDenied, msg: `its rootfs "/var/lib/x/rootfs" is not under`},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture()
			f.members = Members{Roots: []string{"/srv/roots"}}
			f.core.containers = containers
			if c.core != nil {
				c.core(&f.core)
			}
			_, err := f.server().Cleanup(c.ctx, c.req)
			checkStatus(t, err, c.code, c.msg)
			checkEvents(t, f.log, c.events...)
		})
	}
}

func TestReconcileHandler(t *testing.T) {
	for _, c := range []struct {
		name   string
		ctx    context.Context
		req    *agentv1.ReconcileRequest
		core   func(*fakeCore)
		code   codes.Code
		msg    string
		events []string
	}{
		{name: "root: engine mounts are kept", ctx: caller(rootCred), req: &agentv1.ReconcileRequest{LiveContainerIds: []string{"c1"}, Manager: "nomad"},
			events: []string{`Reconcile [c1 engine+m1] manager="nomad"`, "changed"}},
		{name: "a member", ctx: caller(memberCred), req: &agentv1.ReconcileRequest{}, code: codes.PermissionDenied, msg: "only root may call it"},
		{name: "no peer credentials", ctx: context.Background(), req: &agentv1.ReconcileRequest{}, code: codes.Unauthenticated},
		{name: "a bad live id", ctx: caller(rootCred), req: &agentv1.ReconcileRequest{LiveContainerIds: []string{"c1", "bad id"}},
			code: codes.InvalidArgument, msg: `live_container_ids[1] "bad id"`},
		{name: "not recovered yet", ctx: cancelled(caller(rootCred)), req: &agentv1.ReconcileRequest{}, core: func(f *fakeCore) { f.notRecovered = true },
			code: codes.Unavailable, msg: "still recovering"},
	} {
		t.Run(c.name, func(t *testing.T) {
			f := newFixture()
			f.core.containers = []isolator.ContainerInfo{{ID: "c1"}, {ID: "c2"}, {ID: namedvol.EngineMountPrefix + "m1"}}
			f.core.reconciled = isolator.ReconcileResult{CleanedUp: []string{"c2"}, Failed: map[string]string{"c3": "busy"}}
			if c.core != nil {
				c.core(&f.core)
			}
			resp, err := f.server().Reconcile(c.ctx, c.req)
			checkStatus(t, err, c.code, c.msg)
			checkEvents(t, f.log, c.events...)
			if err == nil && (!slices.Equal(resp.GetCleanedUp(), []string{"c2"}) || resp.GetFailed()["c3"] != "busy" || len(resp.GetFailed()) != 1) {
				t.Errorf("response %v, want the isolator's result", resp)
			}
		})
	}
}

func TestListVolumesHandler(t *testing.T) {
	now := time.Unix(1700000000, 0).UTC()
	persisted, scheduled, rotation := now.Add(time.Hour), now.Add(2*time.Hour), now.Add(3*time.Hour)
	for _, refresh := range []bool{false, true} {
		f := newFixture()
		f.core.volumes = []isolator.VolumeInfo{
			{Plugin: "loop", ID: "pub", State: statev1.VolumeCheckpoint_PUBLISHED, TargetPath: "/t", Users: []string{"c1"}},
			{Plugin: "loop", ID: "persisted", State: statev1.VolumeCheckpoint_PUBLISHED, NextReclaim: persisted, NextKeyRotation: persisted},
			{Plugin: "loop", ID: "staged", State: statev1.VolumeCheckpoint_VOL_READY},
		}
		f.stats.stats = map[string]volumestats.Stats{
			"loop/pub":    {At: now, Bytes: volumestats.Usage{Known: true, Total: 100, Used: 40, Available: 60}, Err: errors.New("slow")},
			"loop/staged": {At: now, Bytes: volumestats.Usage{Known: true, Total: 1}},
		}
		f.schedules.nextReclaim = map[string]time.Time{"loop/pub": scheduled, "loop/persisted": scheduled, "loop/staged": scheduled}
		f.schedules.nextRotate = map[string]time.Time{"loop/pub": rotation, "loop/persisted": rotation}
		resp, err := f.server().ListVolumes(caller(memberCred), &agentv1.ListVolumesRequest{RefreshStats: refresh})
		if err != nil {
			t.Fatal(err)
		}
		if refresh {
			checkEvents(t, f.log, "Refresh")
		} else {
			checkEvents(t, f.log)
		}
		vols := resp.GetVolumes()
		if len(vols) != 3 {
			t.Fatalf("%d volumes, want 3", len(vols))
		}
		pub, pers, staged := vols[0], vols[1], vols[2]
		if pub.GetVolumeId() != "pub" || pub.GetTargetPath() != "/t" || pub.GetContainers()[0] != "c1" || pub.GetState() != agentv1.VolumeStatus_PUBLISHED {
			t.Errorf("volume %v, want the isolator's", pub)
		}
		if st := pub.GetStats(); st.GetCapacityBytes() != 100 || st.GetUsedBytes() != 40 || !st.GetTime().AsTime().Equal(now) || st.GetError() != "slow" {
			t.Errorf("stats %v, want the poller's", st)
		}
		if staged.GetStats() != nil {
			t.Errorf("a volume not published has stats %v; only published ones show them", staged.GetStats())
		}
		for _, c := range []struct {
			what      string
			got, want *timestamppb.Timestamp
		}{
			{"pub's next reclaim (the schedule's)", pub.GetNextReclaim(), timestamppb.New(scheduled)},
			{"pub's next key rotation (the schedule's)", pub.GetNextKeyRotation(), timestamppb.New(rotation)},
			{"persisted's next reclaim (the isolator's)", pers.GetNextReclaim(), timestamppb.New(persisted)},
			{"persisted's next key rotation (the isolator's)", pers.GetNextKeyRotation(), timestamppb.New(persisted)},
			{"staged's next reclaim", staged.GetNextReclaim(), timestamppb.New(scheduled)},
			{"staged's next key rotation (none)", staged.GetNextKeyRotation(), nil},
		} {
			if !c.got.AsTime().Equal(c.want.AsTime()) || (c.got == nil) != (c.want == nil) {
				t.Errorf("%s: %v, want %v", c.what, c.got, c.want)
			}
		}
	}
}

func TestListContainersHandler(t *testing.T) {
	f := newFixture()
	f.core.containers = []isolator.ContainerInfo{
		{ID: "c1", Phase: statev1.ContainerCheckpoint_PREPARED, Rootfs: "/r", Manager: "nomad", Mounts: []*statev1.ContainerMount{{VolumeId: "v1", MountPoint: "/r/data"}}},
		{ID: "c2", Phase: statev1.ContainerCheckpoint_CLEANING, LastError: "busy"},
	}
	resp, err := f.server().ListContainers(caller(memberCred), &agentv1.ListContainersRequest{})
	if err != nil {
		t.Fatal(err)
	}
	cs := resp.GetContainers()
	if len(cs) != 2 {
		t.Fatalf("%d containers, want 2", len(cs))
	}
	for i, want := range f.core.containers {
		sameJSON(t, "ContainerStatus", ContainerStatus(want), cs[i])
	}
	if cs[0].GetMounts()[0].GetMountPoint() != "/r/data" || cs[1].GetPhase() != agentv1.ContainerStatus_CLEANING || cs[1].GetLastError() != "busy" {
		t.Errorf("containers %v, want the isolator's", cs)
	}
}

func TestPluginHandlers(t *testing.T) {
	f := newFixture()
	f.plugins.statuses = []*agentv1.Plugin{{Type: "loop"}, {Type: "nfs"}}
	f.plugins.fileErrs = []*pluginconfig.FileError{{File: "bad.json", Err: errors.New("not JSON")}}
	s := f.server()
	list, err := s.ListPlugins(context.Background(), &agentv1.ListPluginsRequest{})
	if err != nil || len(list.GetPlugins()) != 2 || len(list.GetConfigErrors()) != 1 || list.GetConfigErrors()[0].GetError() != "not JSON" {
		t.Errorf("ListPlugins = %v, %v; want the plugins and the refused file", list, err)
	}
	got, err := s.GetPlugin(context.Background(), &agentv1.GetPluginRequest{Type: "nfs"})
	if err != nil || got.GetPlugin().GetType() != "nfs" {
		t.Errorf("GetPlugin nfs = %v, %v", got, err)
	}
	_, err = s.GetPlugin(context.Background(), &agentv1.GetPluginRequest{Type: "zfs"})
	checkStatus(t, err, codes.NotFound, `no plugin of type "zfs" in /etc/csi-agent/plugins.d`)
	_, err = s.GetPlugin(context.Background(), &agentv1.GetPluginRequest{})
	checkStatus(t, err, codes.InvalidArgument, "type is required")

	f.configured = make(chan struct{}) // never configured
	_, err = f.server().ListPlugins(cancelled(context.Background()), &agentv1.ListPluginsRequest{})
	checkStatus(t, err, codes.Unavailable, "has not read its config directory yet")
}

// TestWatchPlugins: the list is sent now and at every change, until the
// caller leaves or the agent stops.
func TestWatchPlugins(t *testing.T) {
	f := newFixture()
	f.plugins.statuses = []*agentv1.Plugin{{Type: "loop"}}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stream := &fakeStream[agentv1.ListPluginsResponse]{ctx: ctx}
	stream.onSend = func() {
		switch len(stream.sent) {
		case 1: // a change
			close(f.plugins.changes[len(f.plugins.changes)-1])
		case 2: // the caller leaves
			cancel()
		}
	}
	err := f.server().WatchPlugins(&agentv1.ListPluginsRequest{}, stream)
	if !errors.Is(err, context.Canceled) || len(stream.sent) != 2 || stream.sent[1].GetPlugins()[0].GetType() != "loop" {
		t.Errorf("WatchPlugins ended with %v after sending %v; want the list twice, then the caller's context error", err, stream.sent)
	}

	close(f.stopping)
	stream = &fakeStream[agentv1.ListPluginsResponse]{ctx: context.Background()}
	err = f.server().WatchPlugins(&agentv1.ListPluginsRequest{}, stream)
	checkStatus(t, err, codes.Unavailable, "shutting down")
	if len(stream.sent) != 1 {
		t.Errorf("sent %d lists before shutting down, want 1", len(stream.sent))
	}
}
