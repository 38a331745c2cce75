package apiserver

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/csiagent/csiagent/cluster"
	"github.com/csiagent/csiagent/internal/statuscode"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/volumestats"
)

// Status chooses the status code of an isolator error: a plugin's own
// code is kept (the isolator's plugin errors, and status errors wrapped
// in err, such as the agent's controller calls); the isolator's classes
// map to theirs; anything else is Internal (never Unknown).
func Status(err error) error {
	if err == nil {
		return nil
	}
	if code, ok := isolator.RPCCode(err); ok {
		return status.Error(code, err.Error())
	}
	if s, ok := status.FromError(err); ok && s.Code() != codes.Unknown {
		return status.Error(s.Code(), err.Error())
	}
	return statuscode.Error(err,
		statuscode.Class{Err: isolator.ErrInvalid, Code: codes.InvalidArgument},
		statuscode.Class{Err: isolator.ErrPrecondition, Code: codes.FailedPrecondition},
		statuscode.Class{Err: isolator.ErrUnknownPlugin, Code: codes.NotFound},
		statuscode.Class{Err: isolator.ErrUnavailable, Code: codes.Unavailable},
		statuscode.Class{Err: namedvol.ErrInvalid, Code: codes.InvalidArgument},
		statuscode.Class{Err: namedvol.ErrNotFound, Code: codes.NotFound},
		statuscode.Class{Err: namedvol.ErrExists, Code: codes.AlreadyExists},
		statuscode.Class{Err: namedvol.ErrInUse, Code: codes.FailedPrecondition},
		statuscode.Class{Err: namedvol.ErrCreating, Code: codes.FailedPrecondition},
		statuscode.Class{Err: namedvol.ErrAnnotationRefused, Code: codes.PermissionDenied},
		statuscode.Class{Err: cluster.ErrUnavailable, Code: codes.Unavailable},
		statuscode.Class{Err: cluster.ErrInvalid, Code: codes.InvalidArgument},
		statuscode.Class{Err: cluster.ErrNotFound, Code: codes.NotFound},
		statuscode.Class{Err: cluster.ErrNodeAlive, Code: codes.FailedPrecondition},
		statuscode.Class{Err: cluster.ErrNotFenced, Code: codes.FailedPrecondition},
		// The work dir is full: a checkpoint could not be written.
		statuscode.Class{Err: isolator.ErrLimit, Code: codes.ResourceExhausted},
		statuscode.Class{Err: syscall.ENOSPC, Code: codes.ResourceExhausted},
		statuscode.Class{Err: syscall.EDQUOT, Code: codes.ResourceExhausted},
	)
}

// recovered waits for the isolator's first recovery pass, or ctx (then
// Unavailable): a volume call that arrives at start (the sockets serve
// before that) waits rather than fail on a plugin not configured yet.
func (s *Server) recovered(ctx context.Context) error {
	if err := s.core.WaitRecovered(ctx); err != nil {
		return status.Error(codes.Unavailable, err.Error())
	}
	return nil
}

// CheckNotEngineID refuses, from API callers, the container ids of the
// engines' mounts: those belong to the engine endpoint.
func CheckNotEngineID(id string) error {
	if strings.HasPrefix(id, namedvol.EngineMountPrefix) {
		return fmt.Errorf("%w: container_id %q: ids starting with %q are the container engines' volume mounts; release them through the engine", isolator.ErrInvalid, id, namedvol.EngineMountPrefix)
	}
	return nil
}

// checkManager checks a container manager's name (PrepareRequest.manager):
// as a container id's characters, at most 64 bytes.
func checkManager(m string) error {
	if m == "" {
		return nil
	}
	if len(m) > 64 {
		return fmt.Errorf("%w: manager %.64q... is longer than 64 bytes", isolator.ErrInvalid, m)
	}
	return isolator.ValidateID("manager", m)
}

