package apiserver

import (
	"context"
	"errors"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/cluster"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// Cluster is the fleet as the API reports it (package cluster); nil when
// the agent is in no cluster.
type Cluster interface {
	Nodes(ctx context.Context) ([]cluster.NodeStatus, error)
	Claims(ctx context.Context) (cluster.Status, error)
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

// clusterStatus maps the cluster's errors: etcd not answering is
// Unavailable.
func clusterStatus(err error) error {
	if errors.Is(err, cluster.ErrUnavailable) {
		return status.Error(codes.Unavailable, err.Error())
	}
	return status.Error(codes.Internal, err.Error())
}

// ClusterNodes lists the fleet's nodes.
func (s *Server) ClusterNodes(ctx context.Context, _ *agentv1.ClusterNodesRequest) (*agentv1.ClusterNodesResponse, error) {
	c, err := s.clusterOf()
	if err != nil {
		return nil, err
	}
	nodes, err := c.Nodes(ctx)
	if err != nil {
		return nil, clusterStatus(err)
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
		return nil, clusterStatus(err)
	}
	return ClusterClaims(st), nil
}
