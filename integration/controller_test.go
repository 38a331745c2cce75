package integration

import (
	"context"
	"errors"
	"io"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/internal/redact"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/fence"
	"github.com/csiagent/csiagent/proto/replication"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

// fakeController is a scripted controller plugin served in-process on a
// unix socket: CSI Identity and Node (what discovery needs), csi-addons
// volumegroup.Controller and replication.Controller, and CSI's
// GroupController. Each method answers the steps scripted for it in
// order, then its default answer; calls are counted and their requests
// kept. Discovery's empty requests are answered InvalidArgument (the
// service is present) and not counted.
type fakeController struct {
	mu       sync.Mutex
	armed    bool
	steps    map[string][]fakeStep
	calls    map[string]int
	requests map[string][]proto.Message
	// inflight and maxInflight count concurrent calls per object id.
	inflight, maxInflight map[string]int
	groupCaps             []csi.GroupControllerServiceCapability_RPC_Type
}

// fakeStep is one scripted answer: an error code (OK: resp, or the
// default), after block is closed if set.
type fakeStep struct {
	code  codes.Code
	msg   string
	resp  proto.Message
	block <-chan struct{}
}

func fail(code codes.Code, msg string) fakeStep { return fakeStep{code: code, msg: msg} }

func newFakeController() *fakeController {
	return &fakeController{
		steps: map[string][]fakeStep{}, calls: map[string]int{}, requests: map[string][]proto.Message{},
		inflight: map[string]int{}, maxInflight: map[string]int{},
		groupCaps: []csi.GroupControllerServiceCapability_RPC_Type{csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT},
	}
}

// arm starts counting (after discovery) with a clean slate.
func (f *fakeController) arm() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.armed = true
	f.calls, f.requests, f.steps = map[string]int{}, map[string][]proto.Message{}, map[string][]fakeStep{}
}

func (f *fakeController) script(method string, steps ...fakeStep) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.steps[method] = append(f.steps[method], steps...)
}

func (f *fakeController) count(method string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[method]
}

func (f *fakeController) request(method string, i int) proto.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	if i >= len(f.requests[method]) {
		return nil
	}
	return f.requests[method][i]
}

// answer takes method's next step for req (about object key) and answers
// it, or def() when nothing is scripted.
func answer[T proto.Message](ctx context.Context, f *fakeController, method, key string, req proto.Message, def func() T) (T, error) {
	var zero T
	f.mu.Lock()
	if !f.armed {
		f.mu.Unlock()
		return zero, status.Error(codes.InvalidArgument, "not armed")
	}
	f.calls[method]++
	f.requests[method] = append(f.requests[method], proto.Clone(req))
	var st fakeStep
	if q := f.steps[method]; len(q) > 0 {
		st, f.steps[method] = q[0], q[1:]
	}
	f.inflight[key]++
	f.maxInflight[key] = max(f.maxInflight[key], f.inflight[key])
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.inflight[key]--
		f.mu.Unlock()
	}()
	if st.block != nil {
		select {
		case <-st.block:
		case <-ctx.Done():
			return zero, status.FromContextError(ctx.Err()).Err()
		}
	}
	if st.code != codes.OK {
		return zero, status.Error(st.code, st.msg)
	}
	if st.resp != nil {
		return st.resp.(T), nil
	}
	return def(), nil
}

type fakeIdentity struct {
	csi.UnimplementedIdentityServer
}

func (fakeIdentity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: "fake.csi.csiagent.io", VendorVersion: "1.0.0"}, nil
}

func (fakeIdentity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	svc := func(t csi.PluginCapability_Service_Type) *csi.PluginCapability {
		return &csi.PluginCapability{Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}}}
	}
	return &csi.GetPluginCapabilitiesResponse{Capabilities: []*csi.PluginCapability{
		svc(csi.PluginCapability_Service_CONTROLLER_SERVICE), svc(csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE),
	}}, nil
}

func (fakeIdentity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

type fakeNode struct {
	csi.UnimplementedNodeServer
}

func (fakeNode) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{}, nil
}

func (fakeNode) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: "node-1"}, nil
}

func fakeGroup(id string, volumeIDs ...string) *volumegroup.VolumeGroup {
	g := &volumegroup.VolumeGroup{VolumeGroupId: id}
	for _, v := range volumeIDs {
		g.Volumes = append(g.Volumes, &volumegroup.VgVolume{VolumeId: v, CapacityBytes: 1 << 20})
	}
	return g
}

type fakeVG struct {
	volumegroup.UnimplementedControllerServer
	f *fakeController
}

func (s fakeVG) CreateVolumeGroup(ctx context.Context, req *volumegroup.CreateVolumeGroupRequest) (*volumegroup.CreateVolumeGroupResponse, error) {
	return answer(ctx, s.f, "CreateVolumeGroup", req.GetName(), req, func() *volumegroup.CreateVolumeGroupResponse {
		return &volumegroup.CreateVolumeGroupResponse{VolumeGroup: fakeGroup("vg-"+req.GetName(), req.GetVolumeIds()...)}
	})
}

func (s fakeVG) ModifyVolumeGroupMembership(ctx context.Context, req *volumegroup.ModifyVolumeGroupMembershipRequest) (*volumegroup.ModifyVolumeGroupMembershipResponse, error) {
	return answer(ctx, s.f, "ModifyVolumeGroupMembership", req.GetVolumeGroupId(), req, func() *volumegroup.ModifyVolumeGroupMembershipResponse {
		return &volumegroup.ModifyVolumeGroupMembershipResponse{VolumeGroup: fakeGroup(req.GetVolumeGroupId(), req.GetVolumeIds()...)}
	})
}

func (s fakeVG) DeleteVolumeGroup(ctx context.Context, req *volumegroup.DeleteVolumeGroupRequest) (*volumegroup.DeleteVolumeGroupResponse, error) {
	return answer(ctx, s.f, "DeleteVolumeGroup", req.GetVolumeGroupId(), req, func() *volumegroup.DeleteVolumeGroupResponse {
		return &volumegroup.DeleteVolumeGroupResponse{}
	})
}

func (s fakeVG) ListVolumeGroups(ctx context.Context, req *volumegroup.ListVolumeGroupsRequest) (*volumegroup.ListVolumeGroupsResponse, error) {
	return answer(ctx, s.f, "ListVolumeGroups", "", req, func() *volumegroup.ListVolumeGroupsResponse {
		return &volumegroup.ListVolumeGroupsResponse{}
	})
}

func (s fakeVG) ControllerGetVolumeGroup(ctx context.Context, req *volumegroup.ControllerGetVolumeGroupRequest) (*volumegroup.ControllerGetVolumeGroupResponse, error) {
	if req.GetVolumeGroupId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_group_id is required")
	}
	return answer(ctx, s.f, "ControllerGetVolumeGroup", req.GetVolumeGroupId(), req, func() *volumegroup.ControllerGetVolumeGroupResponse {
		return &volumegroup.ControllerGetVolumeGroupResponse{VolumeGroup: fakeGroup(req.GetVolumeGroupId(), "v1")}
	})
}

type fakeRepl struct {
	replication.UnimplementedControllerServer
	f *fakeController
}

// replKey is the object a replication request is about.
func replKey(src *replication.ReplicationSource) string {
	if id := src.GetVolumegroup().GetVolumeGroupId(); id != "" {
		return "group:" + id
	}
	return "volume:" + src.GetVolume().GetVolumeId()
}

func (s fakeRepl) EnableVolumeReplication(ctx context.Context, req *replication.EnableVolumeReplicationRequest) (*replication.EnableVolumeReplicationResponse, error) {
	return answer(ctx, s.f, "EnableVolumeReplication", replKey(req.GetReplicationSource()), req, func() *replication.EnableVolumeReplicationResponse {
		return &replication.EnableVolumeReplicationResponse{}
	})
}

