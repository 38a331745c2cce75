package volumestats

import "github.com/prometheus/client_golang/prometheus"

// collector is the Prometheus view of a Poller's last results.
type collector struct {
	p                                      *Poller
	capacity, used, available              *prometheus.Desc
	inodes, inodesUsed, inodesFree, health *prometheus.Desc
}

var _ prometheus.Collector = (*collector)(nil)

// NewCollector exports the last poll of each published volume, like
// kubelet's kubelet_volume_stats_*. Series exist only for polled,
// published volumes, so their number is bounded by what is published.
func NewCollector(p *Poller) prometheus.Collector {
	d := func(name, help string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, []string{"plugin", "volume_id"}, nil)
	}
	return &collector{
		p:          p,
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

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.capacity, c.used, c.available, c.inodes, c.inodesUsed, c.inodesFree, c.health} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	for k, s := range c.p.Snapshot() {
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
