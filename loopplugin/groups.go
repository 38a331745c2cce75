package loopplugin

import (
	"context"
	"encoding/base64"
	"errors"
	"maps"
	"slices"
	"sort"
	"strings"
	"time"

	vg "github.com/csiagent/csiagent/proto/volumegroup"
)

// Volume groups (csi-addons VolumeGroup controller service). A group is a
// record in the pool: its id (the CreateVolumeGroup name), its parameters
// (opaque; returned as the group's volume_group_context) and its member
// volume ids. A volume belongs to at most one group. Members cannot be
// deleted one by one (DeleteVolume is FailedPrecondition); deleting the
// group deletes them. Group snapshots take any list of volumes; a group's
// members are one such list.

// MaxGroupVolumes is the most volumes a group holds; more is
// ResourceExhausted.
const MaxGroupVolumes = 256

// deleteGroupAttempts bounds how often DeleteVolumeGroup re-reads a group
// whose membership changed while it waited for its members' locks.
const deleteGroupAttempts = 3

type groupRecord struct {
	ID           string            `json:"id"`
	Parameters   map[string]string `json:"parameters,omitempty"`
	VolumeIDs    []string          `json:"volume_ids"` // sorted
	CreationTime time.Time         `json:"creation_time"`
}

// group reads the group's record; an unknown group is an error wrapping
// ErrNotFound.
func (p *Pool) group(id string) (groupRecord, error) {
	var g groupRecord
	err := p.readRecord(metaGroups, id, &g)
	return g, err
}

// groupOf returns the id of the group the volume belongs to, "" if none.
func (p *Pool) groupOf(volumeID string) (string, error) {
	ids, err := p.listRecords(metaGroups)
	if err != nil {
		return "", err
	}
	for _, gid := range ids {
		g, err := p.group(gid)
		if errors.Is(err, ErrNotFound) {
			continue
		} else if err != nil {
			return "", err
		}
		if _, ok := slices.BinarySearch(g.VolumeIDs, volumeID); ok {
			return gid, nil
		}
	}
	return "", nil
}

type volumeGroupServer struct {
	vg.UnimplementedControllerServer
	p *Plugin
}

var _ vg.ControllerServer = (*volumeGroupServer)(nil)

// lockGroups takes the lock that serializes changes to group records.
func (s *volumeGroupServer) lockGroups(ctx context.Context) (func(), error) {
	return s.p.locks.lock(ctx, groupsLockKey)
}

// lockedGroup takes the groups lock and reads the group's record (an
// error wrapping ErrNotFound for an unknown group). The caller releases
// the lock with unlock.
func (s *volumeGroupServer) lockedGroup(ctx context.Context, id string) (g groupRecord, unlock func(), err error) {
	if unlock, err = s.lockGroups(ctx); err != nil {
		return groupRecord{}, nil, err
	}
	if g, err = s.p.pool.group(id); err != nil {
		unlock()
		return groupRecord{}, nil, err
	}
	return g, unlock, nil
}

// volumeGroup builds the wire form of a group; members report their
// current capacity and content source.
func (s *volumeGroupServer) volumeGroup(g groupRecord) (*vg.VolumeGroup, error) {
	out := &vg.VolumeGroup{VolumeGroupId: g.ID, VolumeGroupContext: g.Parameters}
	for _, id := range g.VolumeIDs {
		v := &vg.VgVolume{VolumeId: id}
		if vol, err := s.p.pool.Get(id); err == nil {
			v.CapacityBytes = vol.Size
		} else if !errors.Is(err, ErrNotFound) {
			return nil, err
		}
		src, err := s.p.pool.contentSourceOf(id)
		if err != nil {
			return nil, err
		}
		switch {
		case src == nil:
		case src.SnapshotID != "":
			v.ContentSource = &vg.VgVolumeContentSource{Type: &vg.VgVolumeContentSource_Snapshot{
				Snapshot: &vg.VgVolumeContentSource_SnapshotSource{SnapshotId: src.SnapshotID}}}
		case src.VolumeID != "":
			v.ContentSource = &vg.VgVolumeContentSource{Type: &vg.VgVolumeContentSource_Volume{
				Volume: &vg.VgVolumeContentSource_VolumeSource{VolumeId: src.VolumeID}}}
		}
		out.Volumes = append(out.Volumes, v)
	}
	return out, nil
}