func (s fakeRepl) DisableVolumeReplication(ctx context.Context, req *replication.DisableVolumeReplicationRequest) (*replication.DisableVolumeReplicationResponse, error) {
	return answer(ctx, s.f, "DisableVolumeReplication", replKey(req.GetReplicationSource()), req, func() *replication.DisableVolumeReplicationResponse {
		return &replication.DisableVolumeReplicationResponse{}
	})
}

func (s fakeRepl) PromoteVolume(ctx context.Context, req *replication.PromoteVolumeRequest) (*replication.PromoteVolumeResponse, error) {
	return answer(ctx, s.f, "PromoteVolume", replKey(req.GetReplicationSource()), req, func() *replication.PromoteVolumeResponse {
		return &replication.PromoteVolumeResponse{}
	})
}

func (s fakeRepl) DemoteVolume(ctx context.Context, req *replication.DemoteVolumeRequest) (*replication.DemoteVolumeResponse, error) {
	return answer(ctx, s.f, "DemoteVolume", replKey(req.GetReplicationSource()), req, func() *replication.DemoteVolumeResponse {
		return &replication.DemoteVolumeResponse{}
	})
}

func (s fakeRepl) ResyncVolume(ctx context.Context, req *replication.ResyncVolumeRequest) (*replication.ResyncVolumeResponse, error) {
	return answer(ctx, s.f, "ResyncVolume", replKey(req.GetReplicationSource()), req, func() *replication.ResyncVolumeResponse {
		return &replication.ResyncVolumeResponse{Ready: true}
	})
}

func (s fakeRepl) GetReplicationDestinationInfo(ctx context.Context, req *replication.GetReplicationDestinationInfoRequest) (*replication.GetReplicationDestinationInfoResponse, error) {
	return answer(ctx, s.f, "GetReplicationDestinationInfo", replKey(req.GetReplicationSource()), req, func() *replication.GetReplicationDestinationInfoResponse {
		return &replication.GetReplicationDestinationInfoResponse{ReplicationDestination: &replication.ReplicationDestination{
			Type: &replication.ReplicationDestination_Volume{Volume: &replication.ReplicationDestination_VolumeDestination{VolumeId: "peer-" + req.GetReplicationSource().GetVolume().GetVolumeId()}}}}
	})
}

func (s fakeRepl) GetVolumeReplicationInfo(ctx context.Context, req *replication.GetVolumeReplicationInfoRequest) (*replication.GetVolumeReplicationInfoResponse, error) {
	if req.GetReplicationSource() == nil {
		return nil, status.Error(codes.InvalidArgument, "replication_source is required")
	}
	return answer(ctx, s.f, "GetVolumeReplicationInfo", replKey(req.GetReplicationSource()), req, func() *replication.GetVolumeReplicationInfoResponse {
		return &replication.GetVolumeReplicationInfoResponse{
			LastSyncTime:     timestamppb.New(time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)),
			LastSyncDuration: durationpb.New(90 * time.Second), LastSyncBytes: 4096,
			Status: replication.GetVolumeReplicationInfoResponse_DEGRADED, StatusMessage: "behind by 3 syncs",
		}
	})
}

type fakeGC struct {
	csi.UnimplementedGroupControllerServer
	f *fakeController
}

func (s fakeGC) GroupControllerGetCapabilities(ctx context.Context, req *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	s.f.mu.Lock()
	armed, types := s.f.armed, s.f.groupCaps
	s.f.mu.Unlock()
	if !armed {
		return &csi.GroupControllerGetCapabilitiesResponse{}, nil
	}
	return answer(ctx, s.f, "GroupControllerGetCapabilities", "", req, func() *csi.GroupControllerGetCapabilitiesResponse {
		resp := &csi.GroupControllerGetCapabilitiesResponse{}
		for _, t := range types {
			resp.Capabilities = append(resp.Capabilities, &csi.GroupControllerServiceCapability{
				Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{Type: t}},
			})
		}
		return resp
	})
}

func fakeGroupSnapshot(id string, ready bool, volumeIDs ...string) *csi.VolumeGroupSnapshot {
	g := &csi.VolumeGroupSnapshot{GroupSnapshotId: id, ReadyToUse: ready, CreationTime: timestamppb.New(time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC))}
	for _, v := range volumeIDs {
		g.Snapshots = append(g.Snapshots, &csi.Snapshot{SnapshotId: id + "-" + v, SourceVolumeId: v, GroupSnapshotId: id, ReadyToUse: ready, SizeBytes: 1 << 20})
	}
	return g
}

func (s fakeGC) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	return answer(ctx, s.f, "CreateVolumeGroupSnapshot", req.GetName(), req, func() *csi.CreateVolumeGroupSnapshotResponse {
		return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: fakeGroupSnapshot("gs-"+req.GetName(), true, req.GetSourceVolumeIds()...)}
	})
}

func (s fakeGC) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	return answer(ctx, s.f, "DeleteVolumeGroupSnapshot", req.GetGroupSnapshotId(), req, func() *csi.DeleteVolumeGroupSnapshotResponse {
		return &csi.DeleteVolumeGroupSnapshotResponse{}
	})
}

func (s fakeGC) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	return answer(ctx, s.f, "GetVolumeGroupSnapshot", req.GetGroupSnapshotId(), req, func() *csi.GetVolumeGroupSnapshotResponse {
		return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: fakeGroupSnapshot(req.GetGroupSnapshotId(), true, "v1")}
	})
}

// serveFakeController serves f on socket until the test ends.
func serveFakeController(t *testing.T, socket string, f *fakeController) {
	t.Helper()
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, fakeIdentity{})
	csi.RegisterNodeServer(srv, fakeNode{})
	csi.RegisterGroupControllerServer(srv, fakeGC{f: f})
	volumegroup.RegisterControllerServer(srv, fakeVG{f: f})
	replication.RegisterControllerServer(srv, fakeRepl{f: f})
	fence.RegisterFenceControllerServer(srv, fakeFence{f: f})
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = srv.Serve(lis)
	}()
	t.Cleanup(func() {
		srv.Stop()
		<-done
	})
}

// ctrlHarness is an in-process agent with the fake controller registered
// as the unmanaged plugin "fake" (controller and node on one socket).
type ctrlHarness struct {
	*harness
	fake   *fakeController
	client agentv1.ControllerClient
	logs   *logBuffer
}

func newCtrlHarness(t *testing.T) *ctrlHarness {
	t.Helper()
	h := newHarness(t)
	f := newFakeController()
	sock := filepath.Join(h.run, "fake.sock")
	serveFakeController(t, sock, f)
	h.writeConfig("fake.json", `{"type":"fake","endpoints":[`+
		`{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"},`+
		`{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"}]}`)
	// A node-only plugin on the same socket: no CONTROLLER_SERVICE.
	h.writeConfig("nodeonly.json", `{"type":"nodeonly","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"}]}`)
	logs := &logBuffer{}
	cfg := fastConfig(h)
	cfg.Logger = slogTo(io.MultiWriter(testWriter{t}, logs))
	h.start(cfg)
	p := h.waitPlugin("fake", "ready", ready)
	h.waitPlugin("nodeonly", "ready", ready)
	for _, svc := range []string{controllerops.VolumeGroupService, controllerops.ReplicationService, controllerops.GroupControllerService} {
		if !strings.Contains(strings.Join(p.Instances[0].AddonsServices, " "), svc) {
			t.Fatalf("discovery did not find %s: %v", svc, p.Instances[0].AddonsServices)
		}
	}
	f.arm()
	conn, err := grpc.NewClient("unix://"+h.cfg.APISocket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &ctrlHarness{harness: h, fake: f, client: agentv1.NewControllerClient(conn), logs: logs}
}

// fast is a retry policy for tests: 10 ms doubling to 80 ms.
func fast() *agentv1.RetryPolicy {
	return &agentv1.RetryPolicy{InitialBackoff: durationpb.New(10 * time.Millisecond), MaxBackoff: durationpb.New(80 * time.Millisecond)}
}

func fastAttempts(n uint32) *agentv1.RetryPolicy {
	p := fast()
	p.MaxAttempts = n
	return p
}

func opCtx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), waitTimeout)
	t.Cleanup(cancel)
	return c
}