// Prepare makes the container's volumes available in it.
func (s *Server) Prepare(ctx context.Context, req *agentv1.PrepareRequest) (*agentv1.PrepareResponse, error) {
	if err := CheckNotEngineID(req.GetContainerId()); err != nil {
		return nil, Status(err)
	}
	if err := checkManager(req.GetManager()); err != nil {
		return nil, Status(err)
	}
	c, err := member(ctx)
	if err != nil {
		return nil, err
	}
	var mountNS uint64 // the pid's namespace, checked (a member's)
	if c != nil {
		// Rootfs and sandbox go on as the paths checked (resolved), to
		// be opened with no symlink on the way (see prepare).
		checked, err := s.cfg.Members.CheckPrepare(c, req)
		if err != nil {
			return nil, err
		}
		req.Rootfs, req.Sandbox = checked.Rootfs, checked.Sandbox
		mountNS = checked.MountNamespace
	}
	if err := s.recovered(ctx); err != nil {
		return nil, err
	}
	if len(req.GetNamedMounts()) == 0 {
		return s.prepare(ctx, c, mountNS, PrepareRequest(req), nil)
	}
	var resp *agentv1.PrepareResponse
	named, annotation := namedMounts(req), req.GetNamedMountsFromAnnotation()
	err = s.cfg.Named.Resolve(ctx, named, annotation, func(vols []*statev1.Volume) error {
		full := PrepareRequest(req)
		explicit := len(full.Volumes)
		full.Volumes = append(full.Volumes, vols...)
		var perr error
		resp, perr = s.prepare(ctx, c, mountNS, full, func(err error) {
			// The named mounts' volumes follow the request's own: named
			// as the request does, not by their index in full.
			var ve *isolator.VolumeError
			if errors.As(err, &ve) && ve.Index >= explicit && ve.Index-explicit < len(named) {
				j := ve.Index - explicit
				name := fmt.Sprintf("named_mounts[%d]", j)
				if annotation {
					name = namedvol.MountLabel(true, j)
				}
				ve.Name = fmt.Sprintf("%s (%s)", name, named[j].Name)
			}
		})
		if perr != nil {
			return prepareFailed{perr}
		}
		return nil
	})
	var failed prepareFailed
	if errors.As(err, &failed) {
		return nil, failed.err // a status already
	}
	if err != nil {
		return nil, Status(err)
	}
	return resp, nil
}

// prepareFailed carries the status error of a prepare through Resolve.
type prepareFailed struct{ err error }

func (p prepareFailed) Error() string { return p.err.Error() }

// prepare is Prepare of a checked request, its named mounts resolved, by
// root (c nil) or a member (whose pid, if any, was checked in mount
// namespace mountNS); refused, if not nil, sees the core's refusal before
// it is answered.
func (s *Server) prepare(ctx context.Context, c *unix.Ucred, mountNS uint64, req *statev1.PrepareRequest, refused func(error)) (*agentv1.PrepareResponse, error) {
	req.Confined, req.CheckedMountNamespace = c != nil, mountNS
	mounts, err := s.core.Prepare(ctx, req)
	s.cfg.OnVolumesChanged()
	if err != nil {
		if refused != nil {
			refused(err)
		}
		return nil, Status(err)
	}
	resp := &agentv1.PrepareResponse{Mounts: Mounts(mounts)}
	if c != nil {
		if err := s.cfg.Members.CheckMounts(c, resp.Mounts); err != nil {
			// Undone whatever the caller's ctx: the mount is not the
			// member's to keep.
			if cerr := s.core.Cleanup(context.WithoutCancel(ctx), req.GetContainerId(), true); cerr != nil {
				return nil, status.Errorf(codes.PermissionDenied, "%s (and undoing it failed: %v)", status.Convert(err).Message(), cerr)
			}
			s.cfg.OnVolumesChanged()
			return nil, err
		}
	}
	return resp, nil
}

// Cleanup releases the container's volumes.
func (s *Server) Cleanup(ctx context.Context, req *agentv1.CleanupRequest) (*agentv1.CleanupResponse, error) {
	if err := CheckNotEngineID(req.GetContainerId()); err != nil {
		return nil, Status(err)
	}
	c, err := member(ctx)
	if err != nil {
		return nil, err
	}
	if err := s.recovered(ctx); err != nil {
		return nil, err
	}
	var allow func(isolator.ContainerInfo) error
	var refused error
	if c != nil {
		// Checked on the container as it is under its lock: a root
		// Prepare of the same id cannot slip in between.
		allow = func(ci isolator.ContainerInfo) error {
			refused = s.cfg.Members.CheckCleanup(c, req.GetContainerId(), []isolator.ContainerInfo{ci})
			return refused
		}
	}
	err = s.core.CleanupIf(ctx, req.GetContainerId(), req.GetForce(), allow)
	if refused != nil {
		return nil, refused
	}
	s.cfg.OnVolumesChanged()
	if err != nil {
		return nil, Status(err)
	}
	return &agentv1.CleanupResponse{}, nil
}

