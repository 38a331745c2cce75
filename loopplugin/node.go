package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"os"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/loopplugin/loopdev"
	"github.com/csiagent/csiagent/mount"
)

// BlockStagingFile is the file inside the staging directory onto which
// NodeStageVolume bind-mounts the loop device node for block access.
const BlockStagingFile = "device"

type nodeServer struct {
	csi.UnimplementedNodeServer
	p *Plugin
}

var _ csi.NodeServer = (*nodeServer)(nil)

func (s *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: s.p.nodeID}, nil
}

func (s *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	var caps []*csi.NodeServiceCapability
	for _, c := range []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
	} {
		caps = append(caps, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: c}},
		})
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: caps}, nil
}

// NodeStageVolume attaches the image to a loop device and, for mount
// access, mounts its filesystem (made first if the volume is blank) at the
// staging path; for block access it bind-mounts the device node onto
// <staging>/device. Staging again with a compatible capability succeeds;
// an incompatible one is AlreadyExists. A replication secondary cannot be
// staged (FailedPrecondition): it is written only by syncs.
func (s *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requireAbsPath("staging_target_path", staging); err != nil {
		return nil, err
	}
	acc, err := s.p.parseCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	unlock, err := s.p.locks.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	vol, err := s.p.pool.Get(id)
	if err != nil {
		return nil, err
	}
	if r, err := s.p.pool.replication(id); err != nil {
		return nil, err
	} else if r != nil && r.Role == roleSecondary {
		return nil, preconditionf("volume %s is a replication secondary (its primary is in %s): promote it before staging", id, r.Peer)
	}
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return nil, fmt.Errorf("create staging path: %w", err)
	}
	if acc.block {
		err = s.p.stageBlock(ctx, vol, staging, acc)
	} else {
		err = s.p.stageMount(ctx, vol, staging, acc)
	}
	if err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// NodeUnstageVolume undoes NodeStageVolume: it unmounts the staging path (or
// the device bind inside it) and detaches the loop device. A volume that is
// not staged is already unstaged. A volume still published somewhere is
// FailedPrecondition: unpublish first.
func (s *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requireAbsPath("staging_target_path", staging); err != nil {
		return nil, err
	}
	unlock, err := s.p.locks.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	vol, err := s.p.pool.Get(id)
	if err != nil {
		return nil, err
	}
	if err := s.p.unstage(ctx, vol, staging); err != nil {
		return nil, err
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

// NodePublishVolume bind-mounts the staged volume onto the target path,
// read-only if asked (readonly or a reader-only access mode): the staging
// directory for mount access, the device node onto a file for block access.
// The target and its parent are created. Publishing before staging is
// FailedPrecondition; publishing again compatibly succeeds, incompatibly
// (other read-only setting, other volume at the target) is AlreadyExists.
func (s *nodeServer) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, target, staging := req.GetVolumeId(), req.GetTargetPath(), req.GetStagingTargetPath()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requireAbsPath("target_path", target); err != nil {
		return nil, err
	}
	if err := requireAbsPath("staging_target_path", staging); err != nil {
		return nil, err
	}
	acc, err := s.p.parseCapability(req.GetVolumeCapability())
	if err != nil {
		return nil, err
	}
	unlock, err := s.p.locks.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	vol, err := s.p.pool.Get(id)
	if err != nil {
		return nil, err
	}
	if err := s.p.publish(ctx, vol, staging, target, acc, req.GetReadonly() || acc.readOnlyMode()); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

// NodeUnpublishVolume unmounts the target and removes it. A target that is
// not mounted (or gone) is already unpublished. A target that holds another
// volume is left alone: FailedPrecondition.
func (s *nodeServer) NodeUnpublishVolume(ctx context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	id, target := req.GetVolumeId(), req.GetTargetPath()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if err := requireAbsPath("target_path", target); err != nil {
		return nil, err
	}
	unlock, err := s.p.locks.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	vol, err := s.p.pool.Get(id)
	if err != nil {
		return nil, err
	}
	m, mounted, err := mount.Lookup(target)
	if err != nil {
		return nil, err
	}
	block := false
	if mounted {
		ds, err := devicesOf(vol)
		if err != nil {
			return nil, err
		}
		dev, ok := ds.at(m, target)
		if !ok {
			return nil, preconditionf("target path %s holds another mount (%s from %s), not volume %s", target, m.FSType, m.Source, id)
		}
		block = !sameDev(m, dev)
		if err := mount.Unmount(ctx, target); err != nil {
			return nil, fmt.Errorf("unpublish volume %s: %w", id, err)
		}
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("unpublish volume %s: remove target: %w", id, err)
	}
	if block {
		// A read-only block target had its own read-only loop device.
		if err := s.p.detachIdle(vol); err != nil {
			return nil, err
		}
	}
	if mounted {
		s.p.log.Info("unpublished", "volume", id, "target", target)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// NodeGetVolumeStats reports usage of the volume at volume_path (its target
// or staging path): bytes and inodes for a filesystem, the size for a block
// device. A path where the volume is not is NotFound.
func (s *nodeServer) NodeGetVolumeStats(ctx context.Context, req *csi.NodeGetVolumeStatsRequest) (*csi.NodeGetVolumeStatsResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	if err := requireVolumeID(id); err != nil {
		return nil, err
	}
	if path == "" {
		return nil, invalidf("volume_path is required")
	}
	unlock, err := s.p.locks.lock(ctx, id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	vol, err := s.p.pool.Get(id)
	if err != nil {
		return nil, err
	}
	ds, err := devicesOf(vol)
	if err != nil {
		return nil, err
	}
	m, mounted, err := mount.Lookup(path)
	if err != nil {
		return nil, err
	}
	var dev loopdev.Device
	ok := false
	if mounted {
		dev, ok = ds.at(m, path)
	}
	if !ok {
		return nil, notFoundf("volume %s is not at %s", id, path)
	}
	if !sameDev(m, dev) { // block
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{
			Unit: csi.VolumeUsage_BYTES, Total: vol.Size,
		}}}, nil
	}
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return nil, fmt.Errorf("statfs %s: %w", path, err)
	}
	bs := st.Bsize
	return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{
		{
			Unit:      csi.VolumeUsage_BYTES,
			Total:     int64(st.Blocks) * bs,
			Available: int64(st.Bavail) * bs,
			Used:      int64(st.Blocks-st.Bfree) * bs,
		},
		{
			Unit:      csi.VolumeUsage_INODES,
			Total:     int64(st.Files),
			Available: int64(st.Ffree),
			Used:      int64(st.Files - st.Ffree),
		},
	}}, nil
}
