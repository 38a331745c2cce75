package apiserver

import (
	"context"
	"slices"
	"sync"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/retrypolicy"
	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pervolume"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/reclaimspace"
	"github.com/csiagent/csiagent/reclaim"
)

// ReclaimSpace runs reclaims now and streams their results.
func (s *Server) ReclaimSpace(req *agentv1.ReclaimSpaceRequest, stream grpc.ServerStreamingServer[agentv1.ReclaimSpaceProgress]) error {
	ctx := stream.Context()
	if err := s.recovered(ctx); err != nil {
		return err
	}
	if !req.GetOffline() && (len(req.GetSecrets()) > 0 || len(req.GetParameters()) > 0 || req.GetRetry() != nil) {
		return status.Error(codes.InvalidArgument, "secrets, parameters and retry are for an offline reclaim (ControllerReclaimSpace); NodeReclaimSpace takes none")
	}
	if req.GetOffline() {
		return s.reclaimOffline(ctx, req, stream)
	}
	var vols []pervolume.Volume
	published := s.cfg.Schedules.Reclaimable()
	switch t := req.GetTarget().(type) {
	case *agentv1.ReclaimSpaceRequest_All:
		vols = published
	case *agentv1.ReclaimSpaceRequest_Volume:
		ref := t.Volume
		for _, v := range published {
			if v.ID == ref.GetVolumeId() && (ref.GetPluginName() == "" || v.Plugin == ref.GetPluginName()) {
				vols = append(vols, v)
			}
		}
		if len(vols) == 0 {
			return status.Errorf(codes.NotFound, "volume %q is not published on this host by a plugin that offers %s", ref.GetVolumeId(), reclaim.NodeService)
		}
		if len(vols) > 1 {
			return status.Errorf(codes.InvalidArgument, "volume id %q is published by several plugins; name the plugin", ref.GetVolumeId())
		}
	case *agentv1.ReclaimSpaceRequest_ContainerId:
		var keys []isolator.PublishedVolume
		for _, c := range s.core.ListContainers() {
			if c.ID == t.ContainerId {
				for _, m := range c.Mounts {
					keys = append(keys, isolator.PublishedVolume{Plugin: m.GetPluginName(), ID: m.GetVolumeId()})
				}
			}
		}
		if len(keys) == 0 {
			return status.Errorf(codes.NotFound, "container %q has no volumes", t.ContainerId)
		}
		for _, v := range published {
			if slices.ContainsFunc(keys, func(k isolator.PublishedVolume) bool { return k.Plugin == v.Plugin && k.ID == v.ID }) {
				vols = append(vols, v)
			}
		}
	default:
		return status.Error(codes.InvalidArgument, "name a volume, a container, or all")
	}
	var mu sync.Mutex
	var sendErr error
	summary := s.cfg.Schedules.ReclaimNow(ctx, vols, func(v pervolume.Volume, r reclaim.Result, err error) {
		mu.Lock()
		defer mu.Unlock()
		if sendErr == nil {
			sendErr = stream.Send(&agentv1.ReclaimSpaceProgress{
				Volume: &agentv1.VolumeRef{PluginName: v.Plugin, VolumeId: v.ID},
				Result: s.lastReclaim(v, r, err),
			})
		}
	})
	if sendErr != nil {
		return sendErr
	}
	return stream.Send(&agentv1.ReclaimSpaceProgress{Summary: &agentv1.ReclaimSummary{
		Volumes: int32(summary.Volumes), BytesFreed: summary.BytesFreed, Failures: int32(summary.Failures),
	}})
}

// lastReclaim is the result the isolator recorded for the volume, or one
// made from the scheduler's view when none was recorded (e.g. the volume
// was not published any more).
func (s *Server) lastReclaim(v pervolume.Volume, r reclaim.Result, err error) *agentv1.ReclaimResult {
	for _, vs := range s.core.ListVolumes() {
		if vs.Plugin == v.Plugin && vs.ID == v.ID && vs.LastReclaim != nil {
			return ReclaimResult(vs.LastReclaim)
		}
	}
	res := &agentv1.ReclaimResult{Outcome: "ok", PreUsage: r.PreUsage, PostUsage: r.PostUsage}
	if err != nil {
		res.Outcome, res.Code = status.Convert(err).Message(), status.Code(err).String()
	}
	return res
}

func (s *Server) reclaimOffline(ctx context.Context, req *agentv1.ReclaimSpaceRequest, stream grpc.ServerStreamingServer[agentv1.ReclaimSpaceProgress]) error {
	ref := req.GetVolume()
	if ref.GetPluginName() == "" || ref.GetVolumeId() == "" {
		return status.Error(codes.InvalidArgument, "offline reclaim needs the plugin and the volume id")
	}
	if !s.cfg.Plugins.Offers(ref.GetPluginName(), reclaim.ControllerService) {
		return status.Errorf(codes.FailedPrecondition, "plugin %s does not offer %s", ref.GetPluginName(), reclaim.ControllerService)
	}
	policy, err := retrypolicy.Parse(req.GetRetry())
	if err != nil {
		return status.Error(codes.InvalidArgument, err.Error())
	}
	ctx, cancel := context.WithTimeout(ctx, policy.Timeout)
	defer cancel()
	conn, err := s.cfg.Plugins.ControllerConn(ctx, ref.GetPluginName(), reclaim.ControllerService)
	if err != nil {
		return err
	}
	res, err := s.core.ReclaimOffline(ctx, reclaimspace.NewReclaimSpaceControllerClient(conn), ref.GetPluginName(), ref.GetVolumeId(), req.GetSecrets(), req.GetParameters(), policy)
	if res == nil {
		return Status(err)
	}
	if err := stream.Send(&agentv1.ReclaimSpaceProgress{Volume: ref, Result: ReclaimResult(res)}); err != nil {
		return err
	}
	sum := &agentv1.ReclaimSummary{Volumes: 1, BytesFreed: res.GetBytesReclaimed()}
	if err != nil {
		sum.Failures = 1
	}
	return stream.Send(&agentv1.ReclaimSpaceProgress{Summary: sum})
}
