package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// Volume sizes. Without a requested size a volume gets defaultVolumeSize
// (or the limit, if smaller). Sizes are rounded up to a MiB, or to a
// smaller alignment when the limit leaves no room; loop devices need
// multiples of 512 bytes.
const (
	defaultVolumeSize = 1 << 30
	sectorSize        = 512
)

type controllerServer struct {
	csi.UnimplementedControllerServer
	p *Plugin
}

var _ csi.ControllerServer = (*controllerServer)(nil)

func (s *controllerServer) ControllerGetCapabilities(context.Context, *csi.ControllerGetCapabilitiesRequest) (*csi.ControllerGetCapabilitiesResponse, error) {
	rpc := func(t csi.ControllerServiceCapability_RPC_Type) *csi.ControllerServiceCapability {
		return &csi.ControllerServiceCapability{Type: &csi.ControllerServiceCapability_Rpc{Rpc: &csi.ControllerServiceCapability_RPC{Type: t}}}
	}
	caps := []*csi.ControllerServiceCapability{
		rpc(csi.ControllerServiceCapability_RPC_CREATE_DELETE_VOLUME),
		rpc(csi.ControllerServiceCapability_RPC_LIST_VOLUMES),
		rpc(csi.ControllerServiceCapability_RPC_GET_CAPACITY),
		rpc(csi.ControllerServiceCapability_RPC_CREATE_DELETE_SNAPSHOT),
		rpc(csi.ControllerServiceCapability_RPC_LIST_SNAPSHOTS),
		rpc(csi.ControllerServiceCapability_RPC_GET_SNAPSHOT),
		rpc(csi.ControllerServiceCapability_RPC_CLONE_VOLUME),
		rpc(csi.ControllerServiceCapability_RPC_EXPAND_VOLUME),
	}
	if !s.p.nodeOnly {
		caps = append(caps, rpc(csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME), rpc(csi.ControllerServiceCapability_RPC_PUBLISH_READONLY))
	}
	return &csi.ControllerGetCapabilitiesResponse{Capabilities: caps}, nil
}

// volumeSize picks the size of a new volume for a capacity range.
func volumeSize(r *csi.CapacityRange) (int64, error) {
	req, lim := r.GetRequiredBytes(), r.GetLimitBytes()
	if req < 0 || lim < 0 {
		return 0, invalidf("capacity_range must not be negative")
	}
	if lim > 0 && req > lim {
		return 0, invalidf("required_bytes %d exceeds limit_bytes %d", req, lim)
	}
	size := req
	if size == 0 {
		size = defaultVolumeSize
		if lim > 0 && lim < size {
			size = lim
		}
	}
	for _, align := range []int64{1 << 20, 4096, sectorSize} {
		rounded := (size + align - 1) / align * align
		if lim == 0 || rounded <= lim {
			return rounded, nil
		}
	}
	return 0, outOfRangef("no multiple of %d bytes lies within [%d, %d]", sectorSize, req, lim)
}

// fits reports whether an existing volume of size satisfies r.
func fits(size int64, r *csi.CapacityRange) bool {
	return size >= r.GetRequiredBytes() && (r.GetLimitBytes() == 0 || size <= r.GetLimitBytes())
}

// TopologyKey is the topology segment of the plugin's nodes and volumes:
// the node (host) whose pool holds them. A volume is accessible from its
// pool's node only.
const TopologyKey = "topology.loop.csi.csiagent.io/host"

// topology is this node's topology, that of every volume of its pool.
func (p *Plugin) topology() *csi.Topology {
	return &csi.Topology{Segments: map[string]string{TopologyKey: p.nodeID}}
}

// reachable refuses a CreateVolume whose requisite topologies all exclude
// this node (ErrTopology); preferred ones only order, and this node is the
// only one.
func (p *Plugin) reachable(req *csi.TopologyRequirement) error {
	requisite := req.GetRequisite()
	if len(requisite) == 0 {
		return nil
	}
	for _, t := range requisite {
		if seg := t.GetSegments(); len(seg) == 1 && seg[TopologyKey] == p.nodeID {
			return nil
		}
	}
	return fmt.Errorf("%w: no requisite topology is this node's (%s=%s): the plugin's volumes live in this node's pool", ErrTopology, TopologyKey, p.nodeID)
}

func (p *Plugin) csiVolume(v Volume, src *contentSource) *csi.Volume {
	return &csi.Volume{VolumeId: v.ID, CapacityBytes: v.Size, ContentSource: csiContentSource(src), AccessibleTopology: []*csi.Topology{p.topology()}}
}