// progressed is a reply message of the controller API.
type progressed[R any] interface {
	*R
	GetProgress() *agentv1.Progress
}

// collect reads an operation's stream: its progress messages, its result
// (the message without progress) and its error.
func collect[R any, P progressed[R]](stream grpc.ServerStreamingClient[R], err error) ([]*agentv1.Progress, *R, error) {
	if err != nil {
		return nil, nil, err
	}
	var progress []*agentv1.Progress
	var result *R
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return progress, result, nil
		}
		if err != nil {
			return progress, result, err
		}
		if p := P(msg).GetProgress(); p != nil {
			progress = append(progress, p)
			continue
		}
		result = msg
	}
}

// wantStatus checks err's code and that its message has every want.
func wantStatus(t *testing.T, err error, code codes.Code, want ...string) {
	t.Helper()
	st := status.Convert(err)
	if st.Code() != code {
		t.Fatalf("error = %v, want code %v", err, code)
	}
	for _, w := range want {
		if !strings.Contains(st.Message(), w) {
			t.Errorf("error message %q lacks %q", st.Message(), w)
		}
	}
}

func kinds(ps []*agentv1.Progress) []agentv1.Progress_Kind {
	var out []agentv1.Progress_Kind
	for _, p := range ps {
		out = append(out, p.GetKind())
	}
	return out
}

func TestControllerVolumeGroups(t *testing.T) {
	h := newCtrlHarness(t)
	c, f := h.client, h.fake
	secrets := map[string]string{"user": "admin", "password": "s3cr3t-vg"}

	// Create twice with the same name: the plugin sees the same request
	// (its idempotency key is the name) and answers the same group.
	req := &agentv1.CreateVolumeGroupRequest{PluginName: "fake", Name: "db", Parameters: map[string]string{"pool": "fast"},
		VolumeIds: []string{"v1", "v2"}, Secrets: secrets, Retry: fast()}
	var ids []string
	for range 2 {
		progress, res, err := collect(c.CreateVolumeGroup(opCtx(t), req))
		if err != nil || len(progress) != 0 {
			t.Fatalf("create: %v, progress %v", err, progress)
		}
		ids = append(ids, res.GetVolumeGroup().GetVolumeGroupId())
	}
	if ids[0] != "vg-db" || ids[1] != ids[0] || f.count("CreateVolumeGroup") != 2 {
		t.Errorf("create twice: ids %v, %d calls", ids, f.count("CreateVolumeGroup"))
	}
	got := f.request("CreateVolumeGroup", 0).(*volumegroup.CreateVolumeGroupRequest)
	want := &volumegroup.CreateVolumeGroupRequest{Name: "db", Parameters: map[string]string{"pool": "fast"}, Secrets: secrets, VolumeIds: []string{"v1", "v2"}}
	if !proto.Equal(got, want) {
		t.Errorf("plugin got %v, want %v", got, want)
	}

	// Modify.
	_, res, err := collect(c.ModifyVolumeGroup(opCtx(t), &agentv1.ModifyVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "vg-db",
		VolumeIds: []string{"v2", "v3"}, Parameters: map[string]string{"k": "v"}, Secrets: secrets}))
	if err != nil || len(res.GetVolumeGroup().GetVolumes()) != 2 || res.GetVolumeGroup().GetVolumes()[1].GetVolumeId() != "v3" {
		t.Fatalf("modify: %v %v", res, err)
	}
	if m := f.request("ModifyVolumeGroupMembership", 0).(*volumegroup.ModifyVolumeGroupMembershipRequest); m.GetVolumeGroupId() != "vg-db" ||
		strings.Join(m.GetVolumeIds(), ",") != "v2,v3" || m.GetParameters()["k"] != "v" || m.GetSecrets()["password"] != "s3cr3t-vg" {
		t.Errorf("modify request: %v", m)
	}
	// An empty list empties the group only when asked for explicitly.
	_, _, err = collect(c.ModifyVolumeGroup(opCtx(t), &agentv1.ModifyVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "vg-db"}))
	wantStatus(t, err, codes.InvalidArgument, "remove_all")
	if n := f.count("ModifyVolumeGroupMembership"); n != 1 {
		t.Errorf("an invalid request reached the plugin: %d calls", n)
	}
	_, res, err = collect(c.ModifyVolumeGroup(opCtx(t), &agentv1.ModifyVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "vg-db", RemoveAll: true}))
	if err != nil || len(res.GetVolumeGroup().GetVolumes()) != 0 || len(f.request("ModifyVolumeGroupMembership", 1).(*volumegroup.ModifyVolumeGroupMembershipRequest).GetVolumeIds()) != 0 {
		t.Errorf("modify remove_all: %v %v", res, err)
	}

	// Get and delete.
	_, res, err = collect(c.GetVolumeGroup(opCtx(t), &agentv1.GetVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "vg-db"}))
	if err != nil || res.GetVolumeGroup().GetVolumeGroupId() != "vg-db" {
		t.Errorf("get: %v %v", res, err)
	}
	_, done, err := collect(c.DeleteVolumeGroup(opCtx(t), &agentv1.DeleteVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "vg-db", Secrets: secrets}))
	if err != nil || !done.GetDone() || f.request("DeleteVolumeGroup", 0).(*volumegroup.DeleteVolumeGroupRequest).GetSecrets()["user"] != "admin" {
		t.Errorf("delete: %v %v", done, err)
	}

	// List every page; a group seen twice while paging is listed once.
	f.script("ListVolumeGroups",
		fakeStep{resp: &volumegroup.ListVolumeGroupsResponse{Entries: []*volumegroup.ListVolumeGroupsResponse_Entry{{VolumeGroup: fakeGroup("g1")}, {VolumeGroup: fakeGroup("g2")}}, NextToken: "t1"}},
		fakeStep{resp: &volumegroup.ListVolumeGroupsResponse{Entries: []*volumegroup.ListVolumeGroupsResponse_Entry{{VolumeGroup: fakeGroup("g2")}, {VolumeGroup: fakeGroup("g3")}}}},
	)
	_, list, err := collect(c.ListVolumeGroups(opCtx(t), &agentv1.ListVolumeGroupsRequest{PluginName: "fake", MaxEntries: 2, AllPages: true}))
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, g := range list.GetVolumeGroups() {
		names = append(names, g.GetVolumeGroupId())
	}
	if strings.Join(names, ",") != "g1,g2,g3" || list.GetNextToken() != "" || list.GetRestarted() {
		t.Errorf("list all pages: %v", list)
	}
	second := f.request("ListVolumeGroups", 1).(*volumegroup.ListVolumeGroupsRequest)
	if f.count("ListVolumeGroups") != 2 || second.GetStartingToken() != "t1" || second.GetMaxEntries() != 2 {
		t.Errorf("list: %d calls, second request %v", f.count("ListVolumeGroups"), second)
	}

	// One page: the next token is returned.
	f.script("ListVolumeGroups", fakeStep{resp: &volumegroup.ListVolumeGroupsResponse{Entries: []*volumegroup.ListVolumeGroupsResponse_Entry{{VolumeGroup: fakeGroup("g1")}}, NextToken: "t9"}})
	_, list, err = collect(c.ListVolumeGroups(opCtx(t), &agentv1.ListVolumeGroupsRequest{PluginName: "fake", MaxEntries: 1}))
	if err != nil || list.GetNextToken() != "t9" || len(list.GetVolumeGroups()) != 1 {
		t.Errorf("list one page: %v %v", list, err)
	}
}

