package agent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/cluster"
	"github.com/csiagent/csiagent/internal/version"
	"github.com/csiagent/csiagent/isolator"
)

// ClusterConfig is how the agent joins a fleet (csi-agent serve
// --cluster-etcd-endpoints ...).
type ClusterConfig struct {
	// Endpoints are etcd's client URLs; none: one host, no cluster.
	Endpoints []string
	TLS       cluster.TLSFiles
	// Prefix is the fleet's key prefix in etcd (cluster.DefaultPrefix
	// when empty).
	Prefix string
}

// clusterDir holds the node's claims file in the work dir.
const clusterDir = "cluster"

// clusterCloseTimeout bounds revoking the lease at shutdown.
const clusterCloseTimeout = 5 * time.Second

// claims is the isolator's Config.Claims: nil without a cluster.
func (a *Agent) claims() isolator.Claims {
	if len(a.cfg.Cluster.Endpoints) == 0 {
		return nil
	}
	return clusterClaims{a}
}

// startCluster joins the fleet (without waiting for etcd: a store that is
// down fails new claims closed, never the start).
func (a *Agent) startCluster(ctx context.Context) (stop func(), err error) {
	cc := a.cfg.Cluster
	if len(cc.Endpoints) == 0 {
		return func() {}, nil
	}
	c, err := cluster.Join(ctx, cluster.Config{
		Endpoints: cc.Endpoints, TLS: cc.TLS, Prefix: cc.Prefix, NodeID: a.cfg.NodeID,
		Info:     cluster.NodeInfo{AgentVersion: version.Version},
		StateDir: filepath.Join(a.cfg.WorkDir, clusterDir), Commit: a.commit,
		InUse:  a.volumeInUse,
		Logger: a.log,
	})
	if err != nil {
		return nil, fmt.Errorf("joining the cluster at %v: %w", cc.Endpoints, err)
	}
	a.cluster.Store(c)
	a.log.Info("joined the cluster", "endpoints", cc.Endpoints, "node_id", a.cfg.NodeID)
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), clusterCloseTimeout)
		defer cancel()
		if err := c.Close(ctx); err != nil {
			a.log.Warn("leaving the cluster", "error", err)
		}
	}, nil
}

// apiCluster is the API's view of the fleet: nil in no cluster.
func (a *Agent) apiCluster() func() apiserver.Cluster {
	if len(a.cfg.Cluster.Endpoints) == 0 {
		return nil
	}
	return func() apiserver.Cluster {
		if c := a.cluster.Load(); c != nil {
			return c
		}
		return nil
	}
}

// volumeInUse reports whether the isolator tracks the volume (it is on the
// node, or on its way on or off): a snapshot, taking no volume lock.
func (a *Agent) volumeInUse(plugin, volumeID string) bool {
	for _, v := range a.iso.ListVolumes() {
		if v.Plugin == plugin && v.ID == volumeID {
			return true
		}
	}
	return false
}

// clusterClaims gives the isolator the fleet's claims, its refusals in
// the isolator's classes.
type clusterClaims struct{ a *Agent }

func (c clusterClaims) Claim(ctx context.Context, plugin, volumeID string, capability *csi.VolumeCapability) error {
	cl := c.a.cluster.Load()
	if cl == nil {
		return classified{class: isolator.ErrUnavailable, err: errors.New("the agent has not joined its cluster yet")}
	}
	err := cl.Claim(ctx, plugin, volumeID, capability)
	switch {
	case errors.Is(err, cluster.ErrConflict), errors.Is(err, cluster.ErrRevoked):
		return classified{class: isolator.ErrPrecondition, err: err}
	case errors.Is(err, cluster.ErrUnavailable):
		return classified{class: isolator.ErrUnavailable, err: err}
	}
	return err
}

func (c clusterClaims) Release(ctx context.Context, plugin, volumeID string) error {
	cl := c.a.cluster.Load()
	if cl == nil {
		return errors.New("the agent has not joined its cluster yet")
	}
	return cl.Release(ctx, plugin, volumeID)
}

// clusterCollector exports the fleet's counters (cluster.Stats) as
// csi_agent_cluster_* metrics; nothing when the agent is in no cluster.
type clusterCollector struct {
	stats func() (cluster.Stats, bool)
}

var clusterDescs = struct {
	connected, held, pending, revoked, conflicts, lockWaits, locksHeld *prometheus.Desc
}{
	connected: prometheus.NewDesc("csi_agent_cluster_connected", "1 while the node is registered in the fleet and its last etcd call answered, else 0.", nil, nil),
	held:      prometheus.NewDesc("csi_agent_cluster_claims_held", "Volume claims this node holds (its claims file).", nil, nil),
	pending:   prometheus.NewDesc("csi_agent_cluster_pending_releases", "Claims released here that etcd has not been told of yet (it did not answer).", nil, nil),
	revoked:   prometheus.NewDesc("csi_agent_cluster_revoked_claims", "Claims released in etcd while this node held them (a dead-node release while it was away): refused for new use, reported.", nil, nil),
	conflicts: prometheus.NewDesc("csi_agent_cluster_claim_conflicts_total", "Claims refused because another node held the volume.", nil, nil),
	lockWaits: prometheus.NewDesc("csi_agent_cluster_lock_waits_total", "Cluster-wide lock requests that found the lock held and waited.", nil, nil),
	locksHeld: prometheus.NewDesc("csi_agent_cluster_locks_held", "Cluster-wide locks this node holds now.", nil, nil),
}

func (clusterCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{clusterDescs.connected, clusterDescs.held, clusterDescs.pending, clusterDescs.revoked, clusterDescs.conflicts, clusterDescs.lockWaits, clusterDescs.locksHeld} {
		ch <- d
	}
}

func (c clusterCollector) Collect(ch chan<- prometheus.Metric) {
	st, ok := c.stats()
	if !ok {
		return
	}
	connected := 0.0
	if st.Connected {
		connected = 1
	}
	for _, m := range []struct {
		d *prometheus.Desc
		t prometheus.ValueType
		v float64
	}{
		{clusterDescs.connected, prometheus.GaugeValue, connected},
		{clusterDescs.held, prometheus.GaugeValue, float64(st.ClaimsHeld)},
		{clusterDescs.pending, prometheus.GaugeValue, float64(st.PendingReleases)},
		{clusterDescs.revoked, prometheus.GaugeValue, float64(st.Revoked)},
		{clusterDescs.conflicts, prometheus.CounterValue, float64(st.Conflicts)},
		{clusterDescs.lockWaits, prometheus.CounterValue, float64(st.LockWaits)},
		{clusterDescs.locksHeld, prometheus.GaugeValue, float64(st.LocksHeld)},
	} {
		ch <- prometheus.MustNewConstMetric(m.d, m.t, m.v)
	}
}

// clusterStats is the fleet's counters, once joined.
func (a *Agent) clusterStats() (cluster.Stats, bool) {
	c := a.cluster.Load()
	if c == nil {
		return cluster.Stats{}, false
	}
	return c.Stats(), true
}
