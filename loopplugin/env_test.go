package loopplugin

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/testhelp"
	rs "github.com/csiagent/csiagent/proto/reclaimspace"
	rep "github.com/csiagent/csiagent/proto/replication"
	vg "github.com/csiagent/csiagent/proto/volumegroup"
)

// testEnv is a plugin served in-process on a unix socket in a temporary
// directory, with clients for every service.
type testEnv struct {
	dir, pool, sock string
	p               *Plugin
	id              csi.IdentityClient
	ctrl            csi.ControllerClient
	group           csi.GroupControllerClient
	node            csi.NodeClient
	rsNode          rs.ReclaimSpaceNodeClient
	rsCtrl          rs.ReclaimSpaceControllerClient
	vg              vg.ControllerClient
	rep             rep.ControllerClient
}

type tWriter struct{ t *testing.T }

func (w tWriter) Write(b []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(b), "\n"))
	return len(b), nil
}

// newEnv starts a plugin. When the test ends it stops the plugin and fails
// the test if a mount below the test's directory or a loop device backed by
// a pool file is left, removing them so later tests are not affected.
func newEnv(t *testing.T, logLevel slog.Level, opts ...func(*Config)) *testEnv {
	t.Helper()
	dir := testhelp.LeakCheckedDir(t)
	pool := filepath.Join(dir, "pool")
	if err := os.Mkdir(pool, 0o700); err != nil {
		t.Fatal(err)
	}
	return startEnv(t, logLevel, dir, pool, "", opts...)
}

// newReplicaPair starts two plugins in one directory: a serves pool "a"
// with replica pool "b", and b serves "b" with replica "a": the two sides
// of replicated volumes.
func newReplicaPair(t *testing.T, logLevel slog.Level) (a, b *testEnv) {
	t.Helper()
	dir := testhelp.LeakCheckedDir(t)
	pa, pb := filepath.Join(dir, "a"), filepath.Join(dir, "b")
	for _, p := range []string{pa, pb} {
		if err := os.Mkdir(p, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	return startEnv(t, logLevel, dir, pa, pb), startEnv(t, logLevel, dir, pb, pa)
}

// startEnv serves a plugin on pool (with an optional replica pool) on a
// socket in dir.
func startEnv(t *testing.T, logLevel slog.Level, dir, pool, replica string, opts ...func(*Config)) *testEnv {
	t.Helper()
	e := &testEnv{dir: dir, pool: pool, sock: filepath.Join(dir, filepath.Base(pool)+".sock")}
	// Node-only unless an option says otherwise: most tests here drive the
	// node service alone (attach mode: attach_test.go, TestSanity).
	cfg := Config{
		NodeOnly:    true,
		Pool:        e.pool,
		ReplicaPool: replica,
		NodeID:      "node-1",
		Logger: slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: logLevel})).
			With("plugin", filepath.Base(pool)),
	}
	for _, o := range opts {
		o(&cfg)
	}
	var err error
	e.p, err = New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("unix", e.sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := e.p.NewServer()
	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		if err := <-served; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	conn, err := grpc.NewClient("unix://"+e.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	e.id, e.ctrl, e.node = csi.NewIdentityClient(conn), csi.NewControllerClient(conn), csi.NewNodeClient(conn)
	e.group = csi.NewGroupControllerClient(conn)
	e.rsNode, e.rsCtrl = rs.NewReclaimSpaceNodeClient(conn), rs.NewReclaimSpaceControllerClient(conn)
	e.vg, e.rep = vg.NewControllerClient(conn), rep.NewControllerClient(conn)
	return e
}

func mountCap(fsType string, mode csi.VolumeCapability_AccessMode_Mode, flags ...string) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: fsType, MountFlags: flags}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

const snw = csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER

func (e *testEnv) createVolume(t *testing.T, name string, size int64) string {
	t.Helper()
	resp, err := e.ctrl.CreateVolume(context.Background(), &csi.CreateVolumeRequest{
		Name:               name,
		CapacityRange:      &csi.CapacityRange{RequiredBytes: size},
		VolumeCapabilities: []*csi.VolumeCapability{mountCap("", snw)},
	})
	if err != nil {
		t.Fatalf("CreateVolume %s: %v", name, err)
	}
	return resp.GetVolume().GetVolumeId()
}

func (e *testEnv) stage(t *testing.T, id, staging string, c *csi.VolumeCapability) {
	t.Helper()
	if _, err := e.node.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, VolumeCapability: c,
	}); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
}

func (e *testEnv) unstage(t *testing.T, id, staging string) {
	t.Helper()
	if _, err := e.node.NodeUnstageVolume(context.Background(), &csi.NodeUnstageVolumeRequest{
		VolumeId: id, StagingTargetPath: staging,
	}); err != nil {
		t.Fatalf("NodeUnstageVolume: %v", err)
	}
}

func (e *testEnv) publish(t *testing.T, id, staging, target string, c *csi.VolumeCapability, ro bool) {
	t.Helper()
	if _, err := e.node.NodePublishVolume(context.Background(), &csi.NodePublishVolumeRequest{
		VolumeId: id, StagingTargetPath: staging, TargetPath: target, VolumeCapability: c, Readonly: ro,
	}); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
}

func (e *testEnv) unpublish(t *testing.T, id, target string) {
	t.Helper()
	if _, err := e.node.NodeUnpublishVolume(context.Background(), &csi.NodeUnpublishVolumeRequest{
		VolumeId: id, TargetPath: target,
	}); err != nil {
		t.Fatalf("NodeUnpublishVolume: %v", err)
	}
}

func wantCode(t *testing.T, err error, want codes.Code) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("code = %s (%v), want %s", got, err, want)
	}
}
