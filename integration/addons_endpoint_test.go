package integration

import (
	"context"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	ekr "github.com/csiagent/csiagent/proto/encryptionkeyrotation"
	"github.com/csiagent/csiagent/proto/identity"
	"github.com/csiagent/csiagent/proto/reclaimspace"
	"github.com/csiagent/csiagent/proto/replication"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

// fakeAddonsIdentity is a csi-addons identity.Identity offering volume
// groups, replication and offline reclaim, as ceph-csi's controller
// plugin does on its csi-addons endpoint.
type fakeAddonsIdentity struct {
	identity.UnimplementedIdentityServer
}

func (fakeAddonsIdentity) GetIdentity(context.Context, *identity.GetIdentityRequest) (*identity.GetIdentityResponse, error) {
	return &identity.GetIdentityResponse{Name: "fake.csi.csiagent.io", VendorVersion: "2.0.0"}, nil
}

func (fakeAddonsIdentity) GetCapabilities(context.Context, *identity.GetCapabilitiesRequest) (*identity.GetCapabilitiesResponse, error) {
	c := func(c *identity.Capability) *identity.Capability { return c }
	return &identity.GetCapabilitiesResponse{Capabilities: []*identity.Capability{
		c(&identity.Capability{Type: &identity.Capability_Service_{Service: &identity.Capability_Service{Type: identity.Capability_Service_CONTROLLER_SERVICE}}}),
		c(&identity.Capability{Type: &identity.Capability_VolumeGroup_{VolumeGroup: &identity.Capability_VolumeGroup{Type: identity.Capability_VolumeGroup_VOLUME_GROUP}}}),
		c(&identity.Capability{Type: &identity.Capability_VolumeReplication_{VolumeReplication: &identity.Capability_VolumeReplication{Type: identity.Capability_VolumeReplication_VOLUME_REPLICATION}}}),
		c(&identity.Capability{Type: &identity.Capability_ReclaimSpace_{ReclaimSpace: &identity.Capability_ReclaimSpace{Type: identity.Capability_ReclaimSpace_OFFLINE}}}),
	}}, nil
}

// fakeReclaimCtrl answers ControllerReclaimSpace.
type fakeReclaimCtrl struct {
	reclaimspace.UnimplementedReclaimSpaceControllerServer
	f *fakeController
}

func (s fakeReclaimCtrl) ControllerReclaimSpace(ctx context.Context, req *reclaimspace.ControllerReclaimSpaceRequest) (*reclaimspace.ControllerReclaimSpaceResponse, error) {
	return answer(ctx, s.f, "ControllerReclaimSpace", req.GetVolumeId(), req, func() *reclaimspace.ControllerReclaimSpaceResponse {
		return &reclaimspace.ControllerReclaimSpaceResponse{PreUsage: &reclaimspace.StorageConsumption{UsageBytes: 300}, PostUsage: &reclaimspace.StorageConsumption{UsageBytes: 100}}
	})
}

// serveOn serves the registered services on a unix socket until the test
// ends.
func serveOn(t *testing.T, socket string, register func(*grpc.Server)) {
	t.Helper()
	lis, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	register(srv)
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

// TestAddonsEndpoint plays ceph-csi's layout: CSI on one socket, csi-addons
// (with its identity) on another, named by csiagent.csi_addons_endpoint.
// Discovery reads the csi-addons identity's capabilities; volume groups,
// replication and reclaim reach the csi-addons socket, group snapshots the
// CSI one. A second plugin's csi-addons socket serves no identity: its
// services are found by calling them, as on a CSI socket.
func TestAddonsEndpoint(t *testing.T) {
	h := newHarness(t)
	f := newFakeController()
	csiSock, addonsSock, bareSock := filepath.Join(h.run, "csi.sock"), filepath.Join(h.run, "addons.sock"), filepath.Join(h.run, "bare.sock")
	serveOn(t, csiSock, func(srv *grpc.Server) {
		csi.RegisterIdentityServer(srv, fakeIdentity{})
		csi.RegisterNodeServer(srv, fakeNode{})
		csi.RegisterGroupControllerServer(srv, fakeGC{f: f})
	})
	serveOn(t, addonsSock, func(srv *grpc.Server) {
		identity.RegisterIdentityServer(srv, fakeAddonsIdentity{})
		volumegroup.RegisterControllerServer(srv, fakeVG{f: f})
		replication.RegisterControllerServer(srv, fakeRepl{f: f})
		reclaimspace.RegisterReclaimSpaceControllerServer(srv, fakeReclaimCtrl{f: f})
	})
	serveOn(t, bareSock, func(srv *grpc.Server) {
		volumegroup.RegisterControllerServer(srv, fakeVG{f: f})
	})
	endpoints := `"endpoints":[{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://` + csiSock + `"},{"csi_service":"NODE_SERVICE","endpoint":"unix://` + csiSock + `"}]`
	h.writeConfig("ceph.json", `{"type":"ceph",`+endpoints+`,"csiagent":{"csi_addons_endpoint":"unix://`+addonsSock+`"}}`)
	h.writeConfig("bare.json", `{"type":"bare",`+endpoints+`,"csiagent":{"csi_addons_endpoint":"`+bareSock+`"}}`)
	h.start(fastConfig(h))

	p := h.waitPlugin("ceph", "ready", ready).GetInstances()[0]
	if p.GetAddonsEndpoint() != "unix://"+addonsSock || p.GetAddonsIdentity() != "fake.csi.csiagent.io 2.0.0" {
		t.Errorf("csi-addons endpoint %q identity %q", p.GetAddonsEndpoint(), p.GetAddonsIdentity())
	}
	got := slices.Sorted(slices.Values(p.GetAddonsServices()))
	if want := []string{"csi.v1.GroupController", "reclaimspace.ReclaimSpaceController", "replication.Controller", "volumegroup.Controller"}; !slices.Equal(got, want) {
		t.Errorf("csi-addons services %v, want %v", got, want)
	}
	b := h.waitPlugin("bare", "ready", ready).GetInstances()[0]
	if got := b.GetAddonsServices(); b.GetAddonsIdentity() != "" || !slices.Equal(got, []string{"volumegroup.Controller", "csi.v1.GroupController"}) {
		t.Errorf("bare csi-addons endpoint: identity %q, services %v; want found by calling them", b.GetAddonsIdentity(), got)
	}

	f.arm()
	conn := apiConn(t, h.cfg.APISocket)
	ctrl, api := agentv1.NewControllerClient(conn), agentv1.NewAgentClient(conn)
	if _, res, err := collect(ctrl.CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "ceph", Name: "g", VolumeIds: []string{"v1"}, Retry: fast()})); err != nil || res.GetVolumeGroup() == nil {
		t.Errorf("CreateVolumeGroup through the csi-addons endpoint: %v %v", res, err)
	}
	vol := &agentv1.ReplicationRequest_VolumeId{VolumeId: "v1"}
	if _, _, err := collect(ctrl.EnableReplication(opCtx(t), &agentv1.ReplicationRequest{PluginName: "ceph", Source: vol, Retry: fast()})); err != nil {
		t.Errorf("EnableReplication through the csi-addons endpoint: %v", err)
	}
	if _, res, err := collect(ctrl.CreateGroupSnapshot(opCtx(t), &agentv1.CreateGroupSnapshotRequest{PluginName: "ceph", Name: "s", SourceVolumeIds: []string{"v1"}, Retry: fast()})); err != nil || res.GetGroupSnapshot() == nil {
		t.Errorf("CreateGroupSnapshot on the CSI endpoint: %v %v", res, err)
	}
	// Offline, with the request's secrets and parameters; Aborted (an
	// operation pending) is retried, as csi-addons' table says.
	f.script("ControllerReclaimSpace", fakeStep{code: codes.Aborted})
	stream, err := api.ReclaimSpace(opCtx(t), &agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_Volume{Volume: &agentv1.VolumeRef{PluginName: "ceph", VolumeId: "v9"}}, Offline: true,
		Secrets: map[string]string{"userKey": "s3cr3t"}, Parameters: map[string]string{"clusterID": "c1"}, Retry: fast()})
	if err != nil {
		t.Fatal(err)
	}
	first, err := stream.Recv()
	if err != nil || first.GetResult().GetBytesReclaimed() != 200 {
		t.Errorf("offline reclaim through the csi-addons endpoint: %v %v", first, err)
	}
	if r := f.request("ControllerReclaimSpace", 1).(*reclaimspace.ControllerReclaimSpaceRequest); r.GetSecrets()["userKey"] != "s3cr3t" || r.GetParameters()["clusterID"] != "c1" {
		t.Errorf("ControllerReclaimSpace request %v: want the secrets and parameters", r)
	}
	if _, _, err := collect(ctrl.CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "bare", Name: "g2", Retry: fast()})); err != nil {
		t.Errorf("CreateVolumeGroup through the bare csi-addons endpoint: %v", err)
	}
	for method, want := range map[string]int{"CreateVolumeGroup": 2, "EnableVolumeReplication": 1, "CreateVolumeGroupSnapshot": 1, "ControllerReclaimSpace": 2} {
		if n := f.count(method); n != want {
			t.Errorf("%s: %d calls, want %d", method, n, want)
		}
	}
}

