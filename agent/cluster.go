package agent

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"

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
