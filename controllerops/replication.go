package controllerops

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/replication"
)

// replicationFailedPrecondition is the recovery of the
// FAILED_PRECONDITION row of the replication.Controller RPCs that have
// one.
var replicationFailedPrecondition = map[string]string{
	"PromoteVolume":                 "the volume cannot be promoted: make sure replication is enabled ('csi-agent replication enable'); a volume that can only be promoted by force needs --force",
	"DemoteVolume":                  "the volume cannot be demoted: make sure replication is enabled ('csi-agent replication enable')",
	"ResyncVolume":                  "the volume cannot be resynced: make sure replication is enabled and the volume is demoted ('csi-agent replication demote')",
	"GetVolumeReplicationInfo":      "no replication info: make sure replication is enabled and the volume is promoted (primary)",
	"GetReplicationDestinationInfo": "no destination: make sure replication is enabled ('csi-agent replication enable')",
}

// replicationSpec is a replication.Controller RPC's error table (seed
// 003 and upstream's replication/README.md).
func replicationSpec(method string) rpcSpec {
	table := map[codes.Code]recovery{
		codes.InvalidArgument: {false, "a required field is missing or invalid: fix the request"},
		codes.NotFound:        {true, "the volume (or volume group) does not exist: verify the id and that it has not been deleted"},
	}
	if r, ok := replicationFailedPrecondition[method]; ok {
		table[codes.FailedPrecondition] = recovery{false, r}
	}
	if method == "GetReplicationDestinationInfo" {
		table[codes.Unavailable] = recovery{true, "the destination is not known yet: the plugin needs time after replication is enabled (the agent retries meanwhile)"}
	}
	return rpcSpec{service: ReplicationService, method: method, table: table}
}

// Replication.

// replicationOp is what differs between the replication operations.
type replicationOp struct {
	method      string // the API method
	rpc         string // the plugin RPC
	force, wait bool   // takes force; polls until ready
	// A query: takes no parameters.
	query bool
}

func (s *Server) EnableReplication(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "EnableReplication", rpc: "EnableVolumeReplication"})
}

func (s *Server) DisableReplication(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "DisableReplication", rpc: "DisableVolumeReplication"})
}

func (s *Server) PromoteVolume(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "PromoteVolume", rpc: "PromoteVolume", force: true})
}

func (s *Server) DemoteVolume(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "DemoteVolume", rpc: "DemoteVolume", force: true})
}

func (s *Server) ResyncVolume(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "ResyncVolume", rpc: "ResyncVolume", force: true, wait: true})
}

func (s *Server) GetReplicationInfo(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "GetReplicationInfo", rpc: "GetVolumeReplicationInfo", query: true})
}

func (s *Server) GetReplicationDestination(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply]) error {
	return s.replicate(req, stream, replicationOp{method: "GetReplicationDestination", rpc: "GetReplicationDestinationInfo", query: true})
}