// TestControllerListVolumeGroupsAborted: Aborted for a starting token
// restarts the listing from the beginning once, and only once.
func TestControllerListVolumeGroupsAborted(t *testing.T) {
	h := newCtrlHarness(t)
	c, f := h.client, h.fake
	page := func(next string, ids ...string) fakeStep {
		resp := &volumegroup.ListVolumeGroupsResponse{NextToken: next}
		for _, id := range ids {
			resp.Entries = append(resp.Entries, &volumegroup.ListVolumeGroupsResponse_Entry{VolumeGroup: fakeGroup(id)})
		}
		return fakeStep{resp: resp}
	}
	token := func(i int) string {
		return f.request("ListVolumeGroups", i).(*volumegroup.ListVolumeGroupsRequest).GetStartingToken()
	}

	t.Run("invalid starting token restarts once", func(t *testing.T) {
		f.arm()
		f.script("ListVolumeGroups", fail(codes.Aborted, "token stale"), page("t2", "g1"))
		progress, list, err := collect(h.client.ListVolumeGroups(opCtx(t), &agentv1.ListVolumeGroupsRequest{PluginName: "fake", StartingToken: "stale", Retry: fast()}))
		if err != nil {
			t.Fatal(err)
		}
		if f.count("ListVolumeGroups") != 2 || token(0) != "stale" || token(1) != "" {
			t.Errorf("calls %d, tokens %q %q; want 2: stale, then from the beginning", f.count("ListVolumeGroups"), token(0), token(1))
		}
		if !list.GetRestarted() || list.GetNextToken() != "t2" || len(list.GetVolumeGroups()) != 1 {
			t.Errorf("reply %v", list)
		}
		if len(progress) != 1 || progress[0].GetKind() != agentv1.Progress_RESTART || progress[0].GetCode() != "Aborted" {
			t.Errorf("progress %v, want one RESTART", progress)
		}
	})

	t.Run("a second invalid token fails", func(t *testing.T) {
		f.arm()
		f.script("ListVolumeGroups", page("t1", "g1"), fail(codes.Aborted, "token stale"), page("t1", "g1"), fail(codes.Aborted, "token stale again"))
		progress, _, err := collect(c.ListVolumeGroups(opCtx(t), &agentv1.ListVolumeGroupsRequest{PluginName: "fake", AllPages: true, Retry: fast()}))
		wantStatus(t, err, codes.Aborted, "token stale again", "not restarted again")
		if f.count("ListVolumeGroups") != 4 || token(2) != "" || token(3) != "t1" {
			t.Errorf("calls %d; want 4 (page, aborted, restart, aborted)", f.count("ListVolumeGroups"))
		}
		if len(progress) != 1 || progress[0].GetKind() != agentv1.Progress_RESTART {
			t.Errorf("progress %v", progress)
		}
	})

	t.Run("aborted without a token is retried", func(t *testing.T) {
		f.arm()
		f.script("ListVolumeGroups", fail(codes.Aborted, "busy"), page("", "g1"))
		progress, list, err := collect(c.ListVolumeGroups(opCtx(t), &agentv1.ListVolumeGroupsRequest{PluginName: "fake", Retry: fast()}))
		if err != nil || list.GetRestarted() || f.count("ListVolumeGroups") != 2 || len(progress) != 1 || progress[0].GetKind() != agentv1.Progress_RETRY {
			t.Errorf("err %v, reply %v, %d calls, progress %v", err, list, f.count("ListVolumeGroups"), progress)
		}
	})
}

