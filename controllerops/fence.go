package controllerops

import (
	"context"
	"net/netip"
	"slices"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/fence"
)

// FenceService is the csi-addons network fencing service, as discovery
// names it.
const FenceService = "fence.FenceController"

// fenceSpec is a fence.FenceController RPC's error table (upstream
// fence/README.md: one table for every RPC; the rest is the general
// scheme).
func fenceSpec(method string) rpcSpec {
	return rpcSpec{service: FenceService, method: method, table: map[codes.Code]recovery{
		codes.InvalidArgument: {false, "a required field is missing, or a field is not allowed by the plugin or invalid: fix the request (CIDRs, parameters)"},
	}}
}

func fenceProgress(p *agentv1.Progress) *agentv1.FenceReply { return &agentv1.FenceReply{Progress: p} }

// cidrs validates and normalises the request's CIDRs.
func cidrs(in []string, required bool) ([]*fence.CIDR, error) {
	if required && len(in) == 0 {
		return nil, invalid("cidrs is required: the networks to fence or unfence, e.g. 10.90.1.0/24")
	}
	var out []*fence.CIDR
	for _, c := range in {
		p, err := netip.ParsePrefix(strings.TrimSpace(c))
		if err != nil {
			return nil, invalid("cidr %q: %v", c, err)
		}
		out = append(out, &fence.CIDR{Cidr: p.Masked().String()})
	}
	return out, nil
}

func (s *Server) FenceNetwork(req *agentv1.FenceRequest, stream grpc.ServerStreamingServer[agentv1.FenceReply]) error {
	return s.fenceOp(req, stream, true)
}

func (s *Server) UnfenceNetwork(req *agentv1.FenceRequest, stream grpc.ServerStreamingServer[agentv1.FenceReply]) error {
	return s.fenceOp(req, stream, false)
}

// Fence runs FenceClusterNetwork for req outside a stream, its progress
// logged (csi-agent cluster release fences a dead node with it).
func (s *Server) Fence(ctx context.Context, req *agentv1.FenceRequest) error {
	log := s.log.With("method", "FenceNetwork", "plugin", req.GetPluginName())
	return s.run(ctx, "FenceNetwork", req, func(p *agentv1.Progress) error {
		log.Info("fencing", "progress", p.GetKind().String(), "message", p.GetMessage(), "code", p.GetCode())
		return nil
	}, fenceBody(req, true))
}

// fenceOp runs FenceClusterNetwork (fence) or UnfenceClusterNetwork.
func (s *Server) fenceOp(req *agentv1.FenceRequest, stream grpc.ServerStreamingServer[agentv1.FenceReply], fence bool) error {
	method := "UnfenceNetwork"
	if fence {
		method = "FenceNetwork"
	}
	body := fenceBody(req, fence)
	return serve(s, method, req, stream, fenceProgress, func(ctx context.Context, o *op) error {
		if err := body(ctx, o); err != nil {
			return err
		}
		return stream.Send(&agentv1.FenceReply{Done: true})
	})
}

// fenceBody is the operation: one fencing operation per plugin at a time.
func fenceBody(req *agentv1.FenceRequest, fenceIt bool) func(ctx context.Context, o *op) error {
	rpc := "UnfenceClusterNetwork"
	if fenceIt {
		rpc = "FenceClusterNetwork"
	}
	return func(ctx context.Context, o *op) error {
		cs, err := cidrs(req.GetCidrs(), true)
		if err != nil {
			return err
		}
		return o.withLock(ctx, "network fence", "", func(ctx context.Context) error {
			return o.invoke(ctx, fenceSpec(rpc), req, func(ctx context.Context, conn *grpc.ClientConn) error {
				c := fence.NewFenceControllerClient(conn)
				if fenceIt {
					_, err := c.FenceClusterNetwork(ctx, &fence.FenceClusterNetworkRequest{Parameters: req.GetParameters(), Secrets: req.GetSecrets(), Cidrs: cs})
					return err
				}
				_, err := c.UnfenceClusterNetwork(ctx, &fence.UnfenceClusterNetworkRequest{Parameters: req.GetParameters(), Secrets: req.GetSecrets(), Cidrs: cs})
				return err
			})
		})
	}
}

func (s *Server) ListFences(req *agentv1.FenceRequest, stream grpc.ServerStreamingServer[agentv1.FenceReply]) error {
	return serve(s, "ListFences", req, stream, fenceProgress, func(ctx context.Context, o *op) error {
		if len(req.GetCidrs()) > 0 {
			return invalid("cidrs must be empty: ListClusterFence lists every fenced network")
		}
		preq := &fence.ListClusterFenceRequest{Parameters: req.GetParameters(), Secrets: req.GetSecrets()}
		resp, err := callPlugin(ctx, o, fenceSpec("ListClusterFence"), fence.NewFenceControllerClient, fence.FenceControllerClient.ListClusterFence, preq)
		if err != nil {
			return err
		}
		var out []string
		for _, c := range resp.GetCidrs() {
			out = append(out, c.GetCidr())
		}
		slices.Sort(out)
		return stream.Send(&agentv1.FenceReply{Done: true, Cidrs: out})
	})
}
