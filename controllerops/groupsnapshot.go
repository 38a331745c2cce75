package controllerops

import (
	"context"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/snapcat"
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
	req, err := s.containerVolumes(req)
	if err != nil {
		return err
	}
	return serve(s, "CreateGroupSnapshot", req, stream, groupSnapshotProgress, func(ctx context.Context, o *op) error {
		if err := catalogueName(req.GetName()); err != nil {
			return err
		}
		if len(req.GetSourceVolumeIds()) == 0 {
			return invalid("source_volume_ids (or container_id) is required: the volumes to snapshot together")
		}
		if err := noEmpty("source_volume_ids", req.GetSourceVolumeIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		return o.withLock(ctx, "group snapshot name", req.GetName(), func(ctx context.Context) error {
			want := &snapcat.Entry{Name: req.GetName(), Kind: snapcat.KindGroup, Plugin: o.plugin,
				SourceVolumes: req.GetSourceVolumeIds(), Container: req.GetContainerId()}
			return s.recordCreate(want, func(e *snapcat.Entry) error {
				spec := createGroupSnapshotSpec()
				preq := &csi.CreateVolumeGroupSnapshotRequest{Name: e.CSIName(), SourceVolumeIds: req.GetSourceVolumeIds(), Secrets: req.GetSecrets(), Parameters: req.GetParameters()}
				var snap *csi.VolumeGroupSnapshot
				call := func(ctx context.Context) error {
					resp, err := callPlugin(ctx, o, spec, csi.NewGroupControllerClient, csi.GroupControllerClient.CreateVolumeGroupSnapshot, preq)
					snap = resp.GetGroupSnapshot()
					return err
				}
				cut := call
				if req.GetContainerId() != "" && e.Intent {
					cut = func(ctx context.Context) error { return s.whileContainerFrozen(ctx, o, req, call) }
				}
				_, err := o.untilReady(ctx, spec, req.GetNoWait(), "group snapshot "+req.GetName(), func(ctx context.Context) (bool, error) {
					err := cut(ctx)
					cut = call
					if err != nil {
						return false, err
					}
					recordGroup(e, snap)
					return e.Ready, s.cat.Put(e)
				})
				if err != nil {
					return err
				}
				return stream.Send(&agentv1.GroupSnapshotReply{GroupSnapshot: snap})
			})
		})
	})
}

// recordGroup sets e from the plugin's group snapshot.
func recordGroup(e *snapcat.Entry, snap *csi.VolumeGroupSnapshot) {
	e.Intent, e.GroupSnapshotID, e.Ready, e.Created = false, snap.GetGroupSnapshotId(), snap.GetReadyToUse(), created(snap.GetCreationTime())
	e.Members, e.SizeBytes = map[string]string{}, 0
	for _, m := range snap.GetSnapshots() {
		e.Members[m.GetSourceVolumeId()] = m.GetSnapshotId()
		e.SizeBytes += m.GetSizeBytes()
	}
}

// catalogueGroup fills a get or delete request by name from the
// catalogue: its plugin, group snapshot id and snapshot ids.
func (s *Server) catalogueGroup(name, plugin, id string, snapshotIDs []string) (*snapcat.Entry, error) {
	if name == "" {
		return nil, nil
	}
	if plugin != "" || id != "" || len(snapshotIDs) > 0 {
		return nil, invalid("give either name or plugin_name, group_snapshot_id and snapshot_ids")
	}
	e, err := s.cat.Get(name)
	switch {
	case err != nil:
		return nil, status.Error(codes.NotFound, err.Error())
	case e.Kind != snapcat.KindGroup:
		return nil, status.Errorf(codes.FailedPrecondition, "%s is a snapshot, not a group snapshot: 'csi-agent snapshot rm %s' removes it", name, name)
	case e.Intent:
		return nil, status.Errorf(codes.FailedPrecondition, "group snapshot %s: its create was interrupted before the plugin gave ids: run the same 'csi-agent group-snapshot create' again first", name)
	}
	return e, nil
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
	e, err := s.catalogueGroup(req.GetName(), req.GetPluginName(), req.GetGroupSnapshotId(), req.GetSnapshotIds())
	if err != nil {
		return err
	}
	if e != nil {
		req = proto.CloneOf(req)
		req.PluginName, req.GroupSnapshotId, req.SnapshotIds = e.Plugin, e.GroupSnapshotID, e.SnapshotIDs()
	}
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
	e, err := s.catalogueGroup(req.GetName(), req.GetPluginName(), req.GetGroupSnapshotId(), req.GetSnapshotIds())
	if err != nil {
		return err
	}
	if e != nil {
		req = proto.CloneOf(req)
		req.PluginName, req.GroupSnapshotId, req.SnapshotIds = e.Plugin, e.GroupSnapshotID, e.SnapshotIDs()
	}
	return serve(s, "DeleteGroupSnapshot", req, stream, operationProgress, func(ctx context.Context, o *op) error {
		if err := groupSnapshotRef(req.GetGroupSnapshotId(), req.GetSnapshotIds()); err != nil {
			return err
		}
		if err := o.requireGroupSnapshots(ctx); err != nil {
			return err
		}
		return o.withLock(ctx, "group snapshot", req.GetGroupSnapshotId(), func(ctx context.Context) error {
			preq := &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: req.GetGroupSnapshotId(), SnapshotIds: req.GetSnapshotIds(), Secrets: req.GetSecrets()}
			if _, err := callPlugin(ctx, o, deleteGroupSnapshotSpec(), csi.NewGroupControllerClient, csi.GroupControllerClient.DeleteVolumeGroupSnapshot, preq); err != nil {
				return err
			}
			if err := s.forgetGroup(o.plugin, req.GetGroupSnapshotId()); err != nil {
				return err
			}
			return stream.Send(&agentv1.OperationReply{Done: true})
		})
	})
}

// forgetGroup removes the catalogue's entries of a deleted group snapshot.
func (s *Server) forgetGroup(plugin, id string) error {
	for _, e := range s.cat.List() {
		if e.Kind == snapcat.KindGroup && e.Plugin == plugin && e.GroupSnapshotID == id {
			if err := s.cat.Remove(e.Name); err != nil {
				return err
			}
		}
	}
	return nil
}
