package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"path/filepath"
	"reflect"
	"slices"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/cluster"
	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/internal/version"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pluginconfig"
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
	// FenceCIDRs are the networks the node registers for fencing; empty:
	// the addresses of its interfaces that are up (hostCIDRs).
	FenceCIDRs []string
	// LeaseTTL and CallTimeout: cluster.Config's (its defaults when 0).
	LeaseTTL, CallTimeout time.Duration
}

// clusterDir holds the node's claim records in the work dir.
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
	fence, err := fenceCIDRs(cc.FenceCIDRs)
	if err != nil {
		return nil, err
	}
	// Registered without capacity: no plugin call on the start's path
	// (publishNodeInfo asks, in the background).
	info := a.nodeInfo(ctx, fence, nil)
	c, err := cluster.Join(ctx, cluster.Config{
		Endpoints: cc.Endpoints, TLS: cc.TLS, Prefix: cc.Prefix, NodeID: a.cfg.NodeID,
		Info:     info,
		StateDir: filepath.Join(a.cfg.WorkDir, clusterDir), Commit: a.commit,
		InUse: a.iso.Tracks, Recovered: a.iso.Recovered(),
		LeaseTTL: cc.LeaseTTL, CallTimeout: cc.CallTimeout,
		Logger: a.log,
	})
	if err != nil {
		return nil, fmt.Errorf("joining the cluster at %v: %w", cc.Endpoints, err)
	}
	a.cluster.Store(c)
	a.log.Info("joined the cluster", "endpoints", cc.Endpoints, "node_id", a.cfg.NodeID, "fence_cidrs", fence)
	pctx, stopInfo := context.WithCancel(context.WithoutCancel(ctx))
	published := make(chan struct{})
	go func() {
		defer close(published)
		a.publishNodeInfo(pctx, c, fence, info)
	}()
	return func() {
		stopInfo()
		<-published
		ctx, cancel := context.WithTimeout(context.Background(), clusterCloseTimeout)
		defer cancel()
		if err := c.Close(ctx); err != nil {
			a.log.Warn("leaving the cluster", "error", err)
		}
	}, nil
}

// nodeInfoInterval is how often the plugins' capacity in the node's
// registered info is refreshed; nodeInfoSettle how long a plugin change
// is let settle (volume changes wake the same channel) before the info
// is rebuilt.
const (
	nodeInfoInterval = time.Minute
	nodeInfoSettle   = time.Second
)

// capacityTimeout bounds one plugin's GetCapacity for the node's info.
const capacityTimeout = 5 * time.Second

