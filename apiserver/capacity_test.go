package apiserver

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// capacityController answers GetCapacity with fixed figures.
type capacityController struct {
	csi.UnimplementedControllerServer
}

func (capacityController) GetCapacity(context.Context, *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	return &csi.GetCapacityResponse{AvailableCapacity: 42 << 30, MaximumVolumeSize: wrapperspb.Int64(8 << 30)}, nil
}

// serveController serves c on a unix socket and returns a client
// connection to it.
func serveController(t *testing.T, c csi.ControllerServer) *grpc.ClientConn {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "c.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterControllerServer(srv, c)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// TestGetPluginCapacity: GetPlugin asks GetCapacity of a plugin whose
// controller offers GET_CAPACITY, says why when it cannot, and asks
// nothing of a plugin that does not offer it (nor in ListPlugins).
func TestGetPluginCapacity(t *testing.T) {
	offering := func() *agentv1.Plugin {
		return &agentv1.Plugin{Type: "loop", Instances: []*agentv1.PluginInstance{{ControllerCapabilities: []string{"CREATE_DELETE_VOLUME", "GET_CAPACITY"}}}}
	}
	ctx := context.Background()

	f := newFixture()
	f.plugins.statuses = []*agentv1.Plugin{offering(), {Type: "nfs", Instances: []*agentv1.PluginInstance{{ControllerCapabilities: []string{"CREATE_DELETE_VOLUME"}}}}}
	f.plugins.conn = serveController(t, capacityController{})
	got, err := f.server().GetPlugin(ctx, &agentv1.GetPluginRequest{Type: "loop"})
	if c := got.GetPlugin().GetCapacity(); err != nil || c.GetAvailableBytes() != 42<<30 || c.GetMaximumVolumeBytes() != 8<<30 || c.GetError() != "" {
		t.Errorf("GetPlugin loop = %v, %v; want its capacity", got, err)
	}
	got, err = f.server().GetPlugin(ctx, &agentv1.GetPluginRequest{Type: "nfs"})
	if err != nil || got.GetPlugin().GetCapacity() != nil {
		t.Errorf("GetPlugin of a plugin without GET_CAPACITY = %v, %v; want no capacity", got, err)
	}
	if list, err := f.server().ListPlugins(ctx, &agentv1.ListPluginsRequest{}); err != nil || list.GetPlugins()[0].GetCapacity() != nil {
		t.Errorf("ListPlugins = %v, %v; want no capacity (GetPlugin only)", list, err)
	}
	checkEvents(t, f.log, "ControllerConn loop csi.v1.Controller")

	f = newFixture()
	f.plugins.statuses = []*agentv1.Plugin{offering()}
	f.plugins.connErr = status.Error(codes.Unavailable, "plugin loop is not ready (BACKOFF)")
	got, err = f.server().GetPlugin(ctx, &agentv1.GetPluginRequest{Type: "loop"})
	if err != nil || !strings.Contains(got.GetPlugin().GetCapacity().GetError(), "not ready") {
		t.Errorf("GetPlugin of a plugin whose controller is down = %v, %v; want the plugin, its capacity saying why not", got, err)
	}

	f = newFixture()
	f.plugins.statuses = []*agentv1.Plugin{offering()}
	f.plugins.conn = serveController(t, csi.UnimplementedControllerServer{})
	got, err = f.server().GetPlugin(ctx, &agentv1.GetPluginRequest{Type: "loop"})
	if err != nil || !strings.HasPrefix(got.GetPlugin().GetCapacity().GetError(), "GetCapacity: ") {
		t.Errorf("GetPlugin of a plugin whose GetCapacity fails = %v, %v; want the error", got, err)
	}
}
