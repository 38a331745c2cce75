package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/mount"
	rs "github.com/csiagent/csiagent/proto/reclaimspace"
)

// Reclaim calls do not wait for the volume's lock: per the csi-addons
// ReclaimSpace error table, a call that finds another operation on the
// volume in flight fails at once with Aborted (ErrBusy) and the caller
// retries with backoff.

func usage(b int64) *rs.StorageConsumption { return &rs.StorageConsumption{UsageBytes: b} }

type reclaimNodeServer struct {
	rs.UnimplementedReclaimSpaceNodeServer
	p *Plugin
}

var _ rs.ReclaimSpaceNodeServer = (*reclaimNodeServer)(nil)

// NodeReclaimSpace trims the filesystem of a staged volume (FITRIM on its
// staging or volume path), which punches holes into the sparse image. The
// usages are the image's allocated bytes before and after. For a block
// volume nothing is trimmed (the plugin cannot know which blocks are free)
// and both usages are the current allocation; a block volume whose device
// cannot discard is Unimplemented, as the spec says for it.
func (s *reclaimNodeServer) NodeReclaimSpace(ctx context.Context, req *rs.NodeReclaimSpaceRequest) (*rs.NodeReclaimSpaceResponse, error) {
	id, path := req.GetVolumeId(), req.GetVolumePath()
	var pathErr error
	if path == "" {
		pathErr = invalidf("volume_path is required")
	}
	vol, ds, unlock, err := s.p.lockedAttached(ctx, id, true, pathErr)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if len(ds) == 0 {
		return nil, notFoundf("volume %s is not staged on this node", id)
	}
	var (
		fsPath       string
		fsDev, block loopdev.Device
	)
	isBlock := false
	for _, p := range []string{req.GetStagingTargetPath(), path} {
		if p == "" {
			continue
		}
		m, ok, err := mount.Lookup(p)
		if err != nil {
			return nil, err
		}
		if !ok {
			continue
		}
		if d, fs := ds.withFS(m); fs {
			fsPath, fsDev = p, d
			break
		}
		if d, node := ds.at(m, p); node {
			block, isBlock = d, true
		}
	}
	if fsPath == "" && !isBlock {
		return nil, notFoundf("volume %s is not at %s", id, path)
	}
	if fsPath == "" {
		// The spec's UNIMPLEMENTED: this volume cannot discard, and the
		// CO stops reclaiming it (only it).
		if can, err := canDiscard(block); err != nil {
			return nil, err
		} else if !can {
			return nil, unimplementedf("volume %s: device %s cannot discard (discard_max_bytes is 0): its space cannot be reclaimed", id, block.Path)
		}
		b, err := Allocated(vol.Path)
		if err != nil {
			return nil, err
		}
		return &rs.NodeReclaimSpaceResponse{PreUsage: usage(b), PostUsage: usage(b)}, nil
	}
	// Flush first: blocks freed by deletes are only trimmable once the
	// filesystem has really freed them (SettleFrees) and committed the
	// frees (syncfs).
	if err := mount.SettleFrees(fsPath); err != nil {
		return nil, fmt.Errorf("reclaim volume %s: %w", id, err)
	}
	if err := atomicfile.SyncFS(fsPath); err != nil {
		return nil, err
	}
	pre, err := Allocated(vol.Path)
	if err != nil {
		return nil, err
	}
	trimmed, err := mount.Trim(fsPath)
	if err != nil {
		return nil, fmt.Errorf("reclaim volume %s: %w", id, err)
	}
	if err := awaitWrites(ctx, fsDev); err != nil {
		return nil, fmt.Errorf("reclaim volume %s: %w", id, err)
	}
	post, err := Allocated(vol.Path)
	if err != nil {
		return nil, err
	}
	s.p.log.Info("reclaimed space", "volume", id, "path", fsPath, "trimmed", trimmed, "pre_usage", pre, "post_usage", post)
	return &rs.NodeReclaimSpaceResponse{PreUsage: usage(pre), PostUsage: usage(post)}, nil
}

// discardWait bounds how long NodeReclaimSpace waits for the discards of
// a trim to reach the image.
const discardWait = 5 * time.Second