// TestControllerErrorRecovery drives each error code of the seeds'
// tables through the API and checks the recovery by the plugin's call
// counts.
func TestControllerErrorRecovery(t *testing.T) {
	h := newCtrlHarness(t)
	c := h.client
	type result struct {
		progress []*agentv1.Progress
		err      error
	}
	// Each run returns the operation's progress and error.
	createVG := func(p *agentv1.RetryPolicy) result {
		pr, _, err := collect(c.CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "fake", Name: "g", Retry: p}))
		return result{pr, err}
	}
	deleteVG := func(p *agentv1.RetryPolicy) result {
		pr, _, err := collect(c.DeleteVolumeGroup(opCtx(t), &agentv1.DeleteVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "g", Retry: p}))
		return result{pr, err}
	}
	modifyVG := func(p *agentv1.RetryPolicy) result {
		pr, _, err := collect(c.ModifyVolumeGroup(opCtx(t), &agentv1.ModifyVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "g", VolumeIds: []string{"v"}, Retry: p}))
		return result{pr, err}
	}
	getVG := func(p *agentv1.RetryPolicy) result {
		pr, _, err := collect(c.GetVolumeGroup(opCtx(t), &agentv1.GetVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "g", Retry: p}))
		return result{pr, err}
	}
	repl := func(call func(context.Context, *agentv1.ReplicationRequest, ...grpc.CallOption) (grpc.ServerStreamingClient[agentv1.ReplicationReply], error)) func(p *agentv1.RetryPolicy) result {
		return func(p *agentv1.RetryPolicy) result {
			pr, _, err := collect(call(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: &agentv1.ReplicationRequest_VolumeId{VolumeId: "v"}, Retry: p}))
			return result{pr, err}
		}
	}
	createGS := func(p *agentv1.RetryPolicy) result {
		pr, _, err := collect(c.CreateGroupSnapshot(opCtx(t), &agentv1.CreateGroupSnapshotRequest{PluginName: "fake", Name: "s", SourceVolumeIds: []string{"v"}, Retry: p}))
		return result{pr, err}
	}
	deleteGS := func(p *agentv1.RetryPolicy) result {
		pr, _, err := collect(c.DeleteGroupSnapshot(opCtx(t), &agentv1.DeleteGroupSnapshotRequest{PluginName: "fake", GroupSnapshotId: "s", SnapshotIds: []string{"s1"}, Retry: p}))
		return result{pr, err}
	}
	getGS := func(p *agentv1.RetryPolicy) result {
		pr, _, err := collect(c.GetGroupSnapshot(opCtx(t), &agentv1.GetGroupSnapshotRequest{PluginName: "fake", GroupSnapshotId: "s", SnapshotIds: []string{"s1"}, Retry: p}))
		return result{pr, err}
	}

	for _, tc := range []struct {
		name   string
		method string
		steps  []fakeStep
		run    func(*agentv1.RetryPolicy) result
		policy *agentv1.RetryPolicy
		calls  int
		code   codes.Code // OK: succeeds
		want   []string   // in the error message
		hint   string     // in each RETRY progress's hint
	}{
		// volumegroup.Controller (seed 000).
		{name: "create InvalidArgument: use different parameters", method: "CreateVolumeGroup", steps: []fakeStep{fail(codes.InvalidArgument, "pool 'x' unsupported")},
			run: createVG, calls: 1, code: codes.InvalidArgument, want: []string{"pool 'x' unsupported", "1 call, not retried", "use different parameters"}},
		{name: "create AlreadyExists: fix or rename", method: "CreateVolumeGroup", steps: []fakeStep{fail(codes.AlreadyExists, "g exists with other parameters")},
			run: createVG, calls: 1, code: codes.AlreadyExists, want: []string{"different name"}},
		{name: "delete FailedPrecondition: retried with backoff", method: "DeleteVolumeGroup", steps: []fakeStep{fail(codes.FailedPrecondition, "has snapshots"), fail(codes.FailedPrecondition, "has snapshots")},
			run: deleteVG, calls: 3, hint: "delete its snapshots"},
		{name: "delete FailedPrecondition: bounded", method: "DeleteVolumeGroup", steps: []fakeStep{fail(codes.FailedPrecondition, "in use"), fail(codes.FailedPrecondition, "in use"), fail(codes.FailedPrecondition, "in use")},
			run: deleteVG, policy: fastAttempts(2), calls: 2, code: codes.FailedPrecondition, want: []string{"gave up after 2 calls", "make sure nothing uses it"}},
		{name: "modify InvalidArgument: use different volume ids", method: "ModifyVolumeGroupMembership", steps: []fakeStep{fail(codes.InvalidArgument, "v incompatible")},
			run: modifyVG, calls: 1, code: codes.InvalidArgument, want: []string{"use different volume ids"}},
		{name: "modify NotFound: retried", method: "ModifyVolumeGroupMembership", steps: []fakeStep{fail(codes.NotFound, "no volume v")},
			run: modifyVG, calls: 2, hint: "verify the volume ids"},
		{name: "modify ResourceExhausted: retried, bounded", method: "ModifyVolumeGroupMembership", steps: []fakeStep{fail(codes.ResourceExhausted, "max 2"), fail(codes.ResourceExhausted, "max 2"), fail(codes.ResourceExhausted, "max 2"), fail(codes.ResourceExhausted, "max 2")},
			run: modifyVG, policy: fastAttempts(3), calls: 3, code: codes.ResourceExhausted, want: []string{"max 2", "gave up after 3 calls", "cannot take more volumes"}},
		{name: "get NotFound: retried", method: "ControllerGetVolumeGroup", steps: []fakeStep{fail(codes.NotFound, "no group g")},
			run: getVG, calls: 2, hint: "verify the id"},
		{name: "get Unavailable: retried with backoff", method: "ControllerGetVolumeGroup", steps: []fakeStep{fail(codes.Unavailable, "restarting"), fail(codes.Unavailable, "restarting"), fail(codes.Unavailable, "restarting")},
			run: getVG, calls: 4, hint: "unreachable"},
		{name: "get Unimplemented: never retried", method: "ControllerGetVolumeGroup", steps: []fakeStep{fail(codes.Unimplemented, "no")},
			run: getVG, calls: 1, code: codes.Unimplemented, want: []string{"retrying cannot help"}},
		{name: "Unknown: study the logs", method: "ControllerGetVolumeGroup", steps: []fakeStep{fail(codes.Unknown, "boom")},
			run: getVG, calls: 1, code: codes.Unknown, want: []string{"boom", "Study the plugin's logs"}},

		// replication.Controller (seed 003).
		{name: "enable InvalidArgument: fix the request", method: "EnableVolumeReplication", steps: []fakeStep{fail(codes.InvalidArgument, "mirroringMode missing")},
			run: repl(c.EnableReplication), calls: 1, code: codes.InvalidArgument, want: []string{"mirroringMode missing", "fix the request"}},
		{name: "enable Unauthenticated: fix the secrets", method: "EnableVolumeReplication", steps: []fakeStep{fail(codes.Unauthenticated, "bad key")},
			run: repl(c.EnableReplication), calls: 1, code: codes.Unauthenticated, want: []string{"--secrets-file"}},
		{name: "disable NotFound: retried", method: "DisableVolumeReplication", steps: []fakeStep{fail(codes.NotFound, "no v")},
			run: repl(c.DisableReplication), calls: 2, hint: "verify the id"},
		{name: "promote Aborted: retried with backoff", method: "PromoteVolume", steps: []fakeStep{fail(codes.Aborted, "pending"), fail(codes.Aborted, "pending")},
			run: repl(c.PromoteVolume), calls: 3, hint: "already pending"},
		{name: "promote FailedPrecondition: enable replication", method: "PromoteVolume", steps: []fakeStep{fail(codes.FailedPrecondition, "not replicated")},
			run: repl(c.PromoteVolume), calls: 1, code: codes.FailedPrecondition, want: []string{"replication is enabled", "--force"}},
		{name: "demote Unimplemented: never retried", method: "DemoteVolume", steps: []fakeStep{fail(codes.Unimplemented, "no demote")},
			run: repl(c.DemoteVolume), calls: 1, code: codes.Unimplemented},
		{name: "resync FailedPrecondition: demote first", method: "ResyncVolume", steps: []fakeStep{fail(codes.FailedPrecondition, "not demoted")},
			run: repl(c.ResyncVolume), calls: 1, code: codes.FailedPrecondition, want: []string{"demoted"}},
		{name: "info FailedPrecondition: promote first", method: "GetVolumeReplicationInfo", steps: []fakeStep{fail(codes.FailedPrecondition, "not primary")},
			run: repl(c.GetReplicationInfo), calls: 1, code: codes.FailedPrecondition, want: []string{"promoted"}},
		{name: "info Unknown: not retried", method: "GetVolumeReplicationInfo", steps: []fakeStep{fail(codes.Unknown, "?")},
			run: repl(c.GetReplicationInfo), calls: 1, code: codes.Unknown, want: []string{"logs"}},

		// csi.v1.GroupController (CSI spec).
		{name: "group snapshot create AlreadyExists", method: "CreateVolumeGroupSnapshot", steps: []fakeStep{fail(codes.AlreadyExists, "s has other volumes")},
			run: createGS, calls: 1, code: codes.AlreadyExists, want: []string{"different name"}},
		{name: "group snapshot create FailedPrecondition: fix volumes", method: "CreateVolumeGroupSnapshot", steps: []fakeStep{fail(codes.FailedPrecondition, "different pools")},
			run: createGS, calls: 1, code: codes.FailedPrecondition, want: []string{"cannot be snapshotted together"}},
		{name: "group snapshot create ResourceExhausted: free space", method: "CreateVolumeGroupSnapshot", steps: []fakeStep{fail(codes.ResourceExhausted, "full")},
			run: createGS, calls: 1, code: codes.ResourceExhausted, want: []string{"free space"}},
		{name: "group snapshot create Aborted: retried", method: "CreateVolumeGroupSnapshot", steps: []fakeStep{fail(codes.Aborted, "pending")},
			run: createGS, calls: 2, hint: "pending"},
		{name: "group snapshot delete InvalidArgument: ids mismatch", method: "DeleteVolumeGroupSnapshot", steps: []fakeStep{fail(codes.InvalidArgument, "mismatch")},
			run: deleteGS, calls: 1, code: codes.InvalidArgument, want: []string{"snapshot ids do not match"}},
		{name: "group snapshot delete FailedPrecondition: retried", method: "DeleteVolumeGroupSnapshot", steps: []fakeStep{fail(codes.FailedPrecondition, "in use")},
			run: deleteGS, calls: 2, hint: "in use"},
		{name: "group snapshot get NotFound: retried, bounded", method: "GetVolumeGroupSnapshot", steps: []fakeStep{fail(codes.NotFound, "gone"), fail(codes.NotFound, "gone")},
			run: getGS, policy: fastAttempts(2), calls: 2, code: codes.NotFound, want: []string{"gave up after 2 calls", "verify the id"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h.fake.arm()
			h.fake.script(tc.method, tc.steps...)
			policy := tc.policy
			if policy == nil {
				policy = fast()
			}
			r := tc.run(policy)
			if got := h.fake.count(tc.method); got != tc.calls {
				t.Errorf("%s called %d times, want %d", tc.method, got, tc.calls)
			}
			if tc.code == codes.OK {
				if r.err != nil {
					t.Fatalf("error %v, want success after retries", r.err)
				}
			} else {
				wantStatus(t, r.err, tc.code, append([]string{"plugin fake", tc.method}, tc.want...)...)
			}
			// One RETRY progress per retried call, each with backoff
			// doubling from 10 ms (capped at 80 ms, up to 10% jitter).
			retries := tc.calls - 1
			if tc.code != codes.OK && !strings.Contains(status.Convert(r.err).Message(), "gave up") {
				retries = 0
			}
			if len(r.progress) != retries {
				t.Fatalf("progress %v, want %d RETRY messages", r.progress, retries)
			}
			for i, p := range r.progress {
				base := min(10*time.Millisecond<<i, 80*time.Millisecond)
				if p.GetKind() != agentv1.Progress_RETRY || p.GetAttempt() != uint32(i+1) || !strings.HasSuffix(p.GetRpc(), "/"+tc.method) || p.GetCode() == "" {
					t.Errorf("progress %d: %v", i, p)
				}
				if d := p.GetRetryIn().AsDuration(); d < base || d > base+base/10+time.Millisecond {
					t.Errorf("progress %d: retry in %v, want %v (+10%%)", i, d, base)
				}
				if tc.hint != "" && !strings.Contains(p.GetHint(), tc.hint) {
					t.Errorf("progress %d: hint %q lacks %q", i, p.GetHint(), tc.hint)
				}
			}
		})
	}
}

