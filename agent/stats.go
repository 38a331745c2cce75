package agent

import (
	"context"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csiagent/csiagent/mount"
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

// Poll repairs the volume if its target is no longer mounted, then asks
// the plugin for its usage and health; a failed repair is the poll's
// error (the figures of a path that is not mounted mean nothing).
func (s statsSource) Poll(ctx context.Context, v volumestats.Volume) volumestats.Stats {
	if err := s.a.repair(ctx, v); err != nil {
		return volumestats.Stats{Err: err}
	}
	conn, err := s.a.set.Node(v.Plugin).Conn(ctx, "csi.v1.Node")
	if err != nil {
		return volumestats.Stats{Err: err}
	}
	return volumestats.PollNode(ctx, csi.NewNodeClient(conn), s.a.set.NodeCapabilities(v.Plugin), v)
}

// repair republishes a volume whose target path is no longer mounted and
// re-binds it into its containers (see isolator.Repair), unless repair is
// off; it logs and counts what it did, and returns why it failed.
func (a *Agent) repair(ctx context.Context, v volumestats.Volume) error {
	if mounted, err := mount.IsMountPoint(v.TargetPath); err != nil || mounted {
		return nil
	}
	if a.cfg.NoRepair {
		a.log.Warn("a published volume's target path is not mounted; repair is off (--repair=false)", "plugin", v.Plugin, "volume", v.ID, "target", v.TargetPath)
		return nil
	}
	r, err := a.iso.Repair(ctx, v.Plugin, v.ID)
	if err != nil {
		a.metrics.repairs.WithLabelValues(v.Plugin, "failed").Inc()
		a.log.Error("repairing a volume whose target path was not mounted", "plugin", v.Plugin, "volume", v.ID, "rebound", r.Rebound, "skipped", r.Skipped, "error", err)
		return fmt.Errorf("repairing the volume (its target path was not mounted): %w", err)
	}
	if r.Republished {
		a.metrics.repairs.WithLabelValues(v.Plugin, "repaired").Inc()
		a.log.Warn("repaired a volume whose target path was not mounted: republished", "plugin", v.Plugin, "volume", v.ID, "rebound", r.Rebound, "skipped", r.Skipped)
	}
	return nil
}
