package controllerops

import (
	"context"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

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

func expandProgress(p *agentv1.Progress) *agentv1.ExpandVolumeReply {
	return &agentv1.ExpandVolumeReply{Progress: p}
}

// ExpandVolume grows a published volume on the node, online.
func (s *Server) ExpandVolume(req *agentv1.ExpandVolumeRequest, stream grpc.ServerStreamingServer[agentv1.ExpandVolumeReply]) error {
	return serve(s, "ExpandVolume", req, stream, expandProgress, func(ctx context.Context, o *op) error {
		id := req.GetVolumeId()
		switch {
		case id == "":
			return invalid("volume_id is required: a volume published on this host")
		case req.GetRequiredBytes() < 0:
			return invalid("required_bytes %d: must not be negative", req.GetRequiredBytes())
		case !slices.Contains(s.plugins.NodeCapabilities(o.plugin), "EXPAND_VOLUME"):
			return status.Errorf(codes.FailedPrecondition, "plugin %s does not offer the EXPAND_VOLUME node capability", o.plugin)
		}
		pv, ok := s.plugins.Published(o.plugin, id)
		if !ok {
			return status.Errorf(codes.FailedPrecondition, "volume %s of plugin %s is not published on this host: it is expanded where it is published", id, o.plugin)
		}
		capability := &csi.VolumeCapability{AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}}}
		if pv.Block {
			capability.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		}
		preq := &csi.NodeExpandVolumeRequest{VolumeId: id, VolumePath: pv.TargetPath, StagingTargetPath: pv.StagingPath,
			VolumeCapability: capability, Secrets: req.GetSecrets()}
		if r := req.GetRequiredBytes(); r > 0 {
			preq.CapacityRange = &csi.CapacityRange{RequiredBytes: r}
		}
		return o.withLock(ctx, "volume", id, func() error {
			resp, err := callPlugin(ctx, o, nodeExpandSpec(), csi.NewNodeClient, csi.NodeClient.NodeExpandVolume, preq)
			if err != nil {
				return err
			}
			return stream.Send(&agentv1.ExpandVolumeReply{Done: true, CapacityBytes: resp.GetCapacityBytes()})
		})
	})
}