// CreateVolume makes a sparse image named after the request's name (the
// name is the volume id): blank, or a copy of a snapshot or of another
// volume (a clone; the source is frozen while copied if it is staged).
// Without a capacity range a copy gets its source's size. Creating an
// existing volume again succeeds if its size fits the request and its
// content source is the requested one, else fails with AlreadyExists.
// Volumes are thin: the pool's free space is not reserved.
func (s *controllerServer) CreateVolume(ctx context.Context, req *csi.CreateVolumeRequest) (*csi.CreateVolumeResponse, error) {
	id := req.GetName()
	if id == "" {
		return nil, invalidf("name is required")
	}
	if err := ValidateVolumeID(id); err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, invalidf("volume_capabilities are required")
	}
	for _, c := range req.GetVolumeCapabilities() {
		if _, err := s.p.parseCapability(c); err != nil {
			return nil, err
		}
	}
	if err := s.p.reachable(req.GetAccessibilityRequirements()); err != nil {
		return nil, err
	}
	src, err := parseContentSource(req.GetVolumeContentSource())
	if err != nil {
		return nil, err
	}
	size, err := volumeSize(req.GetCapacityRange())
	if err != nil {
		return nil, err
	}
	lockIDs := []string{id}
	if src != nil && src.VolumeID != "" {
		lockIDs = append(lockIDs, src.VolumeID)
	}
	unlock, err := s.p.locks.lockAll(ctx, lockIDs...)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if v, err := s.p.pool.Get(id); err == nil {
		have, err := s.p.pool.contentSourceOf(id)
		if err != nil {
			return nil, err
		}
		if !fits(v.Size, req.GetCapacityRange()) {
			return nil, incompatiblef("volume %s exists with %d bytes, outside the requested range [%d, %d]",
				id, v.Size, req.GetCapacityRange().GetRequiredBytes(), req.GetCapacityRange().GetLimitBytes())
		}
		if !sameSource(have, src) {
			return nil, incompatiblef("volume %s exists with another content source", id)
		}
		return &csi.CreateVolumeResponse{Volume: s.p.csiVolume(v, have)}, nil
	} else if !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	var v Volume
	if src == nil {
		v, _, err = s.p.pool.Create(id, size)
	} else {
		v, err = s.p.createFrom(ctx, id, req.GetCapacityRange(), src)
	}
	if err != nil {
		return nil, err
	}
	return &csi.CreateVolumeResponse{Volume: s.p.csiVolume(v, src)}, nil
}

func sameSource(a, b *contentSource) bool {
	if a == nil || b == nil {
		return a == b
	}
	return *a == *b
}

// DeleteVolume removes the image. Unknown volumes are already deleted;
// staged ones (attached to a loop device) are in use, members of a volume
// group must leave it first and replicated ones need replication disabled:
// FailedPrecondition. Snapshots of the volume are independent and stay.
func (s *controllerServer) DeleteVolume(ctx context.Context, req *csi.DeleteVolumeRequest) (*csi.DeleteVolumeResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	unlock, err := s.p.locks.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	// Membership is checked and the image removed under the groups lock,
	// so a concurrent ModifyVolumeGroupMembership cannot add it meanwhile.
	unlockGroups, err := s.p.locks.lock(ctx, groupsLockKey)
	if err != nil {
		return nil, err
	}
	defer unlockGroups()
	if err := s.p.pool.Delete(id); err != nil {
		return nil, err
	}
	return &csi.DeleteVolumeResponse{}, nil
}

// ValidateVolumeCapabilities confirms the capabilities if this plugin can
// serve all of them, and otherwise says why in the message.
func (s *controllerServer) ValidateVolumeCapabilities(ctx context.Context, req *csi.ValidateVolumeCapabilitiesRequest) (*csi.ValidateVolumeCapabilitiesResponse, error) {
	id := req.GetVolumeId()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if len(req.GetVolumeCapabilities()) == 0 {
		return nil, invalidf("volume_capabilities are required")
	}
	if _, err := s.p.pool.Get(id); err != nil {
		return nil, err
	}
	for _, c := range req.GetVolumeCapabilities() {
		if _, err := s.p.parseCapability(c); err != nil {
			return &csi.ValidateVolumeCapabilitiesResponse{Message: err.Error()}, nil
		}
	}
	if len(req.GetParameters()) > 0 {
		return &csi.ValidateVolumeCapabilitiesResponse{Message: "this plugin takes no parameters"}, nil
	}
	return &csi.ValidateVolumeCapabilitiesResponse{Confirmed: &csi.ValidateVolumeCapabilitiesResponse_Confirmed{
		VolumeContext:      req.GetVolumeContext(),
		VolumeCapabilities: req.GetVolumeCapabilities(),
		Parameters:         req.GetParameters(),
	}}, nil
}

// ListVolumes pages through the pool ordered by id. The token is the index
// of the next entry; a token that is not one is Aborted, as CSI requires.
func (s *controllerServer) ListVolumes(ctx context.Context, req *csi.ListVolumesRequest) (*csi.ListVolumesResponse, error) {
	if req.GetMaxEntries() < 0 {
		return nil, invalidf("max_entries must not be negative")
	}
	vols, err := s.p.pool.List()
	if err != nil {
		return nil, err
	}
	start := 0
	if tok := req.GetStartingToken(); tok != "" {
		start, err = strconv.Atoi(tok)
		if err != nil || start < 0 || start > len(vols) {
			return nil, invalidTokenf("starting_token %q", tok)
		}
	}
	end := len(vols)
	if n := int(req.GetMaxEntries()); n > 0 && start+n < end {
		end = start + n
	}
	resp := &csi.ListVolumesResponse{}
	for _, v := range vols[start:end] {
		resp.Entries = append(resp.Entries, &csi.ListVolumesResponse_Entry{Volume: s.p.csiVolume(v, nil)})
	}
	if end < len(vols) {
		resp.NextToken = strconv.Itoa(end)
	}
	return resp, nil
}

// GetCapacity reports the free space of the pool's filesystem, or 0 for
// capabilities this plugin cannot serve.
func (s *controllerServer) GetCapacity(ctx context.Context, req *csi.GetCapacityRequest) (*csi.GetCapacityResponse, error) {
	for _, c := range req.GetVolumeCapabilities() {
		if _, err := s.p.parseCapability(c); err != nil {
			return &csi.GetCapacityResponse{AvailableCapacity: 0}, nil
		}
	}
	avail, err := s.p.pool.Available()
	if err != nil {
		return nil, err
	}
	return &csi.GetCapacityResponse{AvailableCapacity: avail}, nil
}
