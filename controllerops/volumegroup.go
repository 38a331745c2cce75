package controllerops

import (
	"context"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/volumegroup"
)

func volumeGroupSpec(method string, table map[codes.Code]recovery) rpcSpec {
	return rpcSpec{service: VolumeGroupService, method: method, table: table}
}

// The volumegroup.Controller error tables (seed 000). Tables are built per
// call, so no mutable package state holds them.

func createVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("CreateVolumeGroup", map[codes.Code]recovery{
		codes.InvalidArgument: {false, "the plugin cannot make a volume group with these parameters: use different parameters"},
		codes.AlreadyExists:   {false, "a volume group with this name exists but is incompatible with these parameters: fix the arguments or use a different name"},
	})
}

func deleteVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("DeleteVolumeGroup", map[codes.Code]recovery{
		codes.FailedPrecondition: {true, "the volume group is in use or has snapshots: make sure nothing uses it and delete its snapshots (the agent retries meanwhile)"},
	})
}

func modifyVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("ModifyVolumeGroupMembership", map[codes.Code]recovery{
		codes.InvalidArgument:   {false, "a volume is incompatible with the others in the group or not supported: use different volume ids"},
		codes.NotFound:          {true, "a volume id or the volume group does not exist: verify the volume ids and that the group exists ('csi-agent group get')"},
		codes.ResourceExhausted: {true, "the volume group cannot take more volumes: remove volumes or raise the plugin's limit"},
	})
}

func getVolumeGroupSpec() rpcSpec {
	return volumeGroupSpec("ControllerGetVolumeGroup", map[codes.Code]recovery{
		codes.NotFound: {true, "no such volume group: verify the id ('csi-agent group list') and that the group has not been deleted"},
	})
}

// listVolumeGroupsSpec: with a starting token, Aborted means the token is
// invalid, which the caller handles by restarting (not by retrying).
func listVolumeGroupsSpec(withToken bool) rpcSpec {
	table := map[codes.Code]recovery{}
	if withToken {
		table[codes.Aborted] = recovery{false, "the plugin rejected the starting token: list again from the beginning"}
	}
	return volumeGroupSpec("ListVolumeGroups", table)
}

// Volume groups.

func (s *Server) CreateVolumeGroup(req *agentv1.CreateVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	return serve(s, "CreateVolumeGroup", req, stream, volumeGroupProgress, func(ctx context.Context, o *op) error {
		if req.GetName() == "" {
			return invalid("name is required: it makes the create idempotent")
		}
		if err := noEmpty("volume_ids", req.GetVolumeIds()); err != nil {
			return err
		}
		return o.withLock(ctx, "volume group name", req.GetName(), func(ctx context.Context) error {
			preq := &volumegroup.CreateVolumeGroupRequest{Name: req.GetName(), Parameters: req.GetParameters(), Secrets: req.GetSecrets(), VolumeIds: req.GetVolumeIds()}
			resp, err := callPlugin(ctx, o, createVolumeGroupSpec(), volumegroup.NewControllerClient, volumegroup.ControllerClient.CreateVolumeGroup, preq)
			if err != nil {
				return err
			}
			return stream.Send(&agentv1.VolumeGroupReply{VolumeGroup: resp.GetVolumeGroup()})
		})
	})
}

func (s *Server) ModifyVolumeGroup(req *agentv1.ModifyVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	return serve(s, "ModifyVolumeGroup", req, stream, volumeGroupProgress, func(ctx context.Context, o *op) error {
		if req.GetVolumeGroupId() == "" {
			return invalid("volume_group_id is required")
		}
		if err := noEmpty("volume_ids", req.GetVolumeIds()); err != nil {
			return err
		}
		switch {
		case len(req.GetVolumeIds()) == 0 && !req.GetRemoveAll():
			return invalid("volume_ids is empty, which removes every volume from the group: set remove_all to mean it")
		case len(req.GetVolumeIds()) > 0 && req.GetRemoveAll():
			return invalid("remove_all is set but volume_ids is not empty: choose one")
		}
		return o.withLock(ctx, "volume group", req.GetVolumeGroupId(), func(ctx context.Context) error {
			preq := &volumegroup.ModifyVolumeGroupMembershipRequest{
				VolumeGroupId: req.GetVolumeGroupId(), VolumeIds: req.GetVolumeIds(), Parameters: req.GetParameters(), Secrets: req.GetSecrets(),
			}
			resp, err := callPlugin(ctx, o, modifyVolumeGroupSpec(), volumegroup.NewControllerClient, volumegroup.ControllerClient.ModifyVolumeGroupMembership, preq)
			if err != nil {
				return err
			}
			return stream.Send(&agentv1.VolumeGroupReply{VolumeGroup: resp.GetVolumeGroup()})
		})
	})
}

