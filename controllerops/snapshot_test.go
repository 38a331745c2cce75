package controllerops

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/snapcat"
)

// fakeSnapshotter is a CSI controller and group controller with
// snapshots: a snapshot is ready at the second call of its create.
type fakeSnapshotter struct {
	csi.UnimplementedControllerServer
	csi.UnimplementedGroupControllerServer
	mu      sync.Mutex
	creates map[string]int
	deleted []string
	groups  []*csi.CreateVolumeGroupSnapshotRequest
}

func (f *fakeSnapshotter) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: []*csi.ControllerServiceCapability{{Type: &csi.ControllerServiceCapability_Rpc{
		Rpc: &csi.ControllerServiceCapability_RPC{Type: csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT}}}}}, nil
}

func (f *fakeSnapshotter) CreateSnapshot(_ context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if req.GetName() == "csi-agent-taken" {
		return nil, status.Error(codes.AlreadyExists, "another volume's snapshot has that name")
	}
	f.creates[req.GetName()]++
	return &csi.CreateSnapshotResponse{Snapshot: &csi.Snapshot{SnapshotId: "id-" + req.GetName(), SourceVolumeId: req.GetSourceVolumeId(),
		SizeBytes: 1 << 20, ReadyToUse: f.creates[req.GetName()] > 1}}, nil
}

func (f *fakeSnapshotter) DeleteSnapshot(_ context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleted = append(f.deleted, req.GetSnapshotId())
	return &csi.DeleteSnapshotResponse{}, nil
}

func (f *fakeSnapshotter) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: []*csi.GroupControllerServiceCapability{{Type: &csi.GroupControllerServiceCapability_Rpc{
		Rpc: &csi.GroupControllerServiceCapability_RPC{Type: csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT}}}}}, nil
}

func (f *fakeSnapshotter) CreateVolumeGroupSnapshot(_ context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.groups = append(f.groups, req)
	gs := &csi.VolumeGroupSnapshot{GroupSnapshotId: "g-" + req.GetName(), ReadyToUse: true}
	for _, v := range req.GetSourceVolumeIds() {
		gs.Snapshots = append(gs.Snapshots, &csi.Snapshot{SnapshotId: "s-" + v, SourceVolumeId: v, ReadyToUse: true, SizeBytes: 10})
	}
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: gs}, nil
}

func (f *fakeSnapshotter) DeleteVolumeGroupSnapshot(_ context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.deleted = append(f.deleted, req.GetGroupSnapshotId()+":"+strings.Join(req.GetSnapshotIds(), ","))
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}

// snapPlugins serves the fake controller for plugin p; named volume
// "data" is p's v1; container c1 has block volumes b1, b2 of p, c2 has
// volumes of p and q, c3 a volume not published.
type snapPlugins struct {
	fakePlugins
	ctrl *grpc.ClientConn
}

func (p snapPlugins) ControllerConn(context.Context, string, string) (*grpc.ClientConn, error) {
	return p.ctrl, nil
}
func (p snapPlugins) NamedVolume(name string) (string, string, error) {
	if name == "data" {
		return "p", "v1", nil
	}
	return "", "", errors.New("no such named volume")
}
func (p snapPlugins) ContainerVolumes(id string) ([]VolumeRef, bool) {
	switch id {
	case "c1":
		return []VolumeRef{{"p", "b1"}, {"p", "b2"}}, true
	case "c2":
		return []VolumeRef{{"p", "b1"}, {"q", "x"}}, true
	case "c3":
		return []VolumeRef{{"p", "gone"}}, true
	}
	return nil, false
}
func (p snapPlugins) Published(plugin, id string) (PublishedVolume, bool) {
	return PublishedVolume{TargetPath: "/nonexistent/" + id, Block: true}, plugin == "p" && strings.HasPrefix(id, "b")
}

type snapTest struct {
	t      *testing.T
	api    agentv1.ControllerClient
	plugin *fakeSnapshotter
	cat    *snapcat.Catalogue
	dir    string
	crash  func(string)
}

