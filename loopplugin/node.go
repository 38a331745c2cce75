package loopplugin

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

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

// NodeGetInfo reports the node id, its topology (the host whose pool
// holds the volumes) and the configured volume limit.
func (s *nodeServer) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: s.p.nodeID, AccessibleTopology: s.p.topology(), MaxVolumesPerNode: s.p.maxVolumes}, nil
}

func (s *nodeServer) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	rpc := func(t csi.NodeServiceCapability_RPC_Type) *csi.NodeServiceCapability {
		return &csi.NodeServiceCapability{Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: t}}}
	}
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{
		rpc(csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME),
		rpc(csi.NodeServiceCapability_RPC_GET_VOLUME_STATS),
		rpc(csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH),
		rpc(csi.NodeServiceCapability_RPC_EXPAND_VOLUME),
		rpc(csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER),
	}}, nil
}

// NodeStageVolume, in attach mode, takes the loop device the
// publish_context names (see attach.go), in node-only mode attaches the
// image to one, and, for mount access, mounts its filesystem (made first if the volume is blank) at the
// staging path; for block access it bind-mounts the device node onto
// <staging>/device. Staging again with a compatible capability succeeds;
// an incompatible one is AlreadyExists. A replication secondary cannot be
// staged (FailedPrecondition): it is written only by syncs.
func (s *nodeServer) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	acc, capErr := s.p.parseCapability(req.GetVolumeCapability())
	vol, unlock, err := s.p.lockedVolume(ctx, id, false, requireAbsPath("staging_target_path", staging), capErr)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if r, err := s.p.pool.replication(id); err != nil {
		return nil, err
	} else if r != nil && r.Role == roleSecondary {
		return nil, preconditionf("volume %s is a replication secondary (its primary is in %s): promote it before staging", id, r.Peer)
	}
	dev, err := s.p.stageDevice(vol, req.GetPublishContext())
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return nil, fmt.Errorf("create staging path: %w", err)
	}
	if acc.block {
		err = s.p.stageBlock(ctx, vol, staging, acc, dev)
	} else {
		err = s.p.stageMount(ctx, vol, staging, acc, dev)
	}
	if err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

// NodeUnstageVolume undoes NodeStageVolume: it unmounts the staging path (or
// the device bind inside it) and detaches the loop device, unless the
// controller attached it (ControllerUnpublishVolume detaches that one). A volume that is
// not staged is already unstaged. A volume still published somewhere is
// FailedPrecondition: unpublish first.
func (s *nodeServer) NodeUnstageVolume(ctx context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	vol, unlock, err := s.p.lockedVolume(ctx, id, false, requireAbsPath("staging_target_path", staging))
	if err != nil {
		return nil, err
	}
	defer unlock()
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
	acc, capErr := s.p.parseCapability(req.GetVolumeCapability())
	vol, unlock, err := s.p.lockedVolume(ctx, id, false,
		requireAbsPath("target_path", target), requireAbsPath("staging_target_path", staging), capErr)
	if err != nil {
		return nil, err
	}
	defer unlock()
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
	vol, unlock, err := s.p.lockedVolume(ctx, id, false, requireAbsPath("target_path", target))
	if err != nil {
		return nil, err
	}
	defer unlock()
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
		switch {
		case ok:
			block = !sameDev(m, dev)
		case detachedNodeAt(target):
			s.p.log.Warn("the published device was detached by someone else", "volume", id, "target", target)
			block = true
		default:
			return nil, preconditionf("target path %s holds another mount (%s from %s), not volume %s", target, m.FSType, m.Source, id)
		}
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
	at, unlock, err := s.volumeAt(ctx, req.GetVolumeId(), req.GetVolumePath(), "volume_path")
	if err != nil {
		return nil, err
	}
	defer unlock()
	path := req.GetVolumePath()
	if !at.fs {
		size, err := blockSize(path)
		if err != nil {
			return nil, err
		}
		return &csi.NodeGetVolumeStatsResponse{Usage: []*csi.VolumeUsage{{Unit: csi.VolumeUsage_BYTES, Total: size}}}, nil
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

// NodeGetVolumeHealth reports the volume's adverse conditions at its
// publish (or staging) path: INACCESSIBLE when its backing image is gone
// (the loop device still serves the deleted file, whose data goes with
// the device), DEGRADED when ext4 counted errors on it. None: healthy.
func (s *nodeServer) NodeGetVolumeHealth(ctx context.Context, req *csi.NodeGetVolumeHealthRequest) (*csi.NodeGetVolumeHealthResponse, error) {
	path := cmp.Or(req.GetVolumePublishPath(), req.GetStagingTargetPath())
	if path == "" {
		return s.healthByID(ctx, req.GetVolumeId())
	}
	at, unlock, err := s.volumeAt(ctx, req.GetVolumeId(), path, "volume_publish_path")
	if err != nil {
		return nil, err
	}
	defer unlock()
	return healthOf(req.GetVolumeId(), at), nil
}

// healthByID is the health of a volume named without a path: its image
// must exist; the filesystem of the device it is attached to, if any, is
// checked.
func (s *nodeServer) healthByID(ctx context.Context, id string) (*csi.NodeGetVolumeHealthResponse, error) {
	vol, ds, unlock, err := s.p.lockedAttached(ctx, id, false)
	if err != nil {
		return nil, err
	}
	defer unlock()
	at := volumeLocation{image: vol.Path}
	if len(ds) > 0 {
		at.rdev = ds[0].Rdev()
	}
	return healthOf(id, at), nil
}

// healthOf is the health of the volume found at at.
func healthOf(id string, at volumeLocation) *csi.NodeGetVolumeHealthResponse {
	h := &csi.VolumeHealth{VolumeId: id}
	if at.deleted {
		h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_INACCESSIBLE, Reason: "BackingImageRemoved",
			Message: fmt.Sprintf("the backing image %s was removed; the loop device still serves the deleted file until it is detached", at.image),
		})
	}
	if n := ext4Errors(at.rdev); at.rdev != 0 && n > 0 {
		h.HealthStatuses = append(h.HealthStatuses, &csi.VolumeHealth_VolumeHealthEntry{
			Status: csi.VolumeHealthErrorType_DEGRADED, Reason: "FilesystemErrors",
			Message: fmt.Sprintf("ext4 counted %d error(s) on the filesystem (errors_count): check it with e2fsck", n),
		})
	}
	return &csi.NodeGetVolumeHealthResponse{VolumeHealth: h}
}

