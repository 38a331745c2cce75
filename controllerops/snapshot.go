package controllerops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/snapcat"
)

// CSI's snapshot RPCs (csi.v1.Controller), as the spec's error tables say.

func createSnapshotSpec() rpcSpec {
	return rpcSpec{service: ControllerService, method: "CreateSnapshot", table: map[codes.Code]recovery{
		codes.AlreadyExists:     {false, "the plugin has a snapshot of this name of another volume: use another --name"},
		codes.ResourceExhausted: {false, "not enough space for the snapshot: free space, then run again"},
	}}
}

func deleteSnapshotSpec() rpcSpec {
	return rpcSpec{service: ControllerService, method: "DeleteSnapshot", table: map[codes.Code]recovery{
		codes.FailedPrecondition: {true, "the snapshot is in use (a volume restored from it?): make sure nothing uses it (the agent retries meanwhile)"},
	}}
}

func snapshotProgress(p *agentv1.Progress) *agentv1.SnapshotReply {
	return &agentv1.SnapshotReply{Progress: p}
}

// requireSnapshots asks the plugin's controller for its capabilities:
// snapshots need CREATE_DELETE_SNAPSHOT.
func (o *op) requireSnapshots(ctx context.Context) error {
	resp, err := callPlugin(ctx, o, controllerCapabilitiesSpec(), csi.NewControllerClient, csi.ControllerClient.ControllerGetCapabilities, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		return err
	}
	var have []string
	for _, c := range resp.GetCapabilities() {
		t := c.GetRpc().GetType()
		if t == csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT {
			return nil
		}
		have = append(have, t.String())
	}
	return status.Errorf(codes.FailedPrecondition, "plugin %s does not support snapshots: its controller lacks the CREATE_DELETE_SNAPSHOT capability (it reports [%s])",
		o.plugin, strings.Join(have, ", "))
}

// catalogueName checks a name the catalogue records.
func catalogueName(name string) error {
	if name == "" {
		return invalid("name is required: it names the snapshot in the agent's catalogue and makes the create idempotent")
	}
	if err := snapcat.ValidateName(name); err != nil {
		return invalid("name: %v", err)
	}
	return nil
}

// recordCreate runs create, the plugin's create call(s) for the entry
// want, recorded in the catalogue: a new name is recorded as an intent
// (durably) before create runs, and create records the result; the entry
// of a create that ran before (done, or interrupted by a crash) is given
// to create as it is, if it is of the same source; another one of that
// name is AlreadyExists. An intent this call made whose create ends with
// a code that says nothing was made is removed again.
func (s *Server) recordCreate(want *snapcat.Entry, create func(e *snapcat.Entry) error) error {
	e, err := s.cat.Get(want.Name)
	fresh := errors.Is(err, snapcat.ErrNotFound)
	switch {
	case fresh:
		e, want.Intent = want, true
		if err := s.cat.Put(e); err != nil {
			return err
		}
	case err != nil:
		return err
	case e.Kind != want.Kind || e.Plugin != want.Plugin || !slices.Equal(e.SourceVolumes, want.SourceVolumes):
		return status.Errorf(codes.AlreadyExists, "the catalogue has a %s named %s of plugin %s, volumes %s: use another name, or remove it first",
			e.Kind, e.Name, e.Plugin, strings.Join(e.SourceVolumes, ","))
	}
	err = create(e)
	if err != nil && fresh && e.Intent && nothingMade(status.Code(err)) {
		return errors.Join(err, s.cat.Remove(e.Name))
	}
	return err
}

// nothingMade reports whether a create that failed with code made
// nothing: the plugin (or the agent, before calling it) refused it.
func nothingMade(code codes.Code) bool {
	switch code {
	case codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.FailedPrecondition, codes.ResourceExhausted,
		codes.OutOfRange, codes.Unimplemented, codes.PermissionDenied, codes.Unauthenticated:
		return true
	}
	return false
}

// CreateSnapshot snapshots one volume and records it in the catalogue.
func (s *Server) CreateSnapshot(req *agentv1.CreateSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.SnapshotReply]) error {
	req, err := s.snapshotSource(req)
	if err != nil {
		return err
	}
	return serve(s, "CreateSnapshot", req, stream, snapshotProgress, func(ctx context.Context, o *op) error {
		if err := catalogueName(req.GetName()); err != nil {
			return err
		}
		if err := o.requireSnapshots(ctx); err != nil {
			return err
		}
		return o.withLock(ctx, "snapshot name", req.GetName(), func(ctx context.Context) error {
			want := &snapcat.Entry{Name: req.GetName(), Kind: snapcat.KindSnapshot, Plugin: o.plugin,
				SourceVolumes: []string{req.GetSourceVolumeId()}, NamedVolume: req.GetNamedVolume()}
			return s.recordCreate(want, func(e *snapcat.Entry) error {
				if !e.Intent && e.Ready {
					return stream.Send(&agentv1.SnapshotReply{Snapshot: entryProto(e)})
				}
				spec := createSnapshotSpec()
				preq := &csi.CreateSnapshotRequest{SourceVolumeId: req.GetSourceVolumeId(), Name: e.CSIName(), Secrets: req.GetSecrets(), Parameters: req.GetParameters()}
				_, err := o.untilReady(ctx, spec, req.GetNoWait(), "snapshot "+req.GetName(), func(ctx context.Context) (bool, error) {
					resp, err := callPlugin(ctx, o, spec, csi.NewControllerClient, csi.ControllerClient.CreateSnapshot, preq)
					if err != nil {
						return false, err
					}
					snap := resp.GetSnapshot()
					e.Intent, e.SnapshotID, e.SizeBytes, e.Ready = false, snap.GetSnapshotId(), snap.GetSizeBytes(), snap.GetReadyToUse()
					e.Created = created(snap.GetCreationTime())
					return e.Ready, s.cat.Put(e)
				})
				if err != nil {
					return err
				}
				return stream.Send(&agentv1.SnapshotReply{Snapshot: entryProto(e)})
			})
		})
	})
}

