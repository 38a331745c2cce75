package controllerops

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/mount"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/snapcat"
)

// Container-consistent group snapshots: the volumes the agent gave one
// container, their filesystems frozen (FIFREEZE on the agent's own target
// path of each: the host-side mount it made, never a path resolved in the
// container's mount namespace) around CreateVolumeGroupSnapshot.

const (
	// DefaultFreezeTimeout is how long a container's filesystems stay
	// frozen at most unless the request says otherwise.
	DefaultFreezeTimeout = 10 * time.Second
	// maxFreezeTimeout bounds freeze_timeout: writers block
	// uninterruptibly meanwhile.
	maxFreezeTimeout = 5 * time.Minute
	// CrashFrozen is the crash point reached once a container's
	// filesystems are frozen, before the plugin is called.
	CrashFrozen = "group snapshot frozen"
)

// containerVolumes fills a create request that names a container: its
// volumes and their plugin (a copy of req). All must be of one plugin.
func (s *Server) containerVolumes(req *agentv1.CreateGroupSnapshotRequest) (*agentv1.CreateGroupSnapshotRequest, error) {
	c := req.GetContainerId()
	if c == "" {
		return req, nil
	}
	if len(req.GetSourceVolumeIds()) > 0 {
		return nil, invalid("give either container_id or source_volume_ids")
	}
	if d := req.GetFreezeTimeout(); d != nil && (d.AsDuration() <= 0 || d.AsDuration() > maxFreezeTimeout) {
		return nil, invalid("freeze_timeout %v: want more than 0 and at most %v", d.AsDuration(), maxFreezeTimeout)
	}
	vols, ok := s.plugins.ContainerVolumes(c)
	switch {
	case !ok:
		return nil, status.Errorf(codes.NotFound, "no container %s has volumes from this agent ('csi-agent containers' lists them)", c)
	case len(vols) == 0:
		return nil, status.Errorf(codes.FailedPrecondition, "container %s has no volumes to snapshot", c)
	}
	var plugins []string
	for _, v := range vols {
		if !slices.Contains(plugins, v.Plugin) {
			plugins = append(plugins, v.Plugin)
		}
	}
	if len(plugins) > 1 {
		var of []string
		for _, v := range vols {
			of = append(of, v.Plugin+": "+v.ID)
		}
		return nil, status.Errorf(codes.FailedPrecondition, "container %s has volumes of %d plugins (%s): a group snapshot is of one plugin's volumes", c, len(plugins), strings.Join(of, ", "))
	}
	if p := req.GetPluginName(); p != "" && p != plugins[0] {
		return nil, invalid("container %s's volumes are of plugin %s, not %s: drop the plugin", c, plugins[0], p)
	}
	req = proto.CloneOf(req)
	req.PluginName = plugins[0]
	for _, v := range vols {
		req.SourceVolumeIds = append(req.SourceVolumeIds, v.ID)
	}
	return req, nil
}

// whileContainerFrozen runs call with the mounted filesystems of the
// request's container frozen: it records them durably (the agent's
// recovery thaws them after a crash: snapcat.ThawRecorded), freezes them,
// calls, and thaws them when call returns or when the freeze timeout
// passes, whichever is first; then it drops the record. Block volumes
// have no filesystem of the agent's to freeze: a NOTE says so.
func (s *Server) whileContainerFrozen(ctx context.Context, o *op, req *agentv1.CreateGroupSnapshotRequest, call func(context.Context) error) error {
	timeout := DefaultFreezeTimeout
	if d := req.GetFreezeTimeout(); d != nil {
		timeout = d.AsDuration()
	}
	rec := &snapcat.FreezeRecord{Group: req.GetName(), Container: req.GetContainerId(), Deadline: time.Now().Add(timeout).UTC()}
	var paths []string
	for _, id := range req.GetSourceVolumeIds() {
		pv, ok := s.plugins.Published(o.plugin, id)
		switch {
		case !ok:
			return status.Errorf(codes.FailedPrecondition, "volume %s of container %s is not published on this host now ('csi-agent volumes' shows why): nothing to freeze", id, req.GetContainerId())
		case pv.Block:
			if err := o.note("volume %s is a block volume: not frozen (the application must quiesce it itself)", id); err != nil {
				return err
			}
			continue
		}
		fsys, err := snapcat.Identify(pv.TargetPath)
		if err != nil {
			return fmt.Errorf("volume %s: %w", id, err)
		}
		rec.Filesystems = append(rec.Filesystems, fsys)
		paths = append(paths, pv.TargetPath)
	}
	if err := s.cat.RecordFreeze(rec); err != nil {
		return err
	}
	fctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	start := time.Now()
	var shared []string
	err := mount.WhileAllFrozen(fctx, paths, func(path string) {
		shared = append(shared, path)
		s.log.Warn("filesystem already frozen by someone else: snapshotting it frozen, leaving its thaw to them", "path", path)
	}, func(ctx context.Context) error {
		s.crash(CrashFrozen)
		return call(ctx)
	})
	s.log.Info("thawed", "group_snapshot", req.GetName(), "container", req.GetContainerId(), "filesystems", strings.Join(paths, ","), "frozen_for", time.Since(start).Round(time.Microsecond))
	if err != nil && errors.Is(fctx.Err(), context.DeadlineExceeded) && ctx.Err() == nil {
		err = status.Errorf(codes.DeadlineExceeded, "container %s: the freeze timeout (%v) passed before the plugin cut the group snapshot; the filesystems are thawed: raise the freeze timeout or find why the plugin is slow: %v",
			req.GetContainerId(), timeout, err)
	}
	// The record goes only once every filesystem this call froze is
	// thawed (FITHAW of a thawed one is done): a thaw that fails keeps it
	// for the next start's recovery.
	for _, p := range paths {
		if slices.Contains(shared, p) {
			continue
		}
		if terr := mount.Thaw(p); terr != nil {
			return errors.Join(err, fmt.Errorf("container %s: %w (its freeze record is kept: the agent's next start thaws it)", req.GetContainerId(), terr))
		}
	}
	return errors.Join(err, s.cat.FreezeDone(req.GetName()))
}