// volumeLocation is where a staged volume is found at a path.
type volumeLocation struct {
	rdev    uint64 // its loop device
	fs      bool   // a filesystem on it is mounted at the path (else the node is bound)
	image   string // its backing image
	deleted bool   // the image was unlinked
}

// volumeAt takes the volume's lock and finds it at path (field names the
// request field): NotFound unless path is a mount of the volume's loop
// device or of a filesystem on it. It identifies the device by its
// backing file, so a volume whose image was removed is still found.
func (s *nodeServer) volumeAt(ctx context.Context, id, path, field string) (volumeLocation, func(), error) {
	var at volumeLocation
	if err := requireVolumeID(id); err != nil {
		return at, nil, err
	}
	if path == "" {
		return at, nil, invalidf("%s is required", field)
	}
	unlock, err := s.p.locks.lock(ctx, id)
	if err != nil {
		return at, nil, err
	}
	fail := func(err error) (volumeLocation, func(), error) {
		unlock()
		return at, nil, err
	}
	m, mounted, err := mount.Lookup(path)
	if err != nil {
		return fail(err)
	}
	if !mounted {
		return fail(notFoundf("volume %s is not at %s", id, path))
	}
	at.rdev, at.fs = unix.Mkdev(uint32(m.Major), uint32(m.Minor)), true
	if node, ok, err := deviceNodeAt(path); err != nil {
		return fail(err)
	} else if ok {
		at.rdev, at.fs = node, false
	}
	backing, err := loopBacking(at.rdev)
	at.image = strings.TrimSuffix(backing, deletedSuffix)
	// The kernel shows the path with the pool directory's symlinks resolved.
	want := s.p.pool.path(id)
	if dir, err := filepath.EvalSymlinks(filepath.Dir(want)); err == nil {
		want = filepath.Join(dir, filepath.Base(want))
	}
	if err != nil || at.image != want {
		return fail(notFoundf("volume %s is not at %s", id, path))
	}
	at.deleted = at.image != backing
	return at, unlock, nil
}

// deletedSuffix is what the kernel appends to a loop device's backing_file
// once the file is unlinked.
const deletedSuffix = " (deleted)"

// loopBacking is the backing file of the loop device rdev, as sysfs shows
// it; an error when rdev is not a bound loop device.
func loopBacking(rdev uint64) (string, error) {
	b, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/loop/backing_file", unix.Major(rdev), unix.Minor(rdev)))
	if err != nil {
		return "", fmt.Errorf("device %d:%d is not a loop device: %w", unix.Major(rdev), unix.Minor(rdev), err)
	}
	return strings.TrimRight(string(b), "\n"), nil
}

// ext4Errors is the error count ext4 keeps for the filesystem on rdev (0
// when it is not ext4 or has none).
func ext4Errors(rdev uint64) int {
	link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(rdev), unix.Minor(rdev)))
	if err != nil {
		return 0
	}
	b, err := os.ReadFile(filepath.Join("/sys/fs/ext4", filepath.Base(link), "errors_count"))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return n
}

// blockSize is the size of the block device at path.
func blockSize(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n, err := f.Seek(0, io.SeekEnd)
	if err != nil {
		return 0, fmt.Errorf("size of %s: %w", path, err)
	}
	return n, nil
}