func TestControllerTimeout(t *testing.T) {
	h := newCtrlHarness(t)
	for range 1000 {
		h.fake.script("ControllerGetVolumeGroup", fail(codes.Unavailable, "down"))
	}
	p := fastAttempts(100)
	p.Timeout = durationpb.New(300 * time.Millisecond)
	start := time.Now()
	_, _, err := collect(h.client.GetVolumeGroup(opCtx(t), &agentv1.GetVolumeGroupRequest{PluginName: "fake", VolumeGroupId: "g", Retry: p}))
	wantStatus(t, err, codes.Unavailable, "the operation's timeout ends before the next retry")
	if n := h.fake.count("ControllerGetVolumeGroup"); n < 3 || n >= 100 {
		t.Errorf("%d calls within a 300ms timeout", n)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("took %v", d)
	}
}

func TestControllerReplication(t *testing.T) {
	h := newCtrlHarness(t)
	c, f := h.client, h.fake
	vol := &agentv1.ReplicationRequest_VolumeId{VolumeId: "vol-1"}
	secrets := map[string]string{"key": "s3cr3t-repl"}
	params := map[string]string{"mirroringMode": "snapshot"}

	_, res, err := collect(c.EnableReplication(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, ReplicationId: "r1", Parameters: params, Secrets: secrets}))
	if err != nil || !res.GetDone() || !res.GetReady() {
		t.Fatalf("enable: %v %v", res, err)
	}
	en := f.request("EnableVolumeReplication", 0).(*replication.EnableVolumeReplicationRequest)
	if en.GetReplicationSource().GetVolume().GetVolumeId() != "vol-1" || en.GetReplicationId() != "r1" ||
		en.GetParameters()["mirroringMode"] != "snapshot" || en.GetSecrets()["key"] != "s3cr3t-repl" {
		t.Errorf("enable request %v", en)
	}

	// A volume group source.
	_, _, err = collect(c.PromoteVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: &agentv1.ReplicationRequest_VolumeGroupId{VolumeGroupId: "vg-1"}, Force: true}))
	if err != nil {
		t.Fatal(err)
	}
	pr := f.request("PromoteVolume", 0).(*replication.PromoteVolumeRequest)
	if pr.GetReplicationSource().GetVolumegroup().GetVolumeGroupId() != "vg-1" || !pr.GetForce() {
		t.Errorf("promote request %v", pr)
	}
	_, _, err = collect(c.DemoteVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Force: true}))
	if err != nil || !f.request("DemoteVolume", 0).(*replication.DemoteVolumeRequest).GetForce() {
		t.Errorf("demote: %v", err)
	}
	_, _, err = collect(c.DisableReplication(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol}))
	if err != nil || f.count("DisableVolumeReplication") != 1 {
		t.Errorf("disable: %v", err)
	}

	// Resync: called again, with backoff, until ready.
	notReady := fakeStep{resp: &replication.ResyncVolumeResponse{Ready: false}}
	f.script("ResyncVolume", notReady, notReady)
	progress, res, err := collect(c.ResyncVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Force: true, Retry: fast()}))
	if err != nil || !res.GetReady() || f.count("ResyncVolume") != 3 {
		t.Fatalf("resync: %v %v, %d calls", res, err, f.count("ResyncVolume"))
	}
	if len(progress) != 2 || progress[0].GetKind() != agentv1.Progress_NOT_READY || progress[1].GetRetryIn().AsDuration() < 20*time.Millisecond {
		t.Errorf("resync progress %v: want two NOT_READY, backing off", progress)
	}
	// An error while waiting follows the table (Aborted retried).
	f.script("ResyncVolume", notReady, fail(codes.Aborted, "pending"))
	progress, res, err = collect(c.ResyncVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Retry: fast()}))
	if err != nil || !res.GetReady() || f.count("ResyncVolume") != 6 {
		t.Fatalf("resync: %v %v, %d calls", res, err, f.count("ResyncVolume"))
	}
	if k := kinds(progress); len(k) != 2 || k[0] != agentv1.Progress_NOT_READY || k[1] != agentv1.Progress_RETRY {
		t.Errorf("progress kinds %v", k)
	}
	// no_wait: one call, not ready.
	f.script("ResyncVolume", notReady)
	_, res, err = collect(c.ResyncVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, NoWait: true}))
	if err != nil || res.GetReady() || !res.GetDone() || f.count("ResyncVolume") != 7 {
		t.Errorf("resync --no-wait: %v %v", res, err)
	}
	// Not ready within the timeout.
	for range 100 {
		f.script("ResyncVolume", notReady)
	}
	p := fast()
	p.Timeout = durationpb.New(200 * time.Millisecond)
	_, _, err = collect(c.ResyncVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Retry: p}))
	wantStatus(t, err, codes.DeadlineExceeded, "not ready", "run the command again")

	// Info.
	f.arm()
	_, res, err = collect(c.GetReplicationInfo(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Secrets: secrets}))
	if err != nil || res.GetInfo().GetLastSyncBytes() != 4096 || res.GetInfo().GetLastSyncDuration().AsDuration() != 90*time.Second ||
		!res.GetInfo().GetLastSyncTime().AsTime().Equal(time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC)) {
		t.Errorf("info: %v %v", res, err)
	}
	if res.GetInfo().GetStatus() != "DEGRADED" || res.GetInfo().GetStatusMessage() != "behind by 3 syncs" {
		t.Errorf("info status = %q %q, want the plugin's DEGRADED and its message", res.GetInfo().GetStatus(), res.GetInfo().GetStatusMessage())
	}

	// Destination, with the spec's UNAVAILABLE row (not known yet) retried.
	f.arm()
	f.script("GetReplicationDestinationInfo", fail(codes.Unavailable, "destination not yet known"))
	ps, res, err := collect(c.GetReplicationDestination(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Retry: fast()}))
	if err != nil || res.GetDestination().GetVolumeId() != "peer-vol-1" || !slices.Equal(kinds(ps), []agentv1.Progress_Kind{agentv1.Progress_RETRY}) {
		t.Errorf("destination: %v %v %v", kinds(ps), res, err)
	}
	if got := f.request("GetReplicationDestinationInfo", 0).(*replication.GetReplicationDestinationInfoRequest); got.GetReplicationSource().GetVolume().GetVolumeId() != "vol-1" {
		t.Errorf("GetReplicationDestinationInfo got %v", got)
	}
	f.script("GetReplicationDestinationInfo", fail(codes.FailedPrecondition, "not replicated"))
	_, _, err = collect(c.GetReplicationDestination(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Retry: fast()}))
	wantStatus(t, err, codes.FailedPrecondition, "not replicated", "1 call, not retried", "csi-agent replication enable")

	// Invalid requests never reach the plugin.
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"no source", func() error {
			_, _, err := collect(c.EnableReplication(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake"}))
			return err
		}, "volume_id or the volume_group_id"},
		{"force on enable", func() error {
			_, _, err := collect(c.EnableReplication(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Force: true}))
			return err
		}, "force applies to"},
		{"no_wait on promote", func() error {
			_, _, err := collect(c.PromoteVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, NoWait: true}))
			return err
		}, "no_wait applies to ResyncVolume"},
		{"no plugin", func() error {
			_, _, err := collect(c.EnableReplication(opCtx(t), &agentv1.ReplicationRequest{Source: vol}))
			return err
		}, "plugin_name is required"},
		{"parameters on destination", func() error {
			_, _, err := collect(c.GetReplicationDestination(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Parameters: map[string]string{"a": "b"}}))
			return err
		}, "takes no parameters"},
		{"bad policy", func() error {
			_, _, err := collect(c.EnableReplication(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: vol, Retry: &agentv1.RetryPolicy{MaxAttempts: 1000}}))
			return err
		}, "max_attempts"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			wantStatus(t, tc.call(), codes.InvalidArgument, tc.want)
		})
	}
	if n := f.count("EnableVolumeReplication") + f.count("PromoteVolume"); n != 0 {
		t.Errorf("invalid requests made %d plugin calls", n)
	}
}