func (s *Server) DeleteVolumeGroup(req *agentv1.DeleteVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	return serve(s, "DeleteVolumeGroup", req, stream, operationProgress, func(ctx context.Context, o *op) error {
		if req.GetVolumeGroupId() == "" {
			return invalid("volume_group_id is required")
		}
		return o.withLock(ctx, "volume group", req.GetVolumeGroupId(), func(ctx context.Context) error {
			preq := &volumegroup.DeleteVolumeGroupRequest{VolumeGroupId: req.GetVolumeGroupId(), Secrets: req.GetSecrets()}
			if _, err := callPlugin(ctx, o, deleteVolumeGroupSpec(), volumegroup.NewControllerClient, volumegroup.ControllerClient.DeleteVolumeGroup, preq); err != nil {
				return err
			}
			return stream.Send(&agentv1.OperationReply{Done: true})
		})
	})
}

func (s *Server) GetVolumeGroup(req *agentv1.GetVolumeGroupRequest, stream grpc.ServerStreamingServer[agentv1.VolumeGroupReply]) error {
	return serve(s, "GetVolumeGroup", req, stream, volumeGroupProgress, func(ctx context.Context, o *op) error {
		if req.GetVolumeGroupId() == "" {
			return invalid("volume_group_id is required")
		}
		preq := &volumegroup.ControllerGetVolumeGroupRequest{VolumeGroupId: req.GetVolumeGroupId(), Secrets: req.GetSecrets()}
		resp, err := callPlugin(ctx, o, getVolumeGroupSpec(), volumegroup.NewControllerClient, volumegroup.ControllerClient.ControllerGetVolumeGroup, preq)
		if err != nil {
			return err
		}
		return stream.Send(&agentv1.VolumeGroupReply{VolumeGroup: resp.GetVolumeGroup()})
	})
}

func (s *Server) ListVolumeGroups(req *agentv1.ListVolumeGroupsRequest, stream grpc.ServerStreamingServer[agentv1.ListVolumeGroupsReply]) error {
	return serve(s, "ListVolumeGroups", req, stream, listProgress, func(ctx context.Context, o *op) error {
		if req.GetMaxEntries() < 0 {
			return invalid("max_entries %d: must not be negative", req.GetMaxEntries())
		}
		reply, err := o.listVolumeGroups(ctx, req)
		if err != nil {
			return err
		}
		return stream.Send(reply)
	})
}

// listVolumeGroups pages through ListVolumeGroups. An Aborted answer to a
// call with a starting token means the token is invalid: listing starts
// again from the beginning, once (the spec's recovery); the next one
// fails.
func (o *op) listVolumeGroups(ctx context.Context, req *agentv1.ListVolumeGroupsRequest) (*agentv1.ListVolumeGroupsReply, error) {
	reply := &agentv1.ListVolumeGroupsReply{}
	token := req.GetStartingToken()
	seen := map[string]bool{}
	used := map[string]bool{}
	for page := 1; ; page++ {
		if page > maxListPages {
			return nil, status.Errorf(codes.Internal, "plugin %s: ListVolumeGroups: more than %d pages; the plugin's next_token never ends", o.plugin, maxListPages)
		}
		preq := &volumegroup.ListVolumeGroupsRequest{MaxEntries: req.GetMaxEntries(), StartingToken: token, Secrets: req.GetSecrets()}
		spec := listVolumeGroupsSpec(token != "")
		resp, err := callPlugin(ctx, o, spec, volumegroup.NewControllerClient, volumegroup.ControllerClient.ListVolumeGroups, preq)
		if token != "" && status.Code(err) == codes.Aborted {
			if reply.Restarted {
				return nil, status.Errorf(codes.Aborted, "%s; the listing was already restarted from the beginning once, so it is not restarted again: run it again later", status.Convert(err).Message())
			}
			if err := o.progress(&agentv1.Progress{
				Kind: agentv1.Progress_RESTART, Rpc: spec.name(), Code: codes.Aborted.String(), Message: status.Convert(err).Message(),
				Hint: "the starting token is not valid: listing again from the beginning; drop the entries received so far",
			}); err != nil {
				return nil, err
			}
			reply = &agentv1.ListVolumeGroupsReply{Restarted: true}
			token, seen, used = "", map[string]bool{}, map[string]bool{}
			continue
		}
		if err != nil {
			return nil, err
		}
		for _, e := range resp.GetEntries() {
			g := e.GetVolumeGroup()
			if g == nil || seen[g.GetVolumeGroupId()] {
				continue
			}
			seen[g.GetVolumeGroupId()] = true
			reply.VolumeGroups = append(reply.VolumeGroups, g)
		}
		next := resp.GetNextToken()
		if !req.GetAllPages() || next == "" {
			if req.GetAllPages() {
				next = ""
			}
			reply.NextToken = next
			return reply, nil
		}
		if used[next] || next == token {
			return nil, status.Errorf(codes.Internal, "plugin %s: ListVolumeGroups returned next_token %q again; stopping to avoid a loop", o.plugin, next)
		}
		used[next] = true
		token = next
	}
}