func newSnapTest(t *testing.T) *snapTest {
	st := &snapTest{t: t, plugin: &fakeSnapshotter{creates: map[string]int{}}, dir: t.TempDir(), crash: func(string) {}}
	var err error
	if st.cat, err = snapcat.Open(st.dir, slog.New(slog.DiscardHandler)); err != nil {
		t.Fatal(err)
	}
	ctrl := serveUnix(t, func(s *grpc.Server) {
		csi.RegisterControllerServer(s, st.plugin)
		csi.RegisterGroupControllerServer(s, st.plugin)
	})
	st.api = agentv1.NewControllerClient(serveUnix(t, func(s *grpc.Server) {
		agentv1.RegisterControllerServer(s, New(Config{Plugins: snapPlugins{ctrl: ctrl}, Catalogue: st.cat, Log: slog.New(slog.DiscardHandler),
			CrashPoint: func(p string) { st.crash(p) }}))
	}))
	return st
}

var fastRetry = &agentv1.RetryPolicy{InitialBackoff: durationpb.New(10 * time.Millisecond), MaxAttempts: 2}

// drain reads a stream to its end: its progress kinds and last message.
func drain[R any, P interface {
	*R
	GetProgress() *agentv1.Progress
}](stream grpc.ServerStreamingClient[R], err error) (kinds []agentv1.Progress_Kind, last *R, _ error) {
	if err != nil {
		return nil, nil, err
	}
	for {
		m, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return kinds, last, nil
		}
		if err != nil {
			return kinds, last, err
		}
		if p := P(m).GetProgress(); p != nil {
			kinds = append(kinds, p.GetKind())
			continue
		}
		last = m
	}
}

func (st *snapTest) ctx() context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	st.t.Cleanup(cancel)
	return ctx
}

// TestCreateSnapshotRecordsAndWaits: a named volume's snapshot is cut
// under the derived name, waited for until ready, and in the catalogue;
// the same create again is no new snapshot; another volume under that
// name is AlreadyExists; one the plugin refuses leaves no intent; rm
// deletes it at the plugin and in the catalogue.
func TestCreateSnapshotRecordsAndWaits(t *testing.T) {
	st := newSnapTest(t)
	kinds, last, err := drain(st.api.CreateSnapshot(st.ctx(), &agentv1.CreateSnapshotRequest{Name: "s1", NamedVolume: "data", Retry: fastRetry}))
	if err != nil {
		t.Fatal(err)
	}
	snap := last.GetSnapshot()
	if len(kinds) != 1 || kinds[0] != agentv1.Progress_NOT_READY || !snap.GetReadyToUse() || snap.GetSnapshotId() != "id-csi-agent-s1" || snap.GetPluginName() != "p" || snap.GetNamedVolume() != "data" {
		t.Fatalf("create: progress %v, result %v", kinds, snap)
	}
	e, err := st.cat.Get("s1")
	if err != nil || e.Intent || e.SnapshotID != "id-csi-agent-s1" || e.SourceVolumes[0] != "v1" {
		t.Fatalf("catalogue after create: %+v, %v", e, err)
	}
	if _, _, err := drain(st.api.CreateSnapshot(st.ctx(), &agentv1.CreateSnapshotRequest{Name: "s1", NamedVolume: "data", Retry: fastRetry})); err != nil || st.plugin.creates["csi-agent-s1"] != 2 {
		t.Errorf("create again: %v, plugin creates %v (want none more)", err, st.plugin.creates)
	}
	_, _, err = drain(st.api.CreateSnapshot(st.ctx(), &agentv1.CreateSnapshotRequest{Name: "s1", PluginName: "p", SourceVolumeId: "v2", Retry: fastRetry}))
	if status.Code(err) != codes.AlreadyExists {
		t.Errorf("same name, another volume: %v, want AlreadyExists", err)
	}
	_, _, err = drain(st.api.CreateSnapshot(st.ctx(), &agentv1.CreateSnapshotRequest{Name: "taken", PluginName: "p", SourceVolumeId: "v2", Retry: fastRetry}))
	if _, gerr := st.cat.Get("taken"); status.Code(err) != codes.AlreadyExists || !errors.Is(gerr, snapcat.ErrNotFound) {
		t.Errorf("a create the plugin refuses: %v; its intent: %v (want removed)", err, gerr)
	}
	list, err := st.api.ListSnapshots(st.ctx(), &agentv1.ListSnapshotsRequest{})
	if err != nil || len(list.GetSnapshots()) != 1 {
		t.Errorf("ls: %v, %v", list, err)
	}
	if _, _, err := drain(st.api.DeleteSnapshot(st.ctx(), &agentv1.DeleteSnapshotRequest{Name: "s1", Retry: fastRetry})); err != nil {
		t.Fatal(err)
	}
	if _, err := st.cat.Get("s1"); !errors.Is(err, snapcat.ErrNotFound) || strings.Join(st.plugin.deleted, ",") != "id-csi-agent-s1" {
		t.Errorf("after rm: catalogue %v, plugin deleted %v", err, st.plugin.deleted)
	}
	if _, _, err := drain(st.api.DeleteSnapshot(st.ctx(), &agentv1.DeleteSnapshotRequest{Name: "s1"})); status.Code(err) != codes.NotFound {
		t.Errorf("rm of an unknown name: %v, want NotFound", err)
	}
}

