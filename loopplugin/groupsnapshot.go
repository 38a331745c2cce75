package loopplugin

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"maps"
	"slices"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Group snapshots (CSI GroupController). CreateVolumeGroupSnapshot freezes
// the filesystems of all staged members together, copies every image
// (reflink or sparse copy), thaws them (at the freeze deadline at the
// latest, whatever the copy does), and only then makes the snapshots
// durable and writes the group snapshot's record, which is the commit
// point: member snapshots without it do not exist. The snapshots are
// therefore write-order consistent across the group: a write that
// completed on one volume before a write to another began is in the
// snapshot of the first if the second's is. Members staged for block
// access cannot be frozen: FailedPrecondition.

type groupSnapshotRecord struct {
	ID              string            `json:"id"`
	SourceVolumeIDs []string          `json:"source_volume_ids"` // sorted
	SnapshotIDs     []string          `json:"snapshot_ids"`      // in the order of SourceVolumeIDs
	Parameters      map[string]string `json:"parameters,omitempty"`
	CreationTime    time.Time         `json:"creation_time"`
}

// memberSnapshotID names the snapshot of a volume in a group snapshot: a
// prefix of the group snapshot's id and a hash of both ids, so it is
// stable (retries produce the same ids), unique and a valid id.
func memberSnapshotID(groupID, volumeID string) string {
	h := sha256.Sum256([]byte(groupID + "\x00" + volumeID))
	n := min(len(groupID), MaxVolumeIDLength-17)
	for n < len(groupID) && n > 0 && !utf8.RuneStart(groupID[n]) {
		n-- // never cut a character in two: ids must stay valid UTF-8
	}
	return groupID[:n] + "-" + hex.EncodeToString(h[:8])
}

type groupControllerServer struct {
	csi.UnimplementedGroupControllerServer
	p *Plugin
}

var _ csi.GroupControllerServer = (*groupControllerServer)(nil)

func (s *groupControllerServer) GroupControllerGetCapabilities(context.Context, *csi.GroupControllerGetCapabilitiesRequest) (*csi.GroupControllerGetCapabilitiesResponse, error) {
	return &csi.GroupControllerGetCapabilitiesResponse{Capabilities: []*csi.GroupControllerServiceCapability{{
		Type: &csi.GroupControllerServiceCapability_Rpc{Rpc: &csi.GroupControllerServiceCapability_RPC{
			Type: csi.GroupControllerServiceCapability_RPC_CREATE_DELETE_GET_VOLUME_GROUP_SNAPSHOT,
		}},
	}}}, nil
}

// groupSnapshot builds the wire form from the record and its members'
// records. A member whose snapshot is missing makes it not ready.
func (s *groupControllerServer) groupSnapshot(g groupSnapshotRecord) (*csi.VolumeGroupSnapshot, error) {
	out := &csi.VolumeGroupSnapshot{GroupSnapshotId: g.ID, CreationTime: timestamppb.New(g.CreationTime), ReadyToUse: true}
	for i, id := range g.SnapshotIDs {
		r, err := s.p.pool.getSnapshot(id)
		if errors.Is(err, ErrNotFound) {
			out.ReadyToUse = false
			out.Snapshots = append(out.Snapshots, &csi.Snapshot{
				SnapshotId: id, SourceVolumeId: g.SourceVolumeIDs[i], GroupSnapshotId: g.ID,
				CreationTime: timestamppb.New(g.CreationTime),
			})
			continue
		}
		if err != nil {
			return nil, err
		}
		out.Snapshots = append(out.Snapshots, csiSnapshot(r))
	}
	return out, nil
}

// CreateVolumeGroupSnapshot snapshots the source volumes together (see
// the top of this file). The name is the group snapshot id; the same name
// with the same volumes and parameters returns the existing group
// snapshot, otherwise AlreadyExists. A call for a name already in flight
// is Aborted. Parameters: freezeTimeout (how long the members may stay
// frozen; DefaultFreezeTimeout).
func (s *groupControllerServer) CreateVolumeGroupSnapshot(ctx context.Context, req *csi.CreateVolumeGroupSnapshotRequest) (*csi.CreateVolumeGroupSnapshotResponse, error) {
	id := req.GetName()
	if err := requireID("name", id); err != nil {
		return nil, err
	}
	if len(req.GetSourceVolumeIds()) == 0 {
		return nil, invalidf("source_volume_ids are required")
	}
	vols := slices.Sorted(slices.Values(req.GetSourceVolumeIds()))
	for i, v := range vols {
		if err := ValidateVolumeID(v); err != nil {
			return nil, err
		}
		if i > 0 && vols[i-1] == v {
			return nil, invalidf("source_volume_ids lists volume %s twice", v)
		}
	}
	if err := checkParams(req.GetParameters(), paramFreezeTimeout); err != nil {
		return nil, err
	}
	freeze, err := parseFreezeTimeout(req.GetParameters())
	if err != nil {
		return nil, err
	}
	unlock, err := s.p.locks.tryLock(groupSnapshotLockKey(id))
	if err != nil {
		return nil, err
	}
	defer unlock()

	var g groupSnapshotRecord
	switch err := s.p.pool.readRecord(metaGroupSnapshots, id, &g); {
	case err == nil:
		if !slices.Equal(g.SourceVolumeIDs, vols) || !maps.Equal(g.Parameters, req.GetParameters()) {
			return nil, incompatiblef("group snapshot %s exists for volumes %s with parameters %v", id, strings.Join(g.SourceVolumeIDs, ","), g.Parameters)
		}
		out, err := s.groupSnapshot(g)
		if err != nil {
			return nil, err
		}
		return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: out}, nil
	case !errors.Is(err, ErrNotFound):
		return nil, err
	}

	unlockVols, err := s.p.locks.lockAll(ctx, vols...)
	if err != nil {
		return nil, err
	}
	defer unlockVols()
	srcs := make([]snapshotSource, 0, len(vols))
	for _, v := range vols {
		vol, err := s.p.pool.Get(v)
		if err != nil {
			return nil, err
		}
		srcs = append(srcs, snapshotSource{vol: vol, snapID: memberSnapshotID(id, v)})
	}
	recs, err := s.p.cutSnapshots(ctx, srcs, id, freeze, false)
	if err != nil {
		return nil, err
	}
	g = groupSnapshotRecord{ID: id, SourceVolumeIDs: vols, Parameters: req.GetParameters(), CreationTime: recs[0].CreationTime}
	for _, r := range recs {
		g.SnapshotIDs = append(g.SnapshotIDs, r.ID)
	}
	if err := s.p.pool.writeRecord(metaGroupSnapshots, id, g); err != nil {
		for _, r := range recs {
			_ = s.p.pool.removeSnapshot(r.ID)
		}
		return nil, err
	}
	s.p.log.Info("group snapshot created", "group_snapshot", id, "volumes", strings.Join(vols, ","))
	out, err := s.groupSnapshot(g)
	if err != nil {
		return nil, err
	}
	return &csi.CreateVolumeGroupSnapshotResponse{GroupSnapshot: out}, nil
}

