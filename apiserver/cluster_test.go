package apiserver

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/cluster"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

type fakeCluster struct {
	nodes []cluster.NodeStatus
	st    cluster.Status
	err   error
}

func (f fakeCluster) Nodes(context.Context) ([]cluster.NodeStatus, error) { return f.nodes, f.err }
func (f fakeCluster) Claims(context.Context) (cluster.Status, error)      { return f.st, f.err }

// TestClusterHandlers: in no cluster, FailedPrecondition saying how to
// join; not joined yet, or etcd not answering, Unavailable; else the
// nodes, claims and locks, every field carried.
func TestClusterHandlers(t *testing.T) {
	ctx := context.Background()
	if _, err := New(Config{}).ClusterNodes(ctx, &agentv1.ClusterNodesRequest{}); status.Code(err) != codes.FailedPrecondition {
		t.Errorf("in no cluster: %v, want FailedPrecondition", err)
	}
	if _, err := New(Config{Cluster: func() Cluster { return nil }}).ClusterClaims(ctx, &agentv1.ClusterClaimsRequest{}); status.Code(err) != codes.Unavailable {
		t.Errorf("not joined yet: %v, want Unavailable", err)
	}
	down := fakeCluster{err: fmt.Errorf("listing the nodes: %w", cluster.ErrUnavailable)}
	if _, err := New(Config{Cluster: func() Cluster { return down }}).ClusterNodes(ctx, &agentv1.ClusterNodesRequest{}); status.Code(err) != codes.Unavailable {
		t.Errorf("etcd not answering: %v, want Unavailable", err)
	}
	now := time.Unix(1700000000, 0).UTC()
	f := fakeCluster{
		nodes: []cluster.NodeStatus{{NodeRecord: cluster.NodeRecord{ID: "a", Registered: now, Info: cluster.NodeInfo{AgentVersion: "v1", Plugins: []cluster.PluginInfo{{Type: "loop"}}}}, Alive: true}},
		st: cluster.Status{
			Claims: []cluster.ClaimStatus{{Plugin: "loop", Volume: "v", Mode: cluster.Exclusive, Holders: []cluster.Holder{{Node: "a", Since: now, Alive: true}}}},
			Locks:  []cluster.LockStatus{{Kind: "volume", ID: "v", Holder: "a", Waiters: []string{"b"}}},
		},
	}
	s := New(Config{Cluster: func() Cluster { return f }})
	nodes, err := s.ClusterNodes(ctx, &agentv1.ClusterNodesRequest{})
	if n := nodes.GetNodes(); err != nil || len(n) != 1 || n[0].GetNodeId() != "a" || !n[0].GetAlive() || n[0].GetAgentVersion() != "v1" || n[0].GetPlugins()[0] != "loop" || !n[0].GetRegistered().AsTime().Equal(now) {
		t.Errorf("nodes: %v, %v", nodes, err)
	}
	claims, err := s.ClusterClaims(ctx, &agentv1.ClusterClaimsRequest{})
	c, l := claims.GetClaims(), claims.GetLocks()
	if err != nil || len(c) != 1 || c[0].GetMode() != "exclusive" || c[0].GetHolders()[0].GetNodeId() != "a" || !c[0].GetHolders()[0].GetAlive() ||
		len(l) != 1 || l[0].GetHolder() != "a" || l[0].GetWaiters()[0] != "b" {
		t.Errorf("claims: %v, %v", claims, err)
	}
}