// ListVolumes reports every volume with its last stats and next runs.
func (s *Server) ListVolumes(ctx context.Context, req *agentv1.ListVolumesRequest) (*agentv1.ListVolumesResponse, error) {
	if req.GetRefreshStats() {
		s.cfg.Stats.Refresh(ctx)
	}
	var vols []*agentv1.VolumeStatus
	for _, info := range s.core.ListVolumes() {
		v := VolumeStatus(info)
		vols = append(vols, v)
		if st, ok := s.cfg.Stats.Get(v.PluginName, v.VolumeId); ok && v.State == agentv1.VolumeStatus_PUBLISHED {
			v.Stats = statsOf(st)
		}
		// A volume never reclaimed has its first run scheduled but not
		// checkpointed (it follows from when it was published).
		if v.NextReclaim == nil {
			if next, ok := s.cfg.Schedules.NextReclaim(v.PluginName, v.VolumeId); ok {
				v.NextReclaim = timestamppb.New(next)
			}
		}
		if v.NextKeyRotation == nil {
			if next, ok := s.cfg.Schedules.NextKeyRotation(v.PluginName, v.VolumeId); ok {
				v.NextKeyRotation = timestamppb.New(next)
			}
		}
	}
	return &agentv1.ListVolumesResponse{Volumes: vols}, nil
}

// statsOf is a poll result in the API's form.
func statsOf(s volumestats.Stats) *agentv1.VolumeStats {
	out := &agentv1.VolumeStats{
		Time:       timestamppb.New(s.At),
		BytesKnown: s.Bytes.Known, CapacityBytes: s.Bytes.Total, UsedBytes: s.Bytes.Used, AvailableBytes: s.Bytes.Available,
		InodesKnown: s.Inodes.Known, Inodes: s.Inodes.Total, InodesUsed: s.Inodes.Used, InodesFree: s.Inodes.Available,
		HealthKnown: s.HealthKnown, Abnormal: s.Abnormal, Condition: s.Condition,
	}
	if s.Err != nil {
		out.Error = s.Err.Error()
	}
	return out
}

// ListContainers reports every container the agent prepared.
func (s *Server) ListContainers(context.Context, *agentv1.ListContainersRequest) (*agentv1.ListContainersResponse, error) {
	resp := &agentv1.ListContainersResponse{}
	for _, c := range s.core.ListContainers() {
		resp.Containers = append(resp.Containers, ContainerStatus(c))
	}
	return resp, nil
}

// Reconcile cleans up the containers not in the live list: root only (it
// cleans up every container not listed, other users' too).
func (s *Server) Reconcile(ctx context.Context, req *agentv1.ReconcileRequest) (*agentv1.ReconcileResponse, error) {
	c, err := member(ctx)
	if err != nil {
		return nil, err
	}
	if c != nil {
		return nil, denied(c, "Reconcile cleans up every container not in live_container_ids, root's and other users' too: only root may call it; clean up your own containers with Cleanup")
	}
	for i, id := range req.GetLiveContainerIds() {
		if err := isolator.ValidateID(fmt.Sprintf("live_container_ids[%d]", i), id); err != nil {
			return nil, Status(err)
		}
	}
	if err := s.recovered(ctx); err != nil {
		return nil, err
	}
	// The engines' mounts are the engine endpoint's to release.
	live := req.GetLiveContainerIds()
	for _, c := range s.core.ListContainers() {
		if CheckNotEngineID(c.ID) != nil {
			live = append(live, c.ID)
		}
	}
	res := s.core.Reconcile(ctx, live, req.GetManager())
	s.cfg.OnVolumesChanged()
	return &agentv1.ReconcileResponse{CleanedUp: res.CleanedUp, Failed: res.Failed}, nil
}
