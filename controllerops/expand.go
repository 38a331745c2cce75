package controllerops

import (
	"cmp"
	"context"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// nodeExpandSpec is NodeExpandVolume's error table (CSI spec).
func nodeExpandSpec() rpcSpec {
	return rpcSpec{service: "csi.v1.Node", method: "NodeExpandVolume", node: true, table: map[codes.Code]recovery{
		codes.InvalidArgument:    {false, "the plugin rejected the request (e.g. an unsupported capability): fix it"},
		codes.NotFound:           {true, "the plugin does not find the volume at its path: verify it is still published ('csi-agent volumes')"},
		codes.OutOfRange:         {false, "the size is not supported: grow the volume on the backend first, or ask for a size it holds"},
		codes.FailedPrecondition: {false, "the volume cannot be expanded now (e.g. not staged or in an unsupported state): see the plugin's message"},
	}}
}

// controllerExpandSpec is ControllerExpandVolume's error table (CSI spec).
func controllerExpandSpec() rpcSpec {
	return rpcSpec{service: ControllerService, method: "ControllerExpandVolume", table: map[codes.Code]recovery{
		codes.InvalidArgument:    {false, "the plugin rejected the request (e.g. an unsupported capability or size): fix it"},
		codes.NotFound:           {false, "the plugin has no such volume: check the volume id"},
		codes.OutOfRange:         {false, "the backend cannot grow the volume to that size: ask for a size it supports"},
		codes.FailedPrecondition: {false, "the volume cannot be expanded now (e.g. in use where the plugin expands offline only): see the plugin's message"},
	}}
}

// controllerCapabilitiesSpec is ControllerGetCapabilities's.
func controllerCapabilitiesSpec() rpcSpec {
	return rpcSpec{service: ControllerService, method: "ControllerGetCapabilities"}
}

func expandProgress(p *agentv1.Progress) *agentv1.ExpandVolumeReply {
	return &agentv1.ExpandVolumeReply{Progress: p}
}

// ExpandVolume grows a volume: on the backend first (ControllerExpandVolume)
// when the plugin's controller offers EXPAND_VOLUME, then, when the
// controller says node expansion is required (or offers nothing), on this
// host where the volume is published (NodeExpandVolume, online), each with
// the capability the volume was staged with. Without plugin_name, the
// plugin is the one publishing the volume here.
func (s *Server) ExpandVolume(req *agentv1.ExpandVolumeRequest, stream grpc.ServerStreamingServer[agentv1.ExpandVolumeReply]) error {
	if req.GetPluginName() == "" && req.GetVolumeId() != "" {
		switch ps := s.plugins.Publishing(req.GetVolumeId()); len(ps) {
		case 0:
			return invalid("plugin_name is required: volume %s is not published on this host, so the agent cannot tell its plugin", req.GetVolumeId())
		case 1:
			req = proto.CloneOf(req)
			req.PluginName = ps[0]
		default:
			return invalid("plugin_name is required: plugins %s each publish a volume %s here", strings.Join(ps, ", "), req.GetVolumeId())
		}
	}
	return serve(s, "ExpandVolume", req, stream, expandProgress, func(ctx context.Context, o *op) error {
		id := req.GetVolumeId()
		switch {
		case id == "":
			return invalid("volume_id is required")
		case req.GetRequiredBytes() < 0:
			return invalid("required_bytes %d: must not be negative", req.GetRequiredBytes())
		}
		pv, published := s.plugins.Published(o.plugin, id)
		return o.withLock(ctx, "volume", id, func(ctx context.Context) error {
			ctrl, err := o.controllerExpands(ctx)
			if err != nil {
				return err
			}
			var capacity int64
			node := true
			if ctrl {
				if req.GetRequiredBytes() == 0 {
					return invalid("required_bytes is required: plugin %s grows volumes on its backend (ControllerExpandVolume) and needs the new size", o.plugin)
				}
				creq := &csi.ControllerExpandVolumeRequest{VolumeId: id, CapacityRange: &csi.CapacityRange{RequiredBytes: req.GetRequiredBytes()},
					Secrets: req.GetSecrets(), VolumeCapability: pv.Capability}
				resp, err := callPlugin(ctx, o, controllerExpandSpec(), csi.NewControllerClient, csi.ControllerClient.ControllerExpandVolume, creq)
				if err != nil {
					return err
				}
				capacity, node = resp.GetCapacityBytes(), resp.GetNodeExpansionRequired()
			}
			if node {
				n, err := s.nodeExpand(ctx, o, req, pv, published, ctrl)
				if err != nil {
					return err
				}
				capacity = cmp.Or(n, capacity)
			}
			return stream.Send(&agentv1.ExpandVolumeReply{Done: true, CapacityBytes: capacity})
		})
	})
}

// controllerExpands reports whether the plugin's controller offers
// EXPAND_VOLUME; a plugin without a controller does not.
func (o *op) controllerExpands(ctx context.Context) (bool, error) {
	resp, err := callPlugin(ctx, o, controllerCapabilitiesSpec(), csi.NewControllerClient, csi.ControllerClient.ControllerGetCapabilities, &csi.ControllerGetCapabilitiesRequest{})
	switch status.Code(err) {
	case codes.OK:
	case codes.Unimplemented, codes.FailedPrecondition:
		return false, nil // no controller (or no instance serves one)
	default:
		return false, err
	}
	for _, c := range resp.GetCapabilities() {
		if c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_EXPAND_VOLUME {
			return true, nil
		}
	}
	return false, nil
}

// nodeExpand grows the volume on this host (NodeExpandVolume) with the
// capability it was staged with; ctrl: the controller grew it first.
func (s *Server) nodeExpand(ctx context.Context, o *op, req *agentv1.ExpandVolumeRequest, pv PublishedVolume, published, ctrl bool) (int64, error) {
	id := req.GetVolumeId()
	switch {
	case !slices.Contains(s.plugins.NodeCapabilities(o.plugin), "EXPAND_VOLUME") && ctrl:
		return 0, status.Errorf(codes.FailedPrecondition, "plugin %s grew volume %s on its backend and says the node must grow it too, but its node service does not offer EXPAND_VOLUME", o.plugin, id)
	case !slices.Contains(s.plugins.NodeCapabilities(o.plugin), "EXPAND_VOLUME"):
		return 0, status.Errorf(codes.FailedPrecondition, "plugin %s offers neither controller nor node EXPAND_VOLUME", o.plugin)
	case !published:
		return 0, status.Errorf(codes.FailedPrecondition, "volume %s of plugin %s is not published on this host: the node part of its expansion is done where it is published", id, o.plugin)
	}
	capability := pv.Capability
	if capability == nil { // a volume rebuilt without its request
		capability = &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}
		if pv.Block {
			capability.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		}
	}
	preq := &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: pv.TargetPath, StagingTargetPath: pv.StagingPath,
		VolumeCapability: capability, Secrets: req.GetSecrets()}
	if r := req.GetRequiredBytes(); r > 0 {
		preq.CapacityRange = &csi.CapacityRange{RequiredBytes: r}
	}
	resp, err := callPlugin(ctx, o, nodeExpandSpec(), csi.NewNodeClient, csi.NodeClient.NodeExpandVolume, preq)
	if err != nil {
		return 0, err
	}
	return resp.GetCapacityBytes(), nil
}
