package main

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"sync"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The node calls below work only with --data-dir: a volume is the directory
// <data-dir>/<path-escaped volume id>, staging bind-mounts it on the staging
// path and publishing bind-mounts the staging path on the target path
// (read-only if asked). Repeated calls that are already done succeed.

// keyedMutex refuses a second concurrent operation on one volume, with the
// CSI code for that (Aborted), instead of queueing it.
type keyedMutex struct {
	mu   sync.Mutex
	held map[string]bool
}

func (k *keyedMutex) tryLock(key string) (unlock func(), ok bool) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.held[key] {
		return nil, false
	}
	k.held[key] = true
	return func() {
		k.mu.Lock()
		delete(k.held, key)
		k.mu.Unlock()
	}, true
}

// begin checks that node volume calls are enabled and takes the volume's
// lock.
func (p *plugin) begin(method, volumeID string) (unlock func(), err error) {
	if p.cfg.dataDir == "" {
		return nil, status.Errorf(codes.Unimplemented, "%s needs --data-dir", method)
	}
	if volumeID == "" {
		return nil, status.Error(codes.InvalidArgument, "volume_id is required")
	}
	unlock, ok := p.volumes.tryLock(volumeID)
	if !ok {
		return nil, status.Errorf(codes.Aborted, "an operation on volume %q is in progress", volumeID)
	}
	return unlock, nil
}

func (p *plugin) volumeDir(id string) (string, error) {
	name := url.PathEscape(id)
	if name == "." || name == ".." {
		return "", status.Errorf(codes.InvalidArgument, "volume_id %q is not a usable name", id)
	}
	return filepath.Join(p.cfg.dataDir, name), nil
}

func (p *plugin) NodeStageVolume(_ context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	unlock, err := p.begin("NodeStageVolume", req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if req.GetStagingTargetPath() == "" || req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "staging_target_path and volume_capability are required")
	}
	src, err := p.volumeDir(req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(src, 0o750); err != nil {
		return nil, status.Errorf(codes.Internal, "create volume directory: %v", err)
	}
	if err := bindMount(src, req.GetStagingTargetPath(), false); err != nil {
		return nil, status.Errorf(codes.Internal, "stage: %v", err)
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (p *plugin) NodeUnstageVolume(_ context.Context, req *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	unlock, err := p.begin("NodeUnstageVolume", req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if req.GetStagingTargetPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "staging_target_path is required")
	}
	if err := unmount(req.GetStagingTargetPath()); err != nil {
		return nil, status.Errorf(codes.Internal, "unstage: %v", err)
	}
	return &csi.NodeUnstageVolumeResponse{}, nil
}

func (p *plugin) NodePublishVolume(_ context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	unlock, err := p.begin("NodePublishVolume", req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if req.GetStagingTargetPath() == "" || req.GetTargetPath() == "" || req.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "staging_target_path, target_path and volume_capability are required")
	}
	if err := bindMount(req.GetStagingTargetPath(), req.GetTargetPath(), req.GetReadonly()); err != nil {
		return nil, status.Errorf(codes.Internal, "publish: %v", err)
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (p *plugin) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	unlock, err := p.begin("NodeUnpublishVolume", req.GetVolumeId())
	if err != nil {
		return nil, err
	}
	defer unlock()
	if req.GetTargetPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "target_path is required")
	}
	if err := unmount(req.GetTargetPath()); err != nil {
		return nil, status.Errorf(codes.Internal, "unpublish: %v", err)
	}
	if err := os.Remove(req.GetTargetPath()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, status.Errorf(codes.Internal, "unpublish: %v", err)
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// bindMount bind-mounts src on dst, creating dst; a dst that is already a
// mount point is taken as done.
func bindMount(src, dst string, readonly bool) error {
	if err := os.MkdirAll(dst, 0o750); err != nil {
		return err
	}
	mounted, err := mountinfo.Mounted(dst)
	if err != nil {
		return err
	}
	if mounted {
		return nil
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind mount %s on %s: %w", src, dst, err)
	}
	if readonly {
		if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			_ = unix.Unmount(dst, unix.MNT_DETACH)
			return fmt.Errorf("remount %s read-only: %w", dst, err)
		}
	}
	return nil
}

// unmount unmounts path; a path that is missing or not a mount point is
// done.
func unmount(path string) error {
	err := unix.Unmount(path, 0)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("unmount %s: %w", path, err)
}