func TestControllerGroupSnapshots(t *testing.T) {
	h := newCtrlHarness(t)
	c, f := h.client, h.fake
	secrets := map[string]string{"token": "s3cr3t-gs"}

	// Not ready when cut: created again with the same arguments until
	// ready, after checking the capability once.
	f.script("CreateVolumeGroupSnapshot", fakeStep{resp: &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: fakeGroupSnapshot("gs-nightly", false, "v1", "v2")}})
	req := &agentv1.CreateGroupSnapshotRequest{PluginName: "fake", Name: "nightly", SourceVolumeIds: []string{"v1", "v2"},
		Parameters: map[string]string{"class": "gold"}, Secrets: secrets, Retry: fast()}
	progress, res, err := collect(c.CreateGroupSnapshot(opCtx(t), req))
	if err != nil {
		t.Fatal(err)
	}
	gs := res.GetGroupSnapshot()
	if gs.GetGroupSnapshotId() != "gs-nightly" || !gs.GetReadyToUse() || len(gs.GetSnapshots()) != 2 {
		t.Errorf("group snapshot %v", gs)
	}
	if f.count("GroupControllerGetCapabilities") != 1 || f.count("CreateVolumeGroupSnapshot") != 2 || len(progress) != 1 || progress[0].GetKind() != agentv1.Progress_NOT_READY {
		t.Errorf("capability calls %d, create calls %d, progress %v", f.count("GroupControllerGetCapabilities"), f.count("CreateVolumeGroupSnapshot"), progress)
	}
	want := &csi.CreateVolumeGroupSnapshotRequest{Name: "nightly", SourceVolumeIds: []string{"v1", "v2"}, Parameters: map[string]string{"class": "gold"}, Secrets: secrets}
	for i := range 2 {
		if got := f.request("CreateVolumeGroupSnapshot", i); !proto.Equal(got, want) {
			t.Errorf("create request %d: %v, want %v", i, got, want)
		}
	}
	// --no-wait: once.
	f.arm()
	f.script("CreateVolumeGroupSnapshot", fakeStep{resp: &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: fakeGroupSnapshot("gs-nightly", false, "v1")}})
	req.NoWait = true
	_, res, err = collect(c.CreateGroupSnapshot(opCtx(t), req))
	if err != nil || res.GetGroupSnapshot().GetReadyToUse() || f.count("CreateVolumeGroupSnapshot") != 1 {
		t.Errorf("no_wait: %v %v", res, err)
	}

	// Get and delete pass the snapshot ids.
	ids := []string{"gs-nightly-v1", "gs-nightly-v2"}
	_, res, err = collect(c.GetGroupSnapshot(opCtx(t), &agentv1.GetGroupSnapshotRequest{PluginName: "fake", GroupSnapshotId: "gs-nightly", SnapshotIds: ids, Secrets: secrets}))
	if err != nil || res.GetGroupSnapshot().GetGroupSnapshotId() != "gs-nightly" {
		t.Errorf("get: %v %v", res, err)
	}
	if got := f.request("GetVolumeGroupSnapshot", 0).(*csi.GetVolumeGroupSnapshotRequest); strings.Join(got.GetSnapshotIds(), ",") != strings.Join(ids, ",") || got.GetSecrets()["token"] != "s3cr3t-gs" {
		t.Errorf("get request %v", got)
	}
	_, done, err := collect(c.DeleteGroupSnapshot(opCtx(t), &agentv1.DeleteGroupSnapshotRequest{PluginName: "fake", GroupSnapshotId: "gs-nightly", SnapshotIds: ids}))
	if err != nil || !done.GetDone() || strings.Join(f.request("DeleteVolumeGroupSnapshot", 0).(*csi.DeleteVolumeGroupSnapshotRequest).GetSnapshotIds(), ",") != strings.Join(ids, ",") {
		t.Errorf("delete: %v %v", done, err)
	}
	_, _, err = collect(c.DeleteGroupSnapshot(opCtx(t), &agentv1.DeleteGroupSnapshotRequest{PluginName: "fake", GroupSnapshotId: "gs-nightly"}))
	wantStatus(t, err, codes.InvalidArgument, "snapshot_ids is required")

	// Unsupported: no capability, or no GroupController at all. Nothing
	// else is called.
	f.arm()
	f.mu.Lock()
	f.groupCaps = nil
	f.mu.Unlock()
	_, _, err = collect(c.CreateGroupSnapshot(opCtx(t), &agentv1.CreateGroupSnapshotRequest{PluginName: "fake", Name: "n", SourceVolumeIds: []string{"v1"}}))
	wantStatus(t, err, codes.FailedPrecondition, "does not support group snapshots", "CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT")
	f.script("GroupControllerGetCapabilities", fail(codes.Unimplemented, "unknown service csi.v1.GroupController"))
	_, _, err = collect(c.GetGroupSnapshot(opCtx(t), &agentv1.GetGroupSnapshotRequest{PluginName: "fake", GroupSnapshotId: "g", SnapshotIds: []string{"s"}}))
	wantStatus(t, err, codes.FailedPrecondition, "does not support group snapshots", "does not serve csi.v1.GroupController")
	if f.count("GroupControllerGetCapabilities") != 2 || f.count("CreateVolumeGroupSnapshot")+f.count("GetVolumeGroupSnapshot") != 0 {
		t.Errorf("calls: caps %d, create %d, get %d", f.count("GroupControllerGetCapabilities"), f.count("CreateVolumeGroupSnapshot"), f.count("GetVolumeGroupSnapshot"))
	}
}