// replicate runs one replication operation on a volume or volume group.
func (s *Server) replicate(req *agentv1.ReplicationRequest, stream grpc.ServerStreamingServer[agentv1.ReplicationReply], ro replicationOp) error {
	return serve(s, ro.method, req, stream, replicationProgress, func(ctx context.Context, o *op) error {
		var (
			src      *replication.ReplicationSource
			kind, id string
		)
		switch v := req.GetSource().(type) {
		case *agentv1.ReplicationRequest_VolumeId:
			if v.VolumeId == "" {
				return invalid("volume_id is empty")
			}
			kind, id = "volume", v.VolumeId
			src = &replication.ReplicationSource{Type: &replication.ReplicationSource_Volume{Volume: &replication.ReplicationSource_VolumeSource{VolumeId: v.VolumeId}}}
		case *agentv1.ReplicationRequest_VolumeGroupId:
			if v.VolumeGroupId == "" {
				return invalid("volume_group_id is empty")
			}
			kind, id = "volume group", v.VolumeGroupId
			src = &replication.ReplicationSource{Type: &replication.ReplicationSource_Volumegroup{Volumegroup: &replication.ReplicationSource_VolumeGroupSource{VolumeGroupId: v.VolumeGroupId}}}
		default:
			return invalid("name the volume_id or the volume_group_id to replicate")
		}
		switch {
		case req.GetForce() && !ro.force:
			return invalid("force applies to PromoteVolume, DemoteVolume and ResyncVolume only, not %s", ro.rpc)
		case req.GetNoWait() && !ro.wait:
			return invalid("no_wait applies to ResyncVolume only")
		case ro.query && len(req.GetParameters()) > 0:
			return invalid("%s takes no parameters", ro.rpc)
		case ro.rpc == "GetReplicationDestinationInfo" && req.GetReplicationId() != "":
			return invalid("GetReplicationDestinationInfo takes no replication_id")
		}
		spec := replicationSpec(ro.rpc)
		return o.withLock(ctx, kind, id, func(ctx context.Context) error {
			var (
				preq  proto.Message
				call  func(ctx context.Context, conn *grpc.ClientConn) error
				ready = true
				info  *agentv1.ReplicationInfo
				dest  *agentv1.ReplicationDestination
			)
			p, sec, rid, force := req.GetParameters(), req.GetSecrets(), req.GetReplicationId(), req.GetForce()
			switch ro.rpc {
			case "EnableVolumeReplication":
				r := &replication.EnableVolumeReplicationRequest{Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, replicationCall(replication.ControllerClient.EnableVolumeReplication, r, nil)
			case "DisableVolumeReplication":
				r := &replication.DisableVolumeReplicationRequest{Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, replicationCall(replication.ControllerClient.DisableVolumeReplication, r, nil)
			case "PromoteVolume":
				r := &replication.PromoteVolumeRequest{Force: force, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, replicationCall(replication.ControllerClient.PromoteVolume, r, nil)
			case "DemoteVolume":
				r := &replication.DemoteVolumeRequest{Force: force, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, replicationCall(replication.ControllerClient.DemoteVolume, r, nil)
			case "ResyncVolume":
				r := &replication.ResyncVolumeRequest{Force: force, Parameters: p, Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, replicationCall(replication.ControllerClient.ResyncVolume, r, func(resp *replication.ResyncVolumeResponse) {
					ready = resp.GetReady()
				})
			case "GetVolumeReplicationInfo":
				r := &replication.GetVolumeReplicationInfoRequest{Secrets: sec, ReplicationId: rid, ReplicationSource: src}
				preq, call = r, replicationCall(replication.ControllerClient.GetVolumeReplicationInfo, r, func(resp *replication.GetVolumeReplicationInfoResponse) {
					info = &agentv1.ReplicationInfo{LastSyncTime: resp.GetLastSyncTime(), LastSyncDuration: resp.GetLastSyncDuration(), LastSyncBytes: resp.GetLastSyncBytes(),
						Status: resp.GetStatus().String(), StatusMessage: resp.GetStatusMessage()}
				})
			case "GetReplicationDestinationInfo":
				r := &replication.GetReplicationDestinationInfoRequest{Secrets: sec, ReplicationSource: src}
				preq, call = r, replicationCall(replication.ControllerClient.GetReplicationDestinationInfo, r, func(resp *replication.GetReplicationDestinationInfoResponse) {
					d := resp.GetReplicationDestination()
					dest = &agentv1.ReplicationDestination{VolumeId: d.GetVolume().GetVolumeId(),
						VolumeGroupId: d.GetVolumegroup().GetVolumeGroupId(), VolumeIds: d.GetVolumegroup().GetVolumeIds()}
				})
			default:
				return status.Errorf(codes.Internal, "unknown replication RPC %s", ro.rpc)
			}
			if ro.wait {
				var err error
				ready, err = o.untilReady(ctx, spec, req.GetNoWait(), fmt.Sprintf("the resync of %s %s", kind, id), func(ctx context.Context) (bool, error) {
					err := o.invoke(ctx, spec, preq, call)
					return ready, err
				})
				if err != nil {
					return err
				}
			} else if err := o.invoke(ctx, spec, preq, call); err != nil {
				return err
			}
			return stream.Send(&agentv1.ReplicationReply{Done: true, Ready: ready, Info: info, Destination: dest})
		})
	})
}

// replicationCall is a call of the plugin's replication RPC method with
// r; got, if not nil, gets the plugin's reply after a successful call.
func replicationCall[Req, Resp any](method func(replication.ControllerClient, context.Context, Req, ...grpc.CallOption) (Resp, error), r Req, got func(Resp)) func(context.Context, *grpc.ClientConn) error {
	return func(ctx context.Context, conn *grpc.ClientConn) error {
		resp, err := method(replication.NewControllerClient(conn), ctx, r)
		if err == nil && got != nil {
			got(resp)
		}
		return err
	}
}