// TestCreateSnapshotAfterCrash: an intent left by a crash between the
// record and the plugin's answer is completed by running the create
// again, under the same CSI name; rm refuses it meanwhile.
func TestCreateSnapshotAfterCrash(t *testing.T) {
	st := newSnapTest(t)
	if err := st.cat.Put(&snapcat.Entry{Name: "s2", Kind: snapcat.KindSnapshot, Plugin: "p", SourceVolumes: []string{"v7"}, Intent: true}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := drain(st.api.DeleteSnapshot(st.ctx(), &agentv1.DeleteSnapshotRequest{Name: "s2"})); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "interrupted") {
		t.Errorf("rm of an interrupted create: %v, want FailedPrecondition saying so", err)
	}
	if _, _, err := drain(st.api.CreateSnapshot(st.ctx(), &agentv1.CreateSnapshotRequest{Name: "s2", PluginName: "p", SourceVolumeId: "v7", Retry: fastRetry})); err != nil {
		t.Fatal(err)
	}
	if e, err := st.cat.Get("s2"); err != nil || e.Intent || !e.Ready || e.SnapshotID != "id-csi-agent-s2" {
		t.Errorf("after the re-run: %+v, %v", e, err)
	}
}

// TestContainerGroupSnapshot: a container's volumes are snapshotted
// together, its freeze record written before the plugin is called and
// removed after; block volumes get a NOTE; volumes of two plugins or not
// published are refused; delete works by name.
func TestContainerGroupSnapshot(t *testing.T) {
	st := newSnapTest(t)
	var recorded bool
	st.crash = func(p string) {
		_, err := os.Stat(st.dir + "/frozen/nightly.json")
		recorded = p == CrashFrozen && err == nil
	}
	kinds, last, err := drain(st.api.CreateGroupSnapshot(st.ctx(), &agentv1.CreateGroupSnapshotRequest{Name: "nightly", ContainerId: "c1", Retry: fastRetry,
		FreezeTimeout: durationpb.New(5 * time.Second)}))
	if err != nil {
		t.Fatal(err)
	}
	if !recorded || len(kinds) != 2 || kinds[0] != agentv1.Progress_NOTE || last.GetGroupSnapshot().GetGroupSnapshotId() != "g-nightly" {
		t.Fatalf("create: freeze record there when frozen %v, progress %v, result %v", recorded, kinds, last)
	}
	if _, err := os.Stat(st.dir + "/frozen/nightly.json"); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("freeze record left after the thaw: %v", err)
	}
	e, err := st.cat.Get("nightly")
	if err != nil || e.Container != "c1" || e.Members["b2"] != "s-b2" || e.SizeBytes != 20 {
		t.Fatalf("catalogue: %+v, %v", e, err)
	}
	for c, want := range map[string]codes.Code{"c2": codes.FailedPrecondition, "c3": codes.FailedPrecondition, "c4": codes.NotFound} {
		_, _, err := drain(st.api.CreateGroupSnapshot(st.ctx(), &agentv1.CreateGroupSnapshotRequest{Name: "x" + c, ContainerId: c, Retry: fastRetry}))
		if status.Code(err) != want {
			t.Errorf("container %s: %v, want %v", c, err, want)
		}
	}
	for _, name := range []string{"xc2", "xc3", "xc4"} {
		if _, err := st.cat.Get(name); !errors.Is(err, snapcat.ErrNotFound) {
			t.Errorf("a refused create (nothing made) left %s in the catalogue: %v", name, err)
		}
	}
	if _, _, err := drain(st.api.DeleteGroupSnapshot(st.ctx(), &agentv1.DeleteGroupSnapshotRequest{Name: "nightly", Retry: fastRetry})); err != nil {
		t.Fatal(err)
	}
	if _, err := st.cat.Get("nightly"); !errors.Is(err, snapcat.ErrNotFound) || st.plugin.deleted[0] != "g-nightly:s-b1,s-b2" {
		t.Errorf("after delete: %v, plugin deleted %v", err, st.plugin.deleted)
	}
}
