package apiserver

import (
	"context"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/namedvol"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// NamedVolumes is the agent's named volumes with their engine mounts, as
// the API uses them (dockerplugin.Server).
type NamedVolumes interface {
	// Define defines a volume from engine options (with size, creates its
	// backend volume, with secrets for CreateVolume); Undefine removes one
	// nothing uses (namedvol.ErrInUse), with del its backend volume too
	// (DeleteVolume, with secrets).
	Define(ctx context.Context, name string, options, secrets map[string]string) error
	Undefine(ctx context.Context, name string, del bool, secrets map[string]string) error
	Status(name string) (namedvol.Status, error)
	// Page lists the volumes after a name, at most max (0: no bound), and
	// the after of the next page ("" after the last).
	Page(after string, max int) ([]namedvol.Status, string, error)
	// Reconcile releases the engine's mounts whose id is not in live
	// (engine "": those of no known engine).
	Reconcile(ctx context.Context, engine string, live []string) (released []string, failed map[string]string)
	// Resolve makes the volumes of named mounts (with the annotation
	// policy when annotation) and calls use with them while no engine
	// mount or removal of those names can come between.
	Resolve(ctx context.Context, mounts []namedvol.Mount, annotation bool, use func([]*statev1.Volume) error) error
}

// namedPageSize is ListNamedVolumes' page when the caller names none.
const namedPageSize = 500

// CreateNamedVolume defines a named volume.
func (s *Server) CreateNamedVolume(ctx context.Context, req *agentv1.CreateNamedVolumeRequest) (*agentv1.CreateNamedVolumeResponse, error) {
	if err := rootOnly(ctx, "CreateNamedVolume defines what containers given the name get (its volume, secrets, annotation policy, owner)"); err != nil {
		return nil, err
	}
	if err := s.cfg.Named.Define(ctx, req.GetName(), req.GetOptions(), req.GetSecrets()); err != nil {
		return nil, Status(err)
	}
	return &agentv1.CreateNamedVolumeResponse{}, nil
}

// RemoveNamedVolume removes a named volume nothing uses.
func (s *Server) RemoveNamedVolume(ctx context.Context, req *agentv1.RemoveNamedVolumeRequest) (*agentv1.RemoveNamedVolumeResponse, error) {
	if err := rootOnly(ctx, "RemoveNamedVolume frees the name for another definition"); err != nil {
		return nil, err
	}
	if err := s.cfg.Named.Undefine(ctx, req.GetName(), req.GetDeleteVolume(), req.GetSecrets()); err != nil {
		return nil, Status(err)
	}
	return &agentv1.RemoveNamedVolumeResponse{}, nil
}

// GetNamedVolume reports one named volume.
func (s *Server) GetNamedVolume(_ context.Context, req *agentv1.GetNamedVolumeRequest) (*agentv1.NamedVolume, error) {
	st, err := s.cfg.Named.Status(req.GetName())
	if err != nil {
		return nil, Status(err)
	}
	return namedVolume(st), nil
}

// ListNamedVolumes reports the named volumes a page at a time.
func (s *Server) ListNamedVolumes(_ context.Context, req *agentv1.ListNamedVolumesRequest) (*agentv1.ListNamedVolumesResponse, error) {
	max := int(req.GetMaxEntries())
	if max <= 0 {
		max = namedPageSize
	}
	sts, next, err := s.cfg.Named.Page(req.GetStartingAfter(), max)
	if err != nil {
		return nil, Status(err)
	}
	resp := &agentv1.ListNamedVolumesResponse{Next: next}
	for _, st := range sts {
		resp.Volumes = append(resp.Volumes, namedVolume(st))
	}
	return resp, nil
}

// ReconcileEngineMounts releases the engine mounts a crashed engine
// forgot: root only (it releases every mount not listed).
func (s *Server) ReconcileEngineMounts(ctx context.Context, req *agentv1.ReconcileEngineMountsRequest) (*agentv1.ReconcileEngineMountsResponse, error) {
	if err := rootOnly(ctx, "ReconcileEngineMounts releases every engine mount not in live_mount_ids, whoever's"); err != nil {
		return nil, err
	}
	engine, err := engineOf(req.GetEngine())
	if err != nil {
		return nil, err
	}
	if err := s.recovered(ctx); err != nil {
		return nil, err
	}
	released, failed := s.cfg.Named.Reconcile(ctx, engine, req.GetLiveMountIds())
	s.cfg.OnVolumesChanged()
	return &agentv1.ReconcileEngineMountsResponse{Released: released, Failed: failed}, nil
}

// rootOnly refuses a member's call of what (why only root may).
func rootOnly(ctx context.Context, what string) error {
	c, err := member(ctx)
	if err != nil {
		return err
	}
	if c != nil {
		return denied(c, "%s: only root may call it", what)
	}
	return nil
}

// engineOf is the dockerplugin engine a ReconcileEngineMountsRequest
// names.
func engineOf(name string) (string, error) {
	switch name {
	case namedvol.EngineDocker, namedvol.EnginePodman:
		return name, nil
	case namedvol.EngineUnknown:
		return "", nil
	}
	return "", status.Errorf(codes.InvalidArgument, "engine %q: %s, %s or %s (mounts by engines the agent did not recognise, or recorded before it told engines apart): "+
		"each engine's mount ids are reconciled against its own mounts only", name, namedvol.EngineDocker, namedvol.EnginePodman, namedvol.EngineUnknown)
}

// namedVolume is a named volume's status as the API shows it.
func namedVolume(st namedvol.Status) *agentv1.NamedVolume {
	return &agentv1.NamedVolume{Name: st.Name, Options: st.Options(), State: st.State, Containers: int32(st.Containers),
		EngineMountIds: st.EngineMounts, Mountpoint: st.Mountpoint, Creator: st.Creator}
}

// namedMounts are the request's named mounts in the core's terms.
func namedMounts(req *agentv1.PrepareRequest) []namedvol.Mount {
	var out []namedvol.Mount
	for _, m := range req.GetNamedMounts() {
		out = append(out, namedvol.Mount{Name: m.GetName(), ContainerPath: m.GetContainerPath(), ReadOnly: m.GetReadonly()})
	}
	return out
}
