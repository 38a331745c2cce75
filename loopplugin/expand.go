package loopplugin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/mount"
)

// ControllerExpandVolume grows a volume's image to required_bytes (never
// shrinks it: a volume already that large is done). The node grows the
// device and the filesystem: node_expansion_required.
func (s *controllerServer) ControllerExpandVolume(ctx context.Context, req *csi.ControllerExpandVolumeRequest) (*csi.ControllerExpandVolumeResponse, error) {
	id := req.GetVolumeId()
	want, sizeErr := volumeSize(req.GetCapacityRange())
	if sizeErr == nil && req.GetCapacityRange().GetRequiredBytes() == 0 {
		sizeErr = invalidf("capacity_range.required_bytes is required: the new size")
	}
	vol, unlock, err := s.p.lockedVolume(ctx, id, true, sizeErr)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if lim := req.GetCapacityRange().GetLimitBytes(); lim > 0 && vol.Size > lim {
		return nil, outOfRangef("volume %s is %d bytes, more than limit_bytes %d: volumes do not shrink", id, vol.Size, lim)
	}
	if want > vol.Size {
		if err := os.Truncate(vol.Path, want); err != nil {
			return nil, fmt.Errorf("grow volume %s: %w", id, err)
		}
		s.p.log.Info("volume grown", "volume", id, "from", vol.Size, "to", want)
		vol.Size = want
	}
	return &csi.ControllerExpandVolumeResponse{CapacityBytes: vol.Size, NodeExpansionRequired: true}, nil
}

// NodeExpandVolume makes a staged volume's device and filesystem as large
// as its image, online: LOOP_SET_CAPACITY, then resize2fs (ext) or
// xfs_growfs (xfs) on the mounted filesystem. volume_path is where it is
// published (or staged). A required_bytes larger than the image is
// OutOfRange: grow the volume first (ControllerExpandVolume).
func (s *nodeServer) NodeExpandVolume(ctx context.Context, req *csi.NodeExpandVolumeRequest) (*csi.NodeExpandVolumeResponse, error) {
	at, unlock, err := s.volumeAt(ctx, req.GetVolumeId(), req.GetVolumePath(), "volume_path")
	if err != nil {
		return nil, err
	}
	defer unlock()
	if at.deleted {
		return nil, preconditionf("volume %s: its backing image was removed", req.GetVolumeId())
	}
	fi, err := os.Stat(at.image)
	if err != nil {
		return nil, err
	}
	if r := req.GetCapacityRange().GetRequiredBytes(); r > fi.Size() {
		return nil, outOfRangef("volume %s is %d bytes, less than required_bytes %d: grow it first (ControllerExpandVolume)", req.GetVolumeId(), fi.Size(), r)
	}
	link, err := os.Readlink(fmt.Sprintf("/sys/dev/block/%d:%d", unix.Major(at.rdev), unix.Minor(at.rdev)))
	if err != nil {
		return nil, fmt.Errorf("volume %s: its device: %w", req.GetVolumeId(), err)
	}
	dev := "/dev/" + filepath.Base(link)
	f, err := os.OpenFile(dev, os.O_RDONLY, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", dev, err)
	}
	err = unix.IoctlSetInt(int(f.Fd()), unix.LOOP_SET_CAPACITY, 0)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("LOOP_SET_CAPACITY on %s: %w", dev, err)
	}
	if at.fs {
		m, _, err := mount.Lookup(req.GetVolumePath())
		if err != nil {
			return nil, err
		}
		grow := s.p.tools.grow[m.FSType]
		if grow == "" {
			return nil, preconditionf("volume %s: cannot grow a %s filesystem (resize2fs or xfs_growfs not found)", req.GetVolumeId(), m.FSType)
		}
		target := dev // resize2fs grows a mounted ext filesystem through its device
		if m.FSType == "xfs" {
			target = req.GetVolumePath() // xfs_growfs takes the mount point
		}
		if err := run(ctx, mkfsTimeout, grow, target); err != nil {
			return nil, fmt.Errorf("grow the filesystem of volume %s: %w", req.GetVolumeId(), err)
		}
	}
	s.p.log.Info("volume expanded on the node", "volume", req.GetVolumeId(), "bytes", fi.Size(), "path", req.GetVolumePath())
	return &csi.NodeExpandVolumeResponse{CapacityBytes: fi.Size()}, nil
}
