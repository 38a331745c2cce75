package main

import (
	"context"
	"errors"
	"io/fs"
	"log"
	"os"
	"sync"
	"sync/atomic"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/csiagent/csiagent/internal/keyedlock"
	ekr "github.com/csiagent/csiagent/proto/encryptionkeyrotation"
	"github.com/csiagent/csiagent/proto/reclaimspace"
)

// plugin implements the services; which are registered depends on config.
type plugin struct {
	csi.UnimplementedIdentityServer
	csi.UnimplementedNodeServer
	csi.UnimplementedControllerServer
	reclaimspace.UnimplementedReclaimSpaceNodeServer
	ekr.UnimplementedEncryptionKeyRotationControllerServer

	cfg    config
	logger *log.Logger
	nodeID string
	// probes counts the Probe calls that got past the failure flags.
	probes atomic.Int64
	// stopping is closed when the plugin stops: calls that hang on
	// purpose then fail with Unavailable, so that GracefulStop returns.
	stopping chan struct{}
	// codec writes the responses --publish-misbehave-file poisons.
	codec    *poisonCodec
	stopOnce sync.Once
	// volumes refuses concurrent node calls on one volume id.
	volumes keyedlock.Map
}

var (
	_ csi.IdentityServer                        = (*plugin)(nil)
	_ csi.NodeServer                            = (*plugin)(nil)
	_ csi.ControllerServer                      = (*plugin)(nil)
	_ reclaimspace.ReclaimSpaceNodeServer       = (*plugin)(nil)
	_ ekr.EncryptionKeyRotationControllerServer = (*plugin)(nil)
)

func newPlugin(cfg config, logger *log.Logger) *plugin {
	nodeID := os.Getenv("MESOS_AGENT_ID")
	if nodeID == "" {
		nodeID = "test-node"
	}
	return &plugin{
		cfg:      cfg,
		logger:   logger,
		nodeID:   nodeID,
		stopping: make(chan struct{}),
		codec:    newPoisonCodec(),
	}
}

func (p *plugin) stop() { p.stopOnce.Do(func() { close(p.stopping) }) }

// hang blocks until the call's context ends or the plugin stops.
func (p *plugin) hang(ctx context.Context, why string) error {
	p.logger.Printf("hanging (%s)", why)
	select {
	case <-ctx.Done():
		return status.FromContextError(ctx.Err()).Err()
	case <-p.stopping:
		return status.Error(codes.Unavailable, "plugin is stopping")
	}
}

// logRPC logs each call when it starts and when it ends.
func (p *plugin) logRPC(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	p.logger.Printf("rpc %s", info.FullMethod)
	resp, err := handler(ctx, req)
	p.logger.Printf("rpc %s: %s", info.FullMethod, status.Code(err))
	return resp, err
}

// Identity

func (p *plugin) GetPluginInfo(ctx context.Context, _ *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	if p.cfg.hangInfo {
		return nil, p.hang(ctx, "--hang-info")
	}
	return &csi.GetPluginInfoResponse{Name: p.cfg.name, VendorVersion: version}, nil
}

func (p *plugin) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	resp := &csi.GetPluginCapabilitiesResponse{}
	if p.cfg.controller {
		resp.Capabilities = append(resp.Capabilities, &csi.PluginCapability{
			Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{
				Type: csi.PluginCapability_Service_CONTROLLER_SERVICE,
			}},
		})
	}
	return resp, nil
}

func (p *plugin) Probe(ctx context.Context, _ *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	switch {
	case p.cfg.probeHang:
		return nil, p.hang(ctx, "--probe-hang")
	case p.cfg.probeFail:
		return nil, status.Error(codes.Unavailable, "probe fails (--probe-fail)")
	case p.cfg.probeFailFile != "":
		_, err := os.Stat(p.cfg.probeFailFile)
		if err == nil {
			return nil, status.Errorf(codes.Unavailable, "probe fails while %s exists (--probe-fail-file)", p.cfg.probeFailFile)
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, status.Errorf(codes.Internal, "check --probe-fail-file: %v", err)
		}
	}
	ready := p.probes.Add(1) > int64(p.cfg.probeNotReady)
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(ready)}, nil
}

// Node (stage, unstage, publish and unpublish are in node.go)

func (p *plugin) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{
			Type: csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		}},
	}}}, nil
}

// topologyKey is the segment --topology-host sets.
const topologyKey = "topology.test.csiagent.io/host"

func (p *plugin) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	r := &csi.NodeGetInfoResponse{NodeId: p.nodeID, MaxVolumesPerNode: p.cfg.maxVolumes}
	if p.cfg.topologyHost != "" {
		r.AccessibleTopology = &csi.Topology{Segments: map[string]string{topologyKey: p.cfg.topologyHost}}
	}
	return r, nil
}

// Controller (registered with --controller)

func (p *plugin) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	return &csi.ControllerGetCapabilitiesResponse{}, nil
}

// ReclaimSpaceNode (registered with --reclaim)

// reclaimedBytes is what NodeReclaimSpace reports as freed.
const reclaimedBytes = 1 << 20

func (p *plugin) NodeReclaimSpace(ctx context.Context, req *reclaimspace.NodeReclaimSpaceRequest) (*reclaimspace.NodeReclaimSpaceResponse, error) {
	if req.GetVolumeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	if p.cfg.reclaimHang {
		return nil, p.hang(ctx, "--reclaim-hang")
	}
	return &reclaimspace.NodeReclaimSpaceResponse{
		PreUsage:  &reclaimspace.StorageConsumption{UsageBytes: reclaimedBytes},
		PostUsage: &reclaimspace.StorageConsumption{UsageBytes: 0},
	}, nil
}

// EncryptionKeyRotate (with --key-rotation) rotates nothing: it checks the
// request and logs the call.
func (p *plugin) EncryptionKeyRotate(_ context.Context, req *ekr.EncryptionKeyRotateRequest) (*ekr.EncryptionKeyRotateResponse, error) {
	if req.GetVolumeId() == "" || req.GetVolumePath() == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id and volume_path are required")
	}
	p.logger.Printf("key of volume %s rotated", req.GetVolumeId())
	return &ekr.EncryptionKeyRotateResponse{}, nil
}