// checkSnapshotIDs compares the request's snapshot ids with the group
// snapshot's: both required and equal as sets, else InvalidArgument.
func checkSnapshotIDs(g groupSnapshotRecord, ids []string) error {
	if len(ids) == 0 {
		return invalidf("snapshot_ids are required")
	}
	if !slices.Equal(slices.Sorted(slices.Values(ids)), slices.Sorted(slices.Values(g.SnapshotIDs))) {
		return invalidf("snapshot_ids %v do not match group snapshot %s (%v)", ids, g.ID, g.SnapshotIDs)
	}
	return nil
}

// DeleteVolumeGroupSnapshot deletes the group snapshot and its member
// snapshots. An unknown group snapshot is already deleted (member
// snapshots a failed create left are swept). The snapshot ids must match.
func (s *groupControllerServer) DeleteVolumeGroupSnapshot(ctx context.Context, req *csi.DeleteVolumeGroupSnapshotRequest) (*csi.DeleteVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, invalidf("group_snapshot_id is required")
	}
	if validateID("group_snapshot_id", id) != nil {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, nil // cannot exist
	}
	unlock, err := s.p.locks.tryLock(groupSnapshotLockKey(id))
	if err != nil {
		return nil, err
	}
	defer unlock()
	var g groupSnapshotRecord
	err = s.p.pool.readRecord(metaGroupSnapshots, id, &g)
	if errors.Is(err, ErrNotFound) {
		return &csi.DeleteVolumeGroupSnapshotResponse{}, s.sweep(id)
	}
	if err != nil {
		return nil, err
	}
	if err := checkSnapshotIDs(g, req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	for _, sid := range g.SnapshotIDs {
		if err := s.p.pool.removeSnapshot(sid); err != nil {
			return nil, err
		}
	}
	if err := s.p.pool.removeRecord(metaGroupSnapshots, id); err != nil {
		return nil, err
	}
	s.p.log.Info("group snapshot deleted", "group_snapshot", id)
	return &csi.DeleteVolumeGroupSnapshotResponse{}, nil
}

// sweep removes member snapshots of a group snapshot that has no record.
func (s *groupControllerServer) sweep(groupID string) error {
	ids, err := s.p.pool.listRecords(metaSnapshots)
	if err != nil {
		return err
	}
	for _, sid := range ids {
		var r snapshotRecord
		if err := s.p.pool.readRecord(metaSnapshots, sid, &r); err != nil || r.GroupSnapshotID != groupID {
			continue
		}
		if err := s.p.pool.removeSnapshot(sid); err != nil {
			return err
		}
	}
	return nil
}

// GetVolumeGroupSnapshot returns the group snapshot, or NotFound. The
// snapshot ids must match.
func (s *groupControllerServer) GetVolumeGroupSnapshot(ctx context.Context, req *csi.GetVolumeGroupSnapshotRequest) (*csi.GetVolumeGroupSnapshotResponse, error) {
	id := req.GetGroupSnapshotId()
	if id == "" {
		return nil, invalidf("group_snapshot_id is required")
	}
	if validateID("group_snapshot_id", id) != nil {
		return nil, notFoundf("group snapshot %q does not exist", id)
	}
	var g groupSnapshotRecord
	if err := s.p.pool.readRecord(metaGroupSnapshots, id, &g); err != nil {
		return nil, err
	}
	if err := checkSnapshotIDs(g, req.GetSnapshotIds()); err != nil {
		return nil, err
	}
	out, err := s.groupSnapshot(g)
	if err != nil {
		return nil, err
	}
	return &csi.GetVolumeGroupSnapshotResponse{GroupSnapshot: out}, nil
}
