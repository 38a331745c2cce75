package loopplugin

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// TestTopologyAndLimit: the node and every volume are in the node's
// topology (TopologyKey=node id), GetPluginCapabilities says so, a
// CreateVolume whose requisite topology excludes the node fails
// ResourceExhausted before creating anything, and NodeGetInfo reports the
// configured max_volumes_per_node (a negative one is refused).
func TestTopologyAndLimit(t *testing.T) {
	e := newEnv(t, slog.LevelWarn)
	ctx := context.Background()
	here := &csi.Topology{Segments: map[string]string{TopologyKey: "node-1"}}
	there := &csi.Topology{Segments: map[string]string{TopologyKey: "node-2"}}

	info, err := e.node.NodeGetInfo(ctx, &csi.NodeGetInfoRequest{})
	if err != nil || info.GetAccessibleTopology().GetSegments()[TopologyKey] != "node-1" || info.GetMaxVolumesPerNode() != 0 {
		t.Fatalf("NodeGetInfo = %v, %v; want the node's topology and no limit", info, err)
	}
	caps, err := e.id.GetPluginCapabilities(ctx, &csi.GetPluginCapabilitiesRequest{})
	if err != nil || !slices.ContainsFunc(caps.GetCapabilities(), func(c *csi.PluginCapability) bool {
		return c.GetService().GetType() == csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS
	}) {
		t.Errorf("GetPluginCapabilities = %v, %v; want VOLUME_ACCESSIBILITY_CONSTRAINTS", caps, err)
	}
	mount := []*csi.VolumeCapability{{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}}
	_, err = e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "far", VolumeCapabilities: mount,
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{there}, Preferred: []*csi.Topology{there}}})
	if status.Code(err) != codes.ResourceExhausted {
		t.Errorf("CreateVolume requiring another node: %v; want ResourceExhausted", err)
	}
	if _, err := e.p.pool.Get("far"); !errors.Is(err, ErrNotFound) {
		t.Errorf("the refused volume exists: %v", err)
	}
	v, err := e.ctrl.CreateVolume(ctx, &csi.CreateVolumeRequest{Name: "near", VolumeCapabilities: mount,
		AccessibilityRequirements: &csi.TopologyRequirement{Requisite: []*csi.Topology{there, here}, Preferred: []*csi.Topology{there}}})
	if err != nil || len(v.GetVolume().GetAccessibleTopology()) != 1 || v.GetVolume().GetAccessibleTopology()[0].GetSegments()[TopologyKey] != "node-1" {
		t.Fatalf("CreateVolume with this node among the requisite: %v, %v; want the volume in this node's topology", v, err)
	}
	list, err := e.ctrl.ListVolumes(ctx, &csi.ListVolumesRequest{})
	if err != nil || len(list.GetEntries()) != 1 || list.GetEntries()[0].GetVolume().GetAccessibleTopology()[0].GetSegments()[TopologyKey] != "node-1" {
		t.Errorf("ListVolumes = %v, %v; want the volume with its topology", list, err)
	}

	limited, err := New(Config{Pool: e.pool, NodeID: "node-1", MaxVolumesPerNode: 3})
	if err != nil {
		t.Fatal(err)
	}
	if info, err := (&nodeServer{p: limited}).NodeGetInfo(ctx, &csi.NodeGetInfoRequest{}); err != nil || info.GetMaxVolumesPerNode() != 3 {
		t.Errorf("NodeGetInfo with a limit of 3: %v, %v", info, err)
	}
	if _, err := New(Config{Pool: e.pool, NodeID: "node-1", MaxVolumesPerNode: -1}); !errors.Is(err, ErrInvalid) {
		t.Errorf("a negative limit: %v; want ErrInvalid", err)
	}
}
