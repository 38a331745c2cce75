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
	// release is ReleaseNode.
	release func(ctx context.Context, node, volume string, nodeIsDown bool, fenced func(context.Context, []string) error) ([]cluster.ClaimStatus, error)
}

func (f fakeCluster) ReleaseNode(ctx context.Context, node, volume string, nodeIsDown bool, fenced func(context.Context, []string) error) ([]cluster.ClaimStatus, error) {
	return f.release(ctx, node, volume, nodeIsDown, fenced)
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

// TestClusterRelease: root only; the node is required; the fence request
// reaches Fence with the node's registered addresses (its own cidrs
// ignored), and the reply carries them and the released claims; the
// cluster's refusals keep their codes.
func TestClusterRelease(t *testing.T) {
	ctx := caller(rootCred)
	var fencedWith *agentv1.FenceRequest
	f := fakeCluster{release: func(ctx context.Context, node, volume string, nodeIsDown bool, fenced func(context.Context, []string) error) ([]cluster.ClaimStatus, error) {
		switch node {
		case "alive":
			return nil, fmt.Errorf("%w: node alive holds a live lease", cluster.ErrNodeAlive)
		case "ghost":
			return nil, fmt.Errorf("%w: node ghost never registered", cluster.ErrNotFound)
		}
		if !nodeIsDown {
			if fenced == nil {
				return nil, fmt.Errorf("%w: no fencer", cluster.ErrNotFenced)
			}
			if err := fenced(ctx, []string{"10.0.0.7/32"}); err != nil {
				return nil, err
			}
		}
		return []cluster.ClaimStatus{{Plugin: "loop", Volume: volume, Mode: cluster.Exclusive, Holders: []cluster.Holder{{Node: node}}}}, nil
	}}
	s := New(Config{Cluster: func() Cluster { return f }, Fence: func(_ context.Context, req *agentv1.FenceRequest) error {
		fencedWith = req
		return nil
	}})
	for _, c := range []struct {
		req  *agentv1.ClusterReleaseRequest
		code codes.Code
	}{
		{&agentv1.ClusterReleaseRequest{}, codes.InvalidArgument},
		{&agentv1.ClusterReleaseRequest{NodeId: "alive", NodeIsDown: true}, codes.FailedPrecondition},
		{&agentv1.ClusterReleaseRequest{NodeId: "ghost", NodeIsDown: true}, codes.NotFound},
		{&agentv1.ClusterReleaseRequest{NodeId: "dead"}, codes.FailedPrecondition},
	} {
		if _, err := s.ClusterRelease(ctx, c.req); status.Code(err) != c.code {
			t.Errorf("ClusterRelease(%v): %v, want %v", c.req, err, c.code)
		}
	}
	resp, err := s.ClusterRelease(ctx, &agentv1.ClusterReleaseRequest{NodeId: "dead", VolumeId: "v", Fence: &agentv1.FenceRequest{PluginName: "loop", Cidrs: []string{"1.2.3.4/32"}}})
	if err != nil || len(resp.GetReleased()) != 1 || resp.GetReleased()[0].GetVolumeId() != "v" || len(resp.GetFencedCidrs()) != 1 || resp.GetFencedCidrs()[0] != "10.0.0.7/32" {
		t.Fatalf("fenced release: %v, %v", resp, err)
	}
	if fencedWith.GetPluginName() != "loop" || len(fencedWith.GetCidrs()) != 1 || fencedWith.GetCidrs()[0] != "10.0.0.7/32" {
		t.Fatalf("Fence called with %v, want plugin loop and the node's registered address only", fencedWith)
	}
	member := caller(memberCred)
	if _, err := s.ClusterRelease(member, &agentv1.ClusterReleaseRequest{NodeId: "dead", NodeIsDown: true}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("a member's ClusterRelease: %v, want PermissionDenied", err)
	}
}