// awaitWrites waits until d has no writes in flight, or discardWait has
// passed (a container that writes all the time may keep some in flight),
// polling its queue's inflight counters. xfs issues a trim's discards
// without waiting for them, so FITRIM returns before the loop device has
// punched the holes; discards count as writes. Only the caller's deadline
// is an error.
func awaitWrites(ctx context.Context, d loopdev.Device) error {
	p := fmt.Sprintf("/sys/dev/block/%d:%d/inflight", d.Major, d.Minor)
	deadline := time.NewTimer(discardWait)
	defer deadline.Stop()
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		b, err := os.ReadFile(p)
		if err != nil {
			return fmt.Errorf("device %s: %w", d.Path, err)
		}
		var reads, writes int
		if _, err := fmt.Sscan(string(b), &reads, &writes); err != nil {
			return fmt.Errorf("device %s: %s: %w", d.Path, p, err)
		}
		if writes == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("device %s: waiting for its discards: %w", d.Path, ctx.Err())
		case <-deadline.C:
			return nil
		case <-tick.C:
		}
	}
}

// canDiscard reports whether the device accepts discards (its queue's
// discard_max_bytes is not 0).
func canDiscard(d loopdev.Device) (bool, error) {
	p := fmt.Sprintf("/sys/dev/block/%d:%d/queue/discard_max_bytes", d.Major, d.Minor)
	b, err := os.ReadFile(p)
	if err != nil {
		return false, fmt.Errorf("device %s: %w", d.Path, err)
	}
	return strings.TrimSpace(string(b)) != "0", nil
}

type reclaimControllerServer struct {
	rs.UnimplementedReclaimSpaceControllerServer
	p *Plugin
}

var _ rs.ReclaimSpaceControllerServer = (*reclaimControllerServer)(nil)

// ControllerReclaimSpace reclaims the free space of a volume that is not
// staged, offline: e2fsck -E discard on an ext2/3/4 image, a private mount
// and FITRIM for xfs; a blank volume or unknown data is left as is. A
// staged volume is FailedPrecondition (use NodeReclaimSpace).
func (s *reclaimControllerServer) ControllerReclaimSpace(ctx context.Context, req *rs.ControllerReclaimSpaceRequest) (*rs.ControllerReclaimSpaceResponse, error) {
	id := req.GetVolumeId()
	vol, ds, unlock, err := s.p.lockedAttached(ctx, id, true)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if len(ds) > 0 {
		return nil, preconditionf("volume %s is staged (attached to %s): reclaim it with NodeReclaimSpace", id, ds[0].Path)
	}
	pre, err := Allocated(vol.Path)
	if err != nil {
		return nil, err
	}
	f, err := os.Open(vol.Path)
	if err != nil {
		return nil, err
	}
	fsType, err := detectFS(f)
	f.Close()
	if err != nil {
		return nil, err
	}
	switch fsType {
	case "ext2", "ext3", "ext4":
		err = s.p.fsckDiscard(ctx, vol)
	case "xfs":
		err = s.p.trimOffline(ctx, vol)
	}
	if err != nil {
		return nil, fmt.Errorf("reclaim volume %s: %w", id, err)
	}
	post, err := Allocated(vol.Path)
	if err != nil {
		return nil, err
	}
	s.p.log.Info("reclaimed space offline", "volume", id, "fs_type", fsType, "pre_usage", pre, "post_usage", post)
	return &rs.ControllerReclaimSpaceResponse{PreUsage: usage(pre), PostUsage: usage(post)}, nil
}

// fsckDiscard runs e2fsck -E discard on the image: after the check it
// discards the free blocks, which on a regular file punches holes.
// Preen mode (-p) only fixes what is safe; exit codes 0-2 are success.
func (p *Plugin) fsckDiscard(ctx context.Context, vol Volume) error {
	if p.tools.e2fsck == "" {
		return preconditionf("e2fsck not found in $PATH or %s", strings.Join(toolDirs(), ":"))
	}
	err := run(ctx, fsckTimeout, p.tools.e2fsck, "-f", "-p", "-E", "discard", vol.Path)
	var exit interface{ ExitCode() int }
	if errors.As(err, &exit) && exit.ExitCode() > 0 && exit.ExitCode() <= 2 {
		return nil // errors found and corrected
	}
	return err
}

// trimOffline mounts the image privately, trims it and unmounts it. The
// loop device is autoclear and released when the function returns.
func (p *Plugin) trimOffline(ctx context.Context, vol Volume) error {
	dir, err := os.MkdirTemp("", "csi-loop-reclaim-")
	if err != nil {
		return err
	}
	defer os.Remove(dir)
	dev, f, err := loopdev.Attach(ctx, vol.Path, loopdev.Options{AutoClear: true})
	if err != nil {
		return err
	}
	defer f.Close()
	if err := mount.Mount(dev.Path, dir, "xfs", nil); err != nil {
		return err
	}
	_, terr := mount.Trim(dir)
	return errors.Join(terr, mount.Unmount(ctx, dir))
}