// TestControllerOneCallPerObject: operations on one volume wait for each
// other (the specs want one call in flight per volume); others do not.
func TestControllerOneCallPerObject(t *testing.T) {
	h := newCtrlHarness(t)
	c, f := h.client, h.fake
	release := make(chan struct{})
	f.script("PromoteVolume", fakeStep{block: release})
	type outcome struct {
		progress []*agentv1.Progress
		err      error
	}
	first := make(chan outcome, 1)
	go func() {
		p, _, err := collect(c.PromoteVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: &agentv1.ReplicationRequest_VolumeId{VolumeId: "vol-1"}}))
		first <- outcome{p, err}
	}()
	waitFor(t, "the first promote to reach the plugin", func() bool { return f.count("PromoteVolume") == 1 })

	// Another volume goes ahead.
	if _, _, err := collect(c.DemoteVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: &agentv1.ReplicationRequest_VolumeId{VolumeId: "vol-2"}})); err != nil {
		t.Fatal(err)
	}
	// The same volume waits, and says so.
	stream, err := c.DemoteVolume(opCtx(t), &agentv1.ReplicationRequest{PluginName: "fake", Source: &agentv1.ReplicationRequest_VolumeId{VolumeId: "vol-1"}})
	if err != nil {
		t.Fatal(err)
	}
	msg, err := stream.Recv()
	if err != nil || msg.GetProgress().GetKind() != agentv1.Progress_WAITING || !strings.Contains(msg.GetProgress().GetMessage(), "vol-1") {
		t.Fatalf("first message %v, %v; want WAITING", msg, err)
	}
	if n := f.count("DemoteVolume"); n != 1 {
		t.Errorf("demote of vol-1 reached the plugin while a promote ran: %d calls", n)
	}
	close(release)
	if o := <-first; o.err != nil {
		t.Fatal(o.err)
	}
	progress, res, err := collect(stream, nil)
	if err != nil || !res.GetDone() || len(progress) != 0 {
		t.Fatalf("second: %v %v %v", progress, res, err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.maxInflight["volume:vol-1"] != 1 {
		t.Errorf("%d calls on vol-1 in flight at once", f.maxInflight["volume:vol-1"])
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitTimeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// TestControllerPlugins: plugins that are unknown or have no controller
// fail at once with a clear status.
func TestControllerPlugins(t *testing.T) {
	h := newCtrlHarness(t)
	_, _, err := collect(h.client.GetVolumeGroup(opCtx(t), &agentv1.GetVolumeGroupRequest{PluginName: "nope", VolumeGroupId: "g", Retry: fast()}))
	wantStatus(t, err, codes.NotFound, "Unknown CSI plugin 'nope'")
	_, _, err = collect(h.client.GetVolumeGroup(opCtx(t), &agentv1.GetVolumeGroupRequest{PluginName: "nodeonly", VolumeGroupId: "g", Retry: fast()}))
	wantStatus(t, err, codes.FailedPrecondition, "no CONTROLLER_SERVICE")
	if n := h.fake.count("ControllerGetVolumeGroup"); n != 0 {
		t.Errorf("%d plugin calls", n)
	}
}

// TestControllerSecretsNotLogged: secrets reach the plugin, never the log.
func TestControllerSecretsNotLogged(t *testing.T) {
	h := newCtrlHarness(t)
	const secret = "s3cr3t-never-logged"
	h.fake.script("CreateVolumeGroup", fail(codes.Unavailable, "blip"))
	_, _, err := collect(h.client.CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "fake", Name: "g",
		Secrets: map[string]string{"password": secret}, Retry: fast()}))
	if err != nil {
		t.Fatal(err)
	}
	if got := h.fake.request("CreateVolumeGroup", 1).(*volumegroup.CreateVolumeGroupRequest).GetSecrets()["password"]; got != secret {
		t.Errorf("plugin got secret %q", got)
	}
	logs := h.logs.String()
	if strings.Contains(logs, secret) {
		t.Errorf("the log has the secret:\n%s", logs)
	}
	for _, want := range []string{"controller operation", "controller call", `password`, redact.Stripped} {
		if !strings.Contains(logs, want) {
			t.Errorf("the log lacks %q", want)
		}
	}
}

// TestControllerLoopPluginE2E drives the controller API against the real
// csi-loop-plugin (unmanaged): volume groups, paging with a stale token,
// and a group snapshot of the group's members.
func TestControllerLoopPluginE2E(t *testing.T) {
	h := newHarness(t)
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	createVolume(t, pool, "a")
	createVolume(t, pool, "b")
	volA, volB := "a", "b" // the loop plugin's volume id is the volume's name
	sock := filepath.Join(h.run, "loop.sock")
	startLoopPlugin(t, sock, pool)
	h.writeConfig("loop.json", `{"type":"loop","endpoints":[`+
		`{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"},`+
		`{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"}]}`)
	h.start(fastConfig(h))
	p := h.waitPlugin("loop", "ready", ready)
	for _, svc := range []string{controllerops.VolumeGroupService, controllerops.GroupControllerService} {
		if !strings.Contains(strings.Join(p.Instances[0].AddonsServices, " "), svc) {
			t.Fatalf("csi-loop-plugin does not offer %s: %v", svc, p.Instances[0].AddonsServices)
		}
	}
	conn, err := grpc.NewClient("unix://"+h.cfg.APISocket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := agentv1.NewControllerClient(conn)

	// Groups: create (twice: idempotent), fill, list page by page.
	for range 2 {
		_, res, err := collect(c.CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "loop", Name: "db", Parameters: map[string]string{"tier": "1"}, Retry: fast()}))
		if err != nil || res.GetVolumeGroup().GetVolumeGroupId() != "db" {
			t.Fatalf("create: %v %v", res, err)
		}
	}
	if _, _, err := collect(c.CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "loop", Name: "logs", Retry: fast()})); err != nil {
		t.Fatal(err)
	}
	_, _, err = collect(c.CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "loop", Name: "db", Parameters: map[string]string{"tier": "2"}, Retry: fast()}))
	wantStatus(t, err, codes.AlreadyExists, "different name")
	_, res, err := collect(c.ModifyVolumeGroup(opCtx(t), &agentv1.ModifyVolumeGroupRequest{PluginName: "loop", VolumeGroupId: "db", VolumeIds: []string{volA, volB}, Retry: fast()}))
	if err != nil || len(res.GetVolumeGroup().GetVolumes()) != 2 {
		t.Fatalf("modify: %v %v", res, err)
	}
	_, list, err := collect(c.ListVolumeGroups(opCtx(t), &agentv1.ListVolumeGroupsRequest{PluginName: "loop", MaxEntries: 1, AllPages: true, Retry: fast()}))
	if err != nil || len(list.GetVolumeGroups()) != 2 || list.GetVolumeGroups()[0].GetVolumeGroupId() != "db" || list.GetVolumeGroups()[1].GetVolumeGroupId() != "logs" {
		t.Fatalf("list: %v %v", list, err)
	}
	progress, list, err := collect(c.ListVolumeGroups(opCtx(t), &agentv1.ListVolumeGroupsRequest{PluginName: "loop", MaxEntries: 1, StartingToken: "not-a-token", Retry: fast()}))
	if err != nil || !list.GetRestarted() || len(list.GetVolumeGroups()) != 1 || list.GetNextToken() == "" || len(progress) != 1 {
		t.Fatalf("list with a stale token: %v %v %v", progress, list, err)
	}

	// A group snapshot of the members.
	_, gs, err := collect(c.CreateGroupSnapshot(opCtx(t), &agentv1.CreateGroupSnapshotRequest{PluginName: "loop", Name: "nightly", SourceVolumeIds: []string{volA, volB}, Retry: fast()}))
	if err != nil || !gs.GetGroupSnapshot().GetReadyToUse() || len(gs.GetGroupSnapshot().GetSnapshots()) != 2 {
		t.Fatalf("group snapshot: %v %v", gs, err)
	}
	snap := gs.GetGroupSnapshot()
	var ids []string
	for _, s := range snap.GetSnapshots() {
		ids = append(ids, s.GetSnapshotId())
	}
	_, got, err := collect(c.GetGroupSnapshot(opCtx(t), &agentv1.GetGroupSnapshotRequest{PluginName: "loop", GroupSnapshotId: snap.GetGroupSnapshotId(), SnapshotIds: ids, Retry: fast()}))
	if err != nil || got.GetGroupSnapshot().GetGroupSnapshotId() != snap.GetGroupSnapshotId() {
		t.Fatalf("get group snapshot: %v %v", got, err)
	}
	if _, _, err := collect(c.DeleteGroupSnapshot(opCtx(t), &agentv1.DeleteGroupSnapshotRequest{PluginName: "loop", GroupSnapshotId: snap.GetGroupSnapshotId(), SnapshotIds: ids, Retry: fast()})); err != nil {
		t.Fatalf("delete group snapshot: %v", err)
	}

	// Delete the groups; a deleted group is NotFound (retried, then the
	// hint).
	for _, id := range []string{"db", "logs"} {
		if _, _, err := collect(c.DeleteVolumeGroup(opCtx(t), &agentv1.DeleteVolumeGroupRequest{PluginName: "loop", VolumeGroupId: id, Retry: fast()})); err != nil {
			t.Fatalf("delete %s: %v", id, err)
		}
	}
	_, _, err = collect(c.GetVolumeGroup(opCtx(t), &agentv1.GetVolumeGroupRequest{PluginName: "loop", VolumeGroupId: "db", Retry: fastAttempts(2)}))
	wantStatus(t, err, codes.NotFound, "gave up after 2 calls", "verify the id")
}
