package agent

import (
	"context"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/volumestats"
)

// statsSource is the agent as the volume stats poller's source.
type statsSource struct{ a *Agent }

// Volumes lists the published volumes of plugins that report usage or
// health.
func (s statsSource) Volumes() []volumestats.Volume {
	var out []volumestats.Volume
	caps := map[string][]string{}
	for _, v := range s.a.iso.ListVolumes() {
		if v.State != statev1.VolumeCheckpoint_PUBLISHED {
			continue
		}
		c, ok := caps[v.Plugin]
		if !ok {
			c = s.a.set.NodeCapabilities(v.Plugin)
			caps[v.Plugin] = c
		}
		if slices.Contains(c, "GET_VOLUME_STATS") || slices.Contains(c, "GET_VOLUME_HEALTH") {
			out = append(out, volumestats.Volume{Plugin: v.Plugin, ID: v.ID, TargetPath: v.TargetPath, StagingPath: v.StagingPath})
		}
	}
	return out
}

// Poll has the isolator repair the volume if its target is no longer
// mounted (isolator.Repair), then asks the plugin for its usage and
// health; a failed repair is the poll's error (the figures of a path that
// is not mounted mean nothing).
func (s statsSource) Poll(ctx context.Context, v volumestats.Volume) volumestats.Stats {
	if _, err := s.a.iso.Repair(ctx, v.Plugin, v.ID); err != nil {
		return volumestats.Stats{Err: err}
	}
	conn, err := s.a.set.Node(v.Plugin).Conn(ctx, "csi.v1.Node")
	if err != nil {
		return volumestats.Stats{Err: err}
	}
	return volumestats.PollNode(ctx, csi.NewNodeClient(conn), s.a.set.NodeCapabilities(v.Plugin), v)
}
