package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/csiagent/csiagent/mount"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
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
		if v.GetState() != agentv1.VolumeStatus_PUBLISHED {
			continue
		}
		c, ok := caps[v.GetPluginName()]
		if !ok {
			c = s.a.set.NodeCapabilities(v.GetPluginName())
			caps[v.GetPluginName()] = c
		}
		if slices.Contains(c, "GET_VOLUME_STATS") || slices.Contains(c, "GET_VOLUME_HEALTH") {
			out = append(out, volumestats.Volume{Plugin: v.GetPluginName(), ID: v.GetVolumeId(), TargetPath: v.GetTargetPath(), StagingPath: v.GetStagingPath()})
		}
	}
	return out
}

// Poll calls NodeGetVolumeStats and NodeGetVolumeHealth, as the plugin
// offers them.
func (s statsSource) Poll(ctx context.Context, v volumestats.Volume) volumestats.Stats {
	var st volumestats.Stats
	s.a.repair(ctx, v)
	conn, err := liveNode{s.a, v.Plugin}.conn(ctx, "csi.v1.Node")
	if err != nil {
		st.Err = err
		return st
	}
	node := csi.NewNodeClient(conn)
	caps := s.a.set.NodeCapabilities(v.Plugin)
	if slices.Contains(caps, "GET_VOLUME_STATS") {
		resp, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.ID, VolumePath: v.TargetPath, StagingTargetPath: v.StagingPath})
		if err != nil {
			st.Err = fmt.Errorf("NodeGetVolumeStats: %w", err)
			return st
		}
		for _, u := range resp.GetUsage() {
			x := volumestats.Usage{Known: true, Total: u.GetTotal(), Used: u.GetUsed(), Available: u.GetAvailable()}
			switch u.GetUnit() {
			case csi.VolumeUsage_BYTES:
				st.Bytes = x
			case csi.VolumeUsage_INODES:
				st.Inodes = x
			}
		}
	}
	if slices.Contains(caps, "GET_VOLUME_HEALTH") {
		resp, err := node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: v.ID, VolumePublishPath: v.TargetPath, StagingTargetPath: v.StagingPath})
		if err != nil {
			st.Err = fmt.Errorf("NodeGetVolumeHealth: %w", err)
			return st
		}
		st.HealthKnown = true
		var conds []string
		for _, h := range resp.GetVolumeHealth().GetHealthStatuses() {
			conds = append(conds, strings.TrimSpace(fmt.Sprintf("%s %s: %s", h.GetStatus(), h.GetReason(), h.GetMessage())))
		}
		st.Abnormal, st.Condition = len(conds) > 0, strings.Join(conds, "; ")
	}
	return st
}

// volumeStatsCollector exports the last poll of each published volume,
// like kubelet's kubelet_volume_stats_*. Series exist only for polled,
// published volumes, so their number is bounded by what is published.
type volumeStatsCollector struct {
	a                                      *Agent
	capacity, used, available              *prometheus.Desc
	inodes, inodesUsed, inodesFree, health *prometheus.Desc
}

var _ prometheus.Collector = (*volumeStatsCollector)(nil)

func newVolumeStatsCollector(a *Agent) *volumeStatsCollector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, []string{"plugin", "volume_id"}, nil)
	}
	return &volumeStatsCollector{
		a:          a,
		capacity:   d("csi_agent_volume_stats_capacity_bytes", "Capacity of the published volume in bytes (NodeGetVolumeStats)."),
		used:       d("csi_agent_volume_stats_used_bytes", "Bytes used on the published volume (NodeGetVolumeStats)."),
		available:  d("csi_agent_volume_stats_available_bytes", "Bytes available on the published volume (NodeGetVolumeStats)."),
		inodes:     d("csi_agent_volume_stats_inodes", "Inodes of the published volume (NodeGetVolumeStats)."),
		inodesUsed: d("csi_agent_volume_stats_inodes_used", "Inodes used on the published volume (NodeGetVolumeStats)."),
		inodesFree: d("csi_agent_volume_stats_inodes_free", "Inodes free on the published volume (NodeGetVolumeStats)."),
		health: d("csi_agent_volume_condition_abnormal",
			"1 when the plugin reports adverse health conditions for the published volume (NodeGetVolumeHealth), else 0."),
	}
}

func (c *volumeStatsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.capacity, c.used, c.available, c.inodes, c.inodesUsed, c.inodesFree, c.health} {
		ch <- d
	}
}

func (c *volumeStatsCollector) Collect(ch chan<- prometheus.Metric) {
	for k, s := range c.a.stats.Snapshot() {
		g := func(d *prometheus.Desc, v int64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, float64(v), k.Plugin, k.ID)
		}
		if s.Bytes.Known {
			g(c.capacity, s.Bytes.Total)
			g(c.used, s.Bytes.Used)
			g(c.available, s.Bytes.Available)
		}
		if s.Inodes.Known {
			g(c.inodes, s.Inodes.Total)
			g(c.inodesUsed, s.Inodes.Used)
			g(c.inodesFree, s.Inodes.Available)
		}
		if s.HealthKnown {
			abnormal := int64(0)
			if s.Abnormal {
				abnormal = 1
			}
			g(c.health, abnormal)
		}
	}
}

// repair republishes a volume whose target path is no longer mounted and
// re-binds it into its containers (see isolator.Repair), unless repair is
// off; it logs and counts what it did.
func (a *Agent) repair(ctx context.Context, v volumestats.Volume) {
	if mounted, err := mount.IsMountPoint(v.TargetPath); err != nil || mounted {
		return
	}
	if a.cfg.NoRepair {
		a.log.Warn("a published volume's target path is not mounted; repair is off (--repair=false)", "plugin", v.Plugin, "volume", v.ID, "target", v.TargetPath)
		return
	}
	r, err := a.iso.Repair(ctx, v.Plugin, v.ID)
	if err != nil {
		a.metrics.repairs.WithLabelValues(v.Plugin, "failed").Inc()
		a.log.Error("repairing a volume whose target path was not mounted", "plugin", v.Plugin, "volume", v.ID, "rebound", r.Rebound, "skipped", r.Skipped, "error", err)
		return
	}
	if r.Republished {
		a.metrics.repairs.WithLabelValues(v.Plugin, "repaired").Inc()
		a.log.Warn("repaired a volume whose target path was not mounted: republished", "plugin", v.Plugin, "volume", v.ID, "rebound", r.Rebound, "skipped", r.Skipped)
	}
}