// TestManagedAddonsEndpoint: a managed csi-loop-plugin passes
// $CSIADDONS_ENDPOINT on (--csi-addons-endpoint); discovery reads its
// csi-addons identity there, and a reclaim and a volume group go through
// it.
func TestManagedAddonsEndpoint(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	h.writeConfig("loop.json", managedConfig("loop", true, "exec "+bins.loop+" --pool="+pool+" --csi-addons-endpoint=$CSIADDONS_ENDPOINT"))
	createVolume(t, pool, "vol1")
	h.start(fastConfig(h))
	in := h.waitPlugin("loop", "ready", ready).GetInstances()[0]
	if want := "unix://" + filepath.Join(h.run, "csi", "loop", "default", "c0-addons.sock"); in.GetAddonsEndpoint() != want ||
		!strings.HasPrefix(in.GetAddonsIdentity(), "loop.csiagent.io ") {
		t.Errorf("csi-addons endpoint %q (want %q), identity %q", in.GetAddonsEndpoint(), want, in.GetAddonsIdentity())
	}
	for _, svc := range []string{"reclaimspace.ReclaimSpaceNode", "reclaimspace.ReclaimSpaceController", "volumegroup.Controller", "csi.v1.GroupController"} {
		if !slices.Contains(in.GetAddonsServices(), svc) {
			t.Errorf("services %v lack %s", in.GetAddonsServices(), svc)
		}
	}
	h.mustPrepare("c1", h.dir("sandbox"), "", volumeSpec{plugin: "loop", id: "vol1", path: "data"})
	msgs, err := h.reclaimNow(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}})
	if err != nil || len(msgs) != 2 || msgs[1].GetSummary().GetVolumes() != 1 {
		t.Errorf("reclaim through the csi-addons endpoint: %v, %v", msgs, err)
	}
	conn := apiConn(t, h.cfg.APISocket)
	if _, res, err := collect(agentv1.NewControllerClient(conn).CreateVolumeGroup(opCtx(t), &agentv1.CreateVolumeGroupRequest{PluginName: "loop", Name: "g", VolumeIds: []string{"vol1"}, Retry: fast()})); err != nil || res.GetVolumeGroup() == nil {
		t.Errorf("CreateVolumeGroup through the csi-addons endpoint: %v, %v", res, err)
	}
	h.mustCleanup("c1")
	h.assertClean(pool)
}