// publishNodeInfo keeps what the node registers (joined is what it joined
// with) current, until ctx ends: rebuilt after plugin changes (at most
// once per nodeInfoSettle), with each plugin's capacity asked when it
// first appears and every nodeInfoInterval.
func (a *Agent) publishNodeInfo(ctx context.Context, c *cluster.Cluster, fence []string, joined cluster.NodeInfo) {
	last := &joined
	capacity := map[string]int64{}
	tick := time.NewTicker(nodeInfoInterval)
	defer tick.Stop()
	for {
		changed := a.set.Changed()
		info := a.nodeInfo(ctx, fence, capacity)
		if last == nil || !reflect.DeepEqual(*last, info) {
			last = &info
			if err := c.SetInfo(ctx, info); err != nil && !errors.Is(err, cluster.ErrUnavailable) {
				a.log.Warn("cluster: updating the node's registered info", "error", err)
				last = nil // again at the next change or tick
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-changed:
			select {
			case <-ctx.Done():
				return
			case <-time.After(nodeInfoSettle):
			}
		case <-tick.C:
			clear(capacity)
		}
	}
}

// nodeInfo is what the node registers: its ready node plugins with their
// topology, max volumes and (where the controller offers GET_CAPACITY)
// available capacity, asked unless capacity has the plugin's (never with
// a nil capacity), the agent's version and the fencing networks.
func (a *Agent) nodeInfo(ctx context.Context, fence []string, capacity map[string]int64) cluster.NodeInfo {
	info := cluster.NodeInfo{AgentVersion: version.Version, FenceAddresses: fence}
	statuses, _ := a.set.Statuses()
	for _, ps := range statuses {
		r := a.set.Get(ps.Type)
		if r == nil {
			continue
		}
		st, conn, _ := r.Instance(pluginconfig.NodeService)
		if conn == nil {
			continue // not ready: registered once it is
		}
		pi := cluster.PluginInfo{Type: ps.Type, Topology: st.AccessibleTopology, MaxVolumes: st.MaxVolumesPerNode}
		avail, known := capacity[ps.Type]
		if cst, cconn, _ := r.Instance(pluginconfig.ControllerService); capacity != nil && !known && cconn != nil &&
			slices.Contains(cst.ControllerCapabilities, csi.ControllerServiceCapability_RPC_GET_CAPACITY.String()) {
			cctx, cancel := context.WithTimeout(ctx, capacityTimeout)
			resp, err := csi.NewControllerClient(cconn).GetCapacity(cctx, &csi.GetCapacityRequest{})
			cancel()
			if err != nil {
				a.log.Debug("cluster: GetCapacity for the node's info", "plugin", ps.Type, "error", err)
			}
			avail = resp.GetAvailableCapacity()
			capacity[ps.Type] = avail
		}
		pi.AvailableCapacity = avail
		info.Plugins = append(info.Plugins, pi)
	}
	return info
}

// fenceCIDRs checks the configured fencing networks, or finds the host's.
func fenceCIDRs(configured []string) ([]string, error) {
	if len(configured) > 0 {
		out := make([]string, 0, len(configured))
		for _, c := range configured {
			p, err := netip.ParsePrefix(c)
			if err != nil {
				return nil, fmt.Errorf("--cluster-fence-cidrs: %q is not a network such as 10.0.3.7/32: %w", c, err)
			}
			out = append(out, p.Masked().String())
		}
		return out, nil
	}
	return hostCIDRs()
}

// hostCIDRs are the addresses of the host's interfaces that are up, each
// as a one-address network (loopback and link-local left out).
func hostCIDRs() ([]string, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return nil, fmt.Errorf("listing the host's interfaces for its fencing addresses (set --cluster-fence-cidrs): %w", err)
	}
	var out []string
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			return nil, fmt.Errorf("the addresses of %s (set --cluster-fence-cidrs): %w", ifc.Name, err)
		}
		for _, ad := range addrs {
			ipn, ok := ad.(*net.IPNet)
			if !ok {
				continue
			}
			ip, ok := netip.AddrFromSlice(ipn.IP)
			if !ok || !ip.Unmap().IsGlobalUnicast() {
				continue
			}
			ip = ip.Unmap()
			out = append(out, netip.PrefixFrom(ip, ip.BitLen()).String())
		}
	}
	slices.Sort(out)
	return slices.Compact(out), nil
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

// fleetLocks gives the controller operations the fleet's locks: nil in
// no cluster.
func (a *Agent) fleetLocks() controllerops.FleetLocks {
	if len(a.cfg.Cluster.Endpoints) == 0 {
		return nil
	}
	return fleetLocks{a}
}

type fleetLocks struct{ a *Agent }

// Lock is the cluster's Lock, its errors as status codes: etcd not
// answering (or not joined yet) Unavailable, the deadline reached while
// another node held it DeadlineExceeded naming the node.
func (f fleetLocks) Lock(ctx context.Context, kind, id string, waiting func(holder string)) (context.Context, func(), error) {
	c := f.a.cluster.Load()
	if c == nil {
		return nil, nil, status.Error(codes.Unavailable, "the agent has not joined its cluster yet: no fleet-wide lock")
	}
	held, unlock, err := c.Lock(ctx, kind, id, waiting)
	if err != nil {
		return nil, nil, apiserver.Status(err)
	}
	return held, unlock, nil
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
	held:      prometheus.NewDesc("csi_agent_cluster_claims_held", "Volume claims this node holds (its claim records).", nil, nil),
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
