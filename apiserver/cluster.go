package apiserver

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/cluster"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// Cluster is the fleet as the API reports it (package cluster); nil when
// the agent is in no cluster.
type Cluster interface {
	Nodes(ctx context.Context) ([]cluster.NodeStatus, error)
	Claims(ctx context.Context) (cluster.Status, error)
	ReleaseNode(ctx context.Context, node, volume string, nodeIsDown bool, fenced func(ctx context.Context, addresses []string) error) ([]cluster.ClaimStatus, error)
}

// clusterOf is the agent's cluster, or FailedPrecondition saying how to
// join one.
func (s *Server) clusterOf() (Cluster, error) {
	if s.cfg.Cluster == nil {
		return nil, status.Error(codes.FailedPrecondition, "the agent is in no cluster: start it with --cluster-etcd-endpoints")
	}
	c := s.cfg.Cluster()
	if c == nil {
		return nil, status.Error(codes.Unavailable, "the agent has not joined its cluster yet")
	}
	return c, nil
}

// ClusterNodes lists the fleet's nodes.
func (s *Server) ClusterNodes(ctx context.Context, _ *agentv1.ClusterNodesRequest) (*agentv1.ClusterNodesResponse, error) {
	c, err := s.clusterOf()
	if err != nil {
		return nil, err
	}
	nodes, err := c.Nodes(ctx)
	if err != nil {
		return nil, Status(err)
	}
	out := &agentv1.ClusterNodesResponse{}
	for _, n := range nodes {
		out.Nodes = append(out.Nodes, ClusterNode(n))
	}
	return out, nil
}

// ClusterClaims lists the fleet's claims and locks.
func (s *Server) ClusterClaims(ctx context.Context, _ *agentv1.ClusterClaimsRequest) (*agentv1.ClusterClaimsResponse, error) {
	c, err := s.clusterOf()
	if err != nil {
		return nil, err
	}
	st, err := c.Claims(ctx)
	if err != nil {
		return nil, Status(err)
	}
	return ClusterClaims(st), nil
}

// ClusterRelease hands a dead node's claims over: root only, since it
// lets another host use volumes the node may still be writing to unless
// it is fenced or down.
func (s *Server) ClusterRelease(ctx context.Context, req *agentv1.ClusterReleaseRequest) (*agentv1.ClusterReleaseResponse, error) {
	if err := rootOnly(ctx, "ClusterRelease hands a node's volumes to other hosts"); err != nil {
		return nil, err
	}
	c, err := s.clusterOf()
	if err != nil {
		return nil, err
	}
	if req.GetNodeId() == "" {
		return nil, status.Error(codes.InvalidArgument, "node_id is required: the dead node whose claims to release (csi-agent cluster nodes lists them)")
	}
	out := &agentv1.ClusterReleaseResponse{}
	var fenced func(context.Context, []string) error
	if f := req.GetFence(); f != nil {
		if s.cfg.Fence == nil {
			return nil, status.Error(codes.FailedPrecondition, "this agent cannot fence: it has no controller operations")
		}
		fenced = func(ctx context.Context, addresses []string) error {
			fr := proto.CloneOf(f)
			fr.Cidrs = addresses
			if err := s.cfg.Fence(ctx, fr); err != nil {
				return err
			}
			out.FencedCidrs = addresses
			return nil
		}
	}
	released, err := c.ReleaseNode(ctx, req.GetNodeId(), req.GetVolumeId(), req.GetNodeIsDown(), fenced)
	for _, r := range released {
		out.Released = append(out.Released, ClusterClaim(r))
	}
	if err != nil {
		return nil, Status(err)
	}
	return out, nil
}
