package loopplugin

import (
	"context"
	"os"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/csiagent/csiagent/proto/identity"
)

type identityServer struct {
	csi.UnimplementedIdentityServer
	p *Plugin
}

var _ csi.IdentityServer = (*identityServer)(nil)

func (s *identityServer) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: s.p.name, VendorVersion: s.p.version}, nil
}

func (s *identityServer) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	var caps []*csi.PluginCapability
	for _, t := range []csi.PluginCapability_Service_Type{
		csi.PluginCapability_Service_CONTROLLER_SERVICE,
		csi.PluginCapability_Service_GROUP_CONTROLLER_SERVICE,
		csi.PluginCapability_Service_VOLUME_ACCESSIBILITY_CONSTRAINTS,
	} {
		caps = append(caps, &csi.PluginCapability{
			Type: &csi.PluginCapability_Service_{Service: &csi.PluginCapability_Service{Type: t}},
		})
	}
	caps = append(caps, &csi.PluginCapability{Type: &csi.PluginCapability_VolumeExpansion_{
		VolumeExpansion: &csi.PluginCapability_VolumeExpansion{Type: csi.PluginCapability_VolumeExpansion_ONLINE},
	}})
	return &csi.GetPluginCapabilitiesResponse{Capabilities: caps}, nil
}

// Probe reports ready while the pool directory is reachable.
func (s *identityServer) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	if _, err := os.Stat(s.p.pool.Dir()); err != nil {
		return nil, preconditionf("pool unavailable: %v", err)
	}
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}

// addonsIdentityServer is csi-addons' identity on a separate csi-addons
// endpoint: what the plugin offers there.
type addonsIdentityServer struct {
	identity.UnimplementedIdentityServer
	p *Plugin
}

func (s *addonsIdentityServer) GetIdentity(context.Context, *identity.GetIdentityRequest) (*identity.GetIdentityResponse, error) {
	return &identity.GetIdentityResponse{Name: s.p.name, VendorVersion: s.p.version}, nil
}

func (s *addonsIdentityServer) GetCapabilities(context.Context, *identity.GetCapabilitiesRequest) (*identity.GetCapabilitiesResponse, error) {
	caps := []*identity.Capability{
		{Type: &identity.Capability_Service_{Service: &identity.Capability_Service{Type: identity.Capability_Service_CONTROLLER_SERVICE}}},
		{Type: &identity.Capability_Service_{Service: &identity.Capability_Service{Type: identity.Capability_Service_NODE_SERVICE}}},
		{Type: &identity.Capability_ReclaimSpace_{ReclaimSpace: &identity.Capability_ReclaimSpace{Type: identity.Capability_ReclaimSpace_ONLINE}}},
		{Type: &identity.Capability_ReclaimSpace_{ReclaimSpace: &identity.Capability_ReclaimSpace{Type: identity.Capability_ReclaimSpace_OFFLINE}}},
		{Type: &identity.Capability_VolumeGroup_{VolumeGroup: &identity.Capability_VolumeGroup{Type: identity.Capability_VolumeGroup_VOLUME_GROUP}}},
	}
	if s.p.replica != nil {
		caps = append(caps,
			&identity.Capability{Type: &identity.Capability_VolumeReplication_{VolumeReplication: &identity.Capability_VolumeReplication{Type: identity.Capability_VolumeReplication_VOLUME_REPLICATION}}},
			&identity.Capability{Type: &identity.Capability_VolumeReplication_{VolumeReplication: &identity.Capability_VolumeReplication{Type: identity.Capability_VolumeReplication_GET_REPLICATION_DESTINATION_INFO}}})
	}
	return &identity.GetCapabilitiesResponse{Capabilities: caps}, nil
}

func (s *addonsIdentityServer) Probe(ctx context.Context, _ *identity.ProbeRequest) (*identity.ProbeResponse, error) {
	if _, err := (&identityServer{p: s.p}).Probe(ctx, nil); err != nil {
		return nil, err
	}
	return &identity.ProbeResponse{Ready: wrapperspb.Bool(true)}, nil
}