// CreateVolumeGroup creates an empty group named (and identified) by the
// request's name. The same name with the same parameters again returns
// the group as it is now; other parameters are AlreadyExists.
func (s *volumeGroupServer) CreateVolumeGroup(ctx context.Context, req *vg.CreateVolumeGroupRequest) (*vg.CreateVolumeGroupResponse, error) {
	id := req.GetName()
	if err := requireID("name", id); err != nil {
		return nil, err
	}
	unlock, err := s.lockGroups(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	g, err := s.p.pool.group(id)
	switch {
	case err == nil:
		if !maps.Equal(g.Parameters, req.GetParameters()) {
			return nil, incompatiblef("volume group %s exists with other parameters", id)
		}
	case errors.Is(err, ErrNotFound):
		g = groupRecord{ID: id, Parameters: req.GetParameters(), VolumeIDs: []string{}, CreationTime: time.Now().UTC()}
		if err := s.p.pool.writeRecord(metaGroups, id, g); err != nil {
			return nil, err
		}
		s.p.log.Info("created volume group", "group", id)
	default:
		return nil, err
	}
	out, err := s.volumeGroup(g)
	if err != nil {
		return nil, err
	}
	return &vg.CreateVolumeGroupResponse{VolumeGroup: out}, nil
}

// ModifyVolumeGroupMembership makes the group's members exactly the given
// volumes. Unknown groups and volumes are NotFound; a volume in another
// group is InvalidArgument (incompatible); more than MaxGroupVolumes is
// ResourceExhausted.
func (s *volumeGroupServer) ModifyVolumeGroupMembership(ctx context.Context, req *vg.ModifyVolumeGroupMembershipRequest) (*vg.ModifyVolumeGroupMembershipResponse, error) {
	id := req.GetVolumeGroupId()
	if err := requireID("volume_group_id", id); err != nil {
		return nil, err
	}
	want := slices.Compact(slices.Sorted(slices.Values(req.GetVolumeIds())))
	for _, v := range want {
		if err := ValidateVolumeID(v); err != nil {
			return nil, err
		}
	}
	g, unlock, err := s.lockedGroup(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if len(want) > MaxGroupVolumes {
		return nil, limitf("a volume group holds at most %d volumes, %d requested", MaxGroupVolumes, len(want))
	}
	for _, v := range want {
		if _, err := s.p.pool.Get(v); err != nil {
			return nil, err
		}
		other, err := s.p.pool.groupOf(v)
		if err != nil {
			return nil, err
		}
		if other != "" && other != id {
			return nil, invalidf("volume %s is a member of volume group %s; a volume belongs to at most one group", v, other)
		}
	}
	if !slices.Equal(g.VolumeIDs, want) {
		g.VolumeIDs = want
		if err := s.p.pool.writeRecord(metaGroups, id, g); err != nil {
			return nil, err
		}
		s.p.log.Info("modified volume group", "group", id, "volumes", strings.Join(want, ","))
	}
	out, err := s.volumeGroup(g)
	if err != nil {
		return nil, err
	}
	return &vg.ModifyVolumeGroupMembershipResponse{VolumeGroup: out}, nil
}

// DeleteVolumeGroup deletes the group and its member volumes. An unknown
// group is already deleted. A member that is staged (in use) or replicated
// makes the group in use: FailedPrecondition, and nothing is deleted.
func (s *volumeGroupServer) DeleteVolumeGroup(ctx context.Context, req *vg.DeleteVolumeGroupRequest) (*vg.DeleteVolumeGroupResponse, error) {
	id := req.GetVolumeGroupId()
	if err := requireID("volume_group_id", id); err != nil {
		return nil, err
	}
	for range deleteGroupAttempts {
		// Members' locks come before the groups lock: read the members,
		// lock them, then check the membership did not change meanwhile.
		members, err := s.members(ctx, id)
		if errors.Is(err, ErrNotFound) {
			return &vg.DeleteVolumeGroupResponse{}, nil
		}
		if err != nil {
			return nil, err
		}
		unlockVols, err := s.p.locks.lockAll(ctx, members...)
		if err != nil {
			return nil, err
		}
		done, err := s.deleteLocked(ctx, id, members)
		unlockVols()
		if err != nil {
			return nil, err
		}
		if done {
			return &vg.DeleteVolumeGroupResponse{}, nil
		}
	}
	return nil, busyf("the membership of volume group %s keeps changing", id)
}

func (s *volumeGroupServer) members(ctx context.Context, id string) ([]string, error) {
	g, unlock, err := s.lockedGroup(ctx, id)
	if err != nil {
		return nil, err
	}
	unlock()
	return g.VolumeIDs, nil
}

// deleteLocked deletes the group, whose members' locks the caller holds,
// if its members are still members; done = false if they changed.
func (s *volumeGroupServer) deleteLocked(ctx context.Context, id string, members []string) (done bool, err error) {
	g, unlock, err := s.lockedGroup(ctx, id)
	if errors.Is(err, ErrNotFound) {
		return true, nil
	} else if err != nil {
		return false, err
	}
	defer unlock()
	if !slices.Equal(g.VolumeIDs, members) {
		return false, nil
	}
	for _, v := range members {
		vol, err := s.p.pool.Get(v)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return false, err
		}
		if ds, err := devicesOf(vol); err != nil {
			return false, err
		} else if len(ds) > 0 {
			return false, preconditionf("volume group %s is in use: volume %s is staged (attached to %s)", id, v, ds[0].Path)
		}
		var rep replicationRecord
		if err := s.p.pool.readRecord(metaReplication, v, &rep); err == nil {
			return false, preconditionf("volume group %s is in use: volume %s is replicated; disable replication first", id, v)
		} else if !errors.Is(err, ErrNotFound) {
			return false, err
		}
	}
	// Members go first: a crash midway leaves the group with some
	// members gone, and deleting it again finishes the job.
	for _, v := range members {
		if err := s.p.pool.remove(v); err != nil {
			return false, err
		}
	}
	if err := s.p.pool.removeRecord(metaGroups, id); err != nil {
		return false, err
	}
	s.p.log.Info("deleted volume group", "group", id, "volumes", strings.Join(members, ","))
	return true, nil
}

// ListVolumeGroups pages through the groups ordered by id. The token names
// the last group of the previous page, so groups deleted meanwhile do not
// shift the pages; a token this plugin did not hand out is Aborted.
func (s *volumeGroupServer) ListVolumeGroups(ctx context.Context, req *vg.ListVolumeGroupsRequest) (*vg.ListVolumeGroupsResponse, error) {
	if req.GetMaxEntries() < 0 {
		return nil, invalidf("max_entries must not be negative")
	}
	ids, err := s.p.pool.listRecords(metaGroups)
	if err != nil {
		return nil, err
	}
	page, next, err := paginate(ids, "vg", req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &vg.ListVolumeGroupsResponse{NextToken: next}
	for _, id := range page {
		g, err := s.p.pool.group(id)
		if errors.Is(err, ErrNotFound) {
			continue // deleted meanwhile
		} else if err != nil {
			return nil, err
		}
		out, err := s.volumeGroup(g)
		if err != nil {
			return nil, err
		}
		resp.Entries = append(resp.Entries, &vg.ListVolumeGroupsResponse_Entry{VolumeGroup: out})
	}
	return resp, nil
}

// ControllerGetVolumeGroup returns the group, or NotFound.
func (s *volumeGroupServer) ControllerGetVolumeGroup(ctx context.Context, req *vg.ControllerGetVolumeGroupRequest) (*vg.ControllerGetVolumeGroupResponse, error) {
	id := req.GetVolumeGroupId()
	if err := requireID("volume_group_id", id); err != nil {
		return nil, err
	}
	g, err := s.p.pool.group(id)
	if err != nil {
		return nil, err
	}
	out, err := s.volumeGroup(g)
	if err != nil {
		return nil, err
	}
	return &vg.ControllerGetVolumeGroupResponse{VolumeGroup: out}, nil
}

// paginate returns the page of the sorted ids that follows the token's
// position, at most max entries (0: all), and the token of the next page
// ("" after the last). Tokens are opaque: base64 of the kind and the last
// id of the page. A token that does not decode to one of this kind is
// ErrInvalidToken (Aborted).
func paginate(ids []string, kind, token string, max int32) (page []string, next string, err error) {
	start := 0
	if token != "" {
		b, err := base64.RawURLEncoding.DecodeString(token)
		k, after, ok := strings.Cut(string(b), "\x00")
		if err != nil || !ok || k != kind || validateID("token", after) != nil {
			return nil, "", invalidTokenf("starting_token %q was not handed out by this plugin", token)
		}
		start = sort.SearchStrings(ids, after)
		if start < len(ids) && ids[start] == after {
			start++
		}
	}
	end := len(ids)
	if max > 0 && start+int(max) < end {
		end = start + int(max)
	}
	page = ids[start:end]
	if end < len(ids) && len(page) > 0 {
		next = base64.RawURLEncoding.EncodeToString([]byte(kind + "\x00" + page[len(page)-1]))
	}
	return page, next, nil
}
