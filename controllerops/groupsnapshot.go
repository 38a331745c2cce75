package controllerops

import (
	"context"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

func groupControllerSpec(method string, table map[codes.Code]recovery) rpcSpec {
	return rpcSpec{service: GroupControllerService, method: method, table: table}
}

const snapshotIDsMismatch = "the snapshot ids do not match the group snapshot: pass the ids that 'csi-agent group-snapshot create' printed"

func createGroupSnapshotSpec() rpcSpec {
	return groupControllerSpec("CreateVolumeGroupSnapshot", map[codes.Code]recovery{
		codes.AlreadyExists:      {false, "a group snapshot with this name exists for other volumes or parameters: fix the arguments or use a different name"},
		codes.FailedPrecondition: {false, "these volumes cannot be snapshotted together: fix their configuration to meet the plugin's requirements for group snapshots"},
		codes.ResourceExhausted:  {false, "not enough space for the group snapshot: free space, then run again"},
	})
}

func deleteGroupSnapshotSpec() rpcSpec {
	return groupControllerSpec("DeleteVolumeGroupSnapshot", map[codes.Code]recovery{
		codes.InvalidArgument:    {false, snapshotIDsMismatch},
		codes.FailedPrecondition: {true, "the group snapshot is in use: make sure nothing uses it (the agent retries meanwhile)"},
	})
}

func getGroupSnapshotSpec() rpcSpec {
	return groupControllerSpec("GetVolumeGroupSnapshot", map[codes.Code]recovery{
		codes.InvalidArgument: {false, snapshotIDsMismatch},
		codes.NotFound:        {true, "no such group snapshot: verify the id and that it has not been deleted"},
	})
}

// Group snapshots.

// requireGroupSnapshots asks the plugin's GroupController for its
// capabilities: group snapshots need CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT.
func (o *op) requireGroupSnapshots(ctx context.Context) error {
	spec := groupControllerSpec("GroupControllerGetCapabilities", nil)
	resp, err := callPlugin(ctx, o, spec, csi.NewGroupControllerClient, csi.GroupControllerClient.GroupControllerGetCapabilities, &csi.GroupControllerGetCapabilitiesRequest{})
	if status.Code(err) == codes.Unimplemented {
		return status.Errorf(codes.FailedPrecondition, "plugin %s does not support group snapshots: it does not serve %s (GroupControllerGetCapabilities is Unimplemented)", o.plugin, GroupControllerService)
	}
	if err != nil {
		return err
	}
	var have []string
	for _, c := range resp.GetCapabilities() {
		t := c.GetRpc().GetType()
		if t == csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT {
			return nil
		}
		have = append(have, t.String())
	}
	return status.Errorf(codes.FailedPrecondition, "plugin %s does not support group snapshots: its group controller lacks the CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT capability (it reports [%s])",
		o.plugin, strings.Join(have, ", "))
}

func (s *Server) CreateGroupSnapshot(req *agentv1.CreateGroupSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.GroupSnapshotReply]) error {
	return serve(s, "CreateGroupSnapshot", req, stream, groupSnapshotProgress, func(ctx context.Context, o *op) error {
		switch {
		case req.GetName() == "":
			return invalid("name is required: it makes the create idempotent")
		case len(req.GetSourceVolumeIds()) == 0:
			return invalid("source_volume_ids is required: the volumes to snapshot together")
		}
		if err := noEmpty("source_volume_ids", req.GetSourceVolumeIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		return o.withLock(ctx, "group snapshot name", req.GetName(), func() error {
			spec := createGroupSnapshotSpec()
			preq := &csi.CreateVolumeGroupSnapshotRequest{Name: req.GetName(), SourceVolumeIds: req.GetSourceVolumeIds(), Secrets: req.GetSecrets(), Parameters: req.GetParameters()}
			var snap *csi.VolumeGroupSnapshot
			_, err := o.untilReady(ctx, spec, req.GetNoWait(), "group snapshot "+req.GetName(), func(ctx context.Context) (bool, error) {
				resp, err := callPlugin(ctx, o, spec, csi.NewGroupControllerClient, csi.GroupControllerClient.CreateVolumeGroupSnapshot, preq)
				snap = resp.GetGroupSnapshot()
				return snap.GetReadyToUse(), err
			})
			if err != nil {
				return err
			}
			return stream.Send(&agentv1.GroupSnapshotReply{GroupSnapshot: snap})
		})
	})
}

// groupSnapshotRef checks the fields get and delete need.
func groupSnapshotRef(id string, snapshotIDs []string) error {
	switch {
	case id == "":
		return invalid("group_snapshot_id is required")
	case len(snapshotIDs) == 0:
		return invalid("snapshot_ids is required (CSI): the ids of the group's snapshots, as 'csi-agent group-snapshot create' printed them")
	}
	return noEmpty("snapshot_ids", snapshotIDs)
}

func (s *Server) GetGroupSnapshot(req *agentv1.GetGroupSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.GroupSnapshotReply]) error {
	return serve(s, "GetGroupSnapshot", req, stream, groupSnapshotProgress, func(ctx context.Context, o *op) error {
		if err := groupSnapshotRef(req.GetGroupSnapshotId(), req.GetSnapshotIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		preq := &csi.GetVolumeGroupSnapshotRequest{GroupSnapshotId: req.GetGroupSnapshotId(), SnapshotIds: req.GetSnapshotIds(), Secrets: req.GetSecrets()}
		resp, err := callPlugin(ctx, o, getGroupSnapshotSpec(), csi.NewGroupControllerClient, csi.GroupControllerClient.GetVolumeGroupSnapshot, preq)
		if err != nil {
			return err
		}
		return stream.Send(&agentv1.GroupSnapshotReply{GroupSnapshot: resp.GetGroupSnapshot()})
	})
}

func (s *Server) DeleteGroupSnapshot(req *agentv1.DeleteGroupSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	return serve(s, "DeleteGroupSnapshot", req, stream, operationProgress, func(ctx context.Context, o *op) error {
		if err := groupSnapshotRef(req.GetGroupSnapshotId(), req.GetSnapshotIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		return o.withLock(ctx, "group snapshot", req.GetGroupSnapshotId(), func() error {
			preq := &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: req.GetGroupSnapshotId(), SnapshotIds: req.GetSnapshotIds(), Secrets: req.GetSecrets()}
			if _, err := callPlugin(ctx, o, deleteGroupSnapshotSpec(), csi.NewGroupControllerClient, csi.GroupControllerClient.DeleteVolumeGroupSnapshot, preq); err != nil {
				return err
			}
			return stream.Send(&agentv1.OperationReply{Done: true})
		})
	})
}