// snapshotSource resolves a request's named volume into its plugin and
// volume id (a copy of req with both set).
func (s *Server) snapshotSource(req *agentv1.CreateSnapshotRequest) (*agentv1.CreateSnapshotRequest, error) {
	switch {
	case (req.GetNamedVolume() == "") == (req.GetSourceVolumeId() == ""):
		return nil, invalid("give exactly one of named_volume and source_volume_id")
	case req.GetNamedVolume() == "":
		return req, nil
	}
	plugin, id, err := s.plugins.NamedVolume(req.GetNamedVolume())
	if err != nil {
		return nil, status.Errorf(codes.NotFound, "named volume %s: %v", req.GetNamedVolume(), err)
	}
	if req.GetPluginName() != "" && req.GetPluginName() != plugin {
		return nil, invalid("named volume %s is of plugin %s, not %s: drop the plugin", req.GetNamedVolume(), plugin, req.GetPluginName())
	}
	req = proto.CloneOf(req)
	req.PluginName, req.SourceVolumeId = plugin, id
	return req, nil
}

// DeleteSnapshot deletes a catalogue snapshot at its plugin, then from the
// catalogue.
func (s *Server) DeleteSnapshot(req *agentv1.DeleteSnapshotRequest, stream grpc.ServerStreamingServer[agentv1.OperationReply]) error {
	if err := catalogueName(req.GetName()); err != nil {
		return err
	}
	e, err := s.cat.Get(req.GetName())
	if err != nil {
		return status.Error(codes.NotFound, err.Error())
	}
	switch {
	case e.Kind != snapcat.KindSnapshot:
		return status.Errorf(codes.FailedPrecondition, "%s is a group snapshot: delete it with 'csi-agent group-snapshot delete --name %s'", e.Name, e.Name)
	case req.GetPluginName() != "" && req.GetPluginName() != e.Plugin:
		return invalid("snapshot %s is of plugin %s, not %s", e.Name, e.Plugin, req.GetPluginName())
	case e.Intent:
		return status.Errorf(codes.FailedPrecondition, "snapshot %s: its create was interrupted before the plugin gave an id: run the same 'csi-agent snapshot create' again, then remove it", e.Name)
	}
	req = proto.CloneOf(req)
	req.PluginName = e.Plugin
	return serve(s, "DeleteSnapshot", req, stream, operationProgress, func(ctx context.Context, o *op) error {
		return o.withLock(ctx, "snapshot name", e.Name, func(ctx context.Context) error {
			preq := &csi.DeleteSnapshotRequest{SnapshotId: e.SnapshotID, Secrets: req.GetSecrets()}
			if _, err := callPlugin(ctx, o, deleteSnapshotSpec(), csi.NewControllerClient, csi.ControllerClient.DeleteSnapshot, preq); err != nil {
				return err
			}
			if err := s.cat.Remove(e.Name); err != nil {
				return err
			}
			return stream.Send(&agentv1.OperationReply{Done: true})
		})
	})
}

// ListSnapshots lists the catalogue.
func (s *Server) ListSnapshots(context.Context, *agentv1.ListSnapshotsRequest) (*agentv1.ListSnapshotsReply, error) {
	out := &agentv1.ListSnapshotsReply{}
	for _, e := range s.cat.List() {
		out.Snapshots = append(out.Snapshots, entryProto(e))
	}
	return out, nil
}

func entryProto(e *snapcat.Entry) *agentv1.SnapshotEntry {
	p := &agentv1.SnapshotEntry{
		Name: e.Name, Kind: string(e.Kind), PluginName: e.Plugin, SourceVolumeIds: e.SourceVolumes, NamedVolume: e.NamedVolume,
		ContainerId: e.Container, SnapshotId: e.SnapshotID, GroupSnapshotId: e.GroupSnapshotID, Members: e.Members,
		SizeBytes: e.SizeBytes, ReadyToUse: e.Ready, Interrupted: e.Intent,
	}
	if !e.Created.IsZero() {
		p.CreationTime = timestamppb.New(e.Created)
	}
	return p
}

// created is a plugin's creation time, or now when it gave none.
func created(t *timestamppb.Timestamp) time.Time {
	if t == nil {
		return time.Now().UTC()
	}
	return t.AsTime()
}

// note sends a NOTE progress message.
func (o *op) note(format string, args ...any) error {
	return o.progress(&agentv1.Progress{Kind: agentv1.Progress_NOTE, Message: fmt.Sprintf(format, args...)})
}