// countingAddons serves csi-addons NodeReclaimSpace and EncryptionKeyRotate
// and counts their calls: discovery must make none (both may act).
type countingAddons struct {
	reclaimspace.UnimplementedReclaimSpaceNodeServer
	ekr.UnimplementedEncryptionKeyRotationControllerServer
	calls *atomic.Int64
}

func (c countingAddons) NodeReclaimSpace(context.Context, *reclaimspace.NodeReclaimSpaceRequest) (*reclaimspace.NodeReclaimSpaceResponse, error) {
	c.calls.Add(1)
	return nil, status.Error(codes.InvalidArgument, "volume_id is required")
}

func (c countingAddons) EncryptionKeyRotate(context.Context, *ekr.EncryptionKeyRotateRequest) (*ekr.EncryptionKeyRotateResponse, error) {
	c.calls.Add(1)
	return nil, status.Error(codes.InvalidArgument, "volume_id is required")
}

// TestAddonsDiscoveryNeverActs (issue 25): on a csi-addons endpoint
// without the csi-addons identity, services whose calls may act
// (NodeReclaimSpace, EncryptionKeyRotate) are found by gRPC server
// reflection, or declared in csiagent.csi_addons_services, and are never
// called to find out: an endpoint that offers neither gets them not
// discovered. Before, each was called with an empty request.
func TestAddonsDiscoveryNeverActs(t *testing.T) {
	h := newHarness(t)
	var calls atomic.Int64
	csiSock := filepath.Join(h.run, "csi.sock")
	serveOn(t, csiSock, func(srv *grpc.Server) {
		csi.RegisterIdentityServer(srv, fakeIdentity{})
		csi.RegisterNodeServer(srv, fakeNode{})
	})
	for _, name := range []string{"reflected", "silent", "declared"} {
		sock := filepath.Join(h.run, name+".sock")
		serveOn(t, sock, func(srv *grpc.Server) {
			a := countingAddons{calls: &calls}
			reclaimspace.RegisterReclaimSpaceNodeServer(srv, a)
			ekr.RegisterEncryptionKeyRotationControllerServer(srv, a)
			if name == "reflected" {
				reflection.Register(srv)
			}
		})
		settings := `"csi_addons_endpoint":"unix://` + sock + `"`
		if name == "declared" {
			settings += `,"csi_addons_services":["reclaimspace.ReclaimSpaceNode"]`
		}
		h.writeConfig(name+".json", `{"type":"`+name+`","endpoints":[{"csi_service":"NODE_SERVICE","endpoint":"unix://`+csiSock+`"}],"csiagent":{`+settings+`}}`)
	}
	h.start(fastConfig(h))
	for name, want := range map[string][]string{
		"reflected": {"encryptionkeyrotation.EncryptionKeyRotationController", "reclaimspace.ReclaimSpaceNode"},
		"silent":    nil,
		"declared":  {"reclaimspace.ReclaimSpaceNode"},
	} {
		got := slices.Sorted(slices.Values(h.waitPlugin(name, "ready", ready).GetInstances()[0].GetAddonsServices()))
		if !slices.Equal(got, want) {
			t.Errorf("%s: csi-addons services %v, want %v", name, got, want)
		}
	}
	if n := calls.Load(); n != 0 {
		t.Errorf("discovery called NodeReclaimSpace or EncryptionKeyRotate %d times", n)
	}
}
