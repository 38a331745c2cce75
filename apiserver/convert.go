package apiserver

import (
	"maps"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/csiagent/csiagent/cluster"
	"github.com/csiagent/csiagent/isolator"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// The translations between the API's messages and the isolator's own,
// field by field: a field added to the API reaches the isolator (and its
// checkpoints) only when it is added here (TestConvertCarriesEveryField
// fails until then). Enum values are the same numbers and names in both.

// PrepareRequest is an API Prepare request in the isolator's terms.
func PrepareRequest(r *agentv1.PrepareRequest) *statev1.PrepareRequest {
	if r == nil {
		return nil
	}
	out := &statev1.PrepareRequest{
		ContainerId: r.GetContainerId(), Rootfs: r.GetRootfs(), Sandbox: r.GetSandbox(), User: r.GetUser(), Pid: r.GetPid(),
		Manager: r.GetManager(),
	}
	for _, v := range r.GetVolumes() {
		out.Volumes = append(out.Volumes, volume(v))
	}
	return out
}

func volume(v *agentv1.Volume) *statev1.Volume {
	if v == nil {
		return nil
	}
	out := &statev1.Volume{ContainerPath: v.GetContainerPath(), Mode: statev1.Volume_Mode(v.GetMode())}
	if s := v.GetSource(); s != nil {
		out.Source = &statev1.Volume_Source{Type: statev1.Volume_Source_Type(s.GetType())}
		if c := s.GetCsiVolume(); c != nil {
			out.Source.CsiVolume = &statev1.CSIVolume{PluginName: c.GetPluginName(), StaticProvisioning: staticProvisioning(c.GetStaticProvisioning())}
		}
	}
	return out
}

func staticProvisioning(s *agentv1.StaticProvisioning) *statev1.StaticProvisioning {
	if s == nil {
		return nil
	}
	out := &statev1.StaticProvisioning{
		VolumeId: s.GetVolumeId(), NodeStageSecrets: secrets(s.GetNodeStageSecrets()), NodePublishSecrets: secrets(s.GetNodePublishSecrets()),
		ControllerPublishSecrets: secrets(s.GetControllerPublishSecrets()),
		Readonly:                 s.GetReadonly(),
	}
	for _, t := range s.GetAccessibleTopology() {
		out.AccessibleTopology = append(out.AccessibleTopology, proto.Clone(t).(*csi.Topology))
	}
	if c := s.GetVolumeCapability(); c != nil {
		out.VolumeCapability = proto.Clone(c).(*csi.VolumeCapability)
	}
	if ctx := s.GetVolumeContext(); ctx != nil {
		out.VolumeContext = make(map[string]string, len(ctx))
		for k, v := range ctx {
			out.VolumeContext[k] = v
		}
	}
	return out
}

func secrets(in map[string]*agentv1.Secret) map[string]*statev1.Secret {
	if in == nil {
		return nil
	}
	out := make(map[string]*statev1.Secret, len(in))
	for k, s := range in {
		if s == nil {
			out[k] = nil
			continue
		}
		x := &statev1.Secret{Type: statev1.Secret_Type(s.GetType())}
		if r := s.GetReference(); r != nil {
			x.Reference = &statev1.Secret_Reference{Name: r.GetName(), Key: r.GetKey()}
		}
		if v := s.GetValue(); v != nil {
			x.Value = &statev1.Secret_Value{Data: v.GetData()}
		}
		out[k] = x
	}
	return out
}

// Mounts is the isolator's container mounts in the API's terms.
func Mounts(ms []*statev1.ContainerMount) []*agentv1.ContainerMount {
	out := make([]*agentv1.ContainerMount, 0, len(ms))
	for _, m := range ms {
		out = append(out, &agentv1.ContainerMount{
			PluginName: m.GetPluginName(), VolumeId: m.GetVolumeId(), ContainerPath: m.GetContainerPath(),
			HostPath: m.GetHostPath(), MountPoint: m.GetMountPoint(), Readonly: m.GetReadonly(),
			MountId: m.GetMountId(), ParentMountId: m.GetParentMountId(), MountNamespace: m.GetMountNamespace(),
			RootDev: m.GetRootDev(), RootIno: m.GetRootIno(), BlockDevice: m.GetBlockDevice(), UniqueMountId: m.GetUniqueMountId(),
		})
	}
	return out
}

// ReclaimResult is a recorded reclaim in the API's terms (nil for nil).
func ReclaimResult(r *statev1.ReclaimResult) *agentv1.ReclaimResult {
	if r == nil {
		return nil
	}
	return &agentv1.ReclaimResult{
		Start: r.GetStart(), Duration: r.GetDuration(), Outcome: r.GetOutcome(), PreUsage: r.GetPreUsage(),
		PostUsage: r.GetPostUsage(), BytesReclaimed: r.GetBytesReclaimed(), Code: r.GetCode(),
	}
}

// VolumeStatus is a tracked volume in the API's terms (without the stats
// and schedules the isolator does not know).
func VolumeStatus(v isolator.VolumeInfo) *agentv1.VolumeStatus {
	return &agentv1.VolumeStatus{
		PluginName: v.Plugin, VolumeId: v.ID, State: agentv1.VolumeStatus_State(v.State), StateSince: timestamp(v.StateSince),
		Containers: v.Users, StagingPath: v.StagingPath, TargetPath: v.TargetPath, Block: v.Block, Readonly: v.Readonly,
		LastError: v.LastError, NextReclaim: timestamp(v.NextReclaim), LastReclaim: ReclaimResult(v.LastReclaim),
		Reclaiming: v.Reclaiming, NextKeyRotation: timestamp(v.NextKeyRotation), LastRepair: v.LastRepair, Pending: v.Pending,
		Attached: v.Attached, PublishContext: maps.Clone(v.PublishContext),
	}
}

// ContainerStatus is a container in the API's terms.
func ContainerStatus(c isolator.ContainerInfo) *agentv1.ContainerStatus {
	return &agentv1.ContainerStatus{
		ContainerId: c.ID, Phase: agentv1.ContainerStatus_Phase(c.Phase), Mounts: Mounts(c.Mounts), Rootfs: c.Rootfs, LastError: c.LastError,
		Manager: c.Manager,
	}
}

// timestamp is t, unset for the zero time.
func timestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

// Plugin is a supervised plugin in the API's terms (its reclaim totals
// are the caller's to add).
func Plugin(p *supervisor.PluginStatus) *agentv1.Plugin {
	out := &agentv1.Plugin{
		Type: p.Type, Name: p.Name, ConfigFile: p.ConfigFile, Managed: p.Managed, State: agentv1.PluginState(p.State), ConfigError: p.ConfigError,
	}
	for _, in := range p.Instances {
		out.Instances = append(out.Instances, &agentv1.PluginInstance{
			Services: in.Services, Endpoint: in.Endpoint, State: agentv1.PluginState(in.State), Pid: int32(in.Pid), Restarts: in.Restarts,
			Adopted: in.Adopted, LastError: in.LastError, StateSince: timestamp(in.StateSince), NextStart: timestamp(in.NextStart),
			PluginName: in.PluginName, VendorVersion: in.VendorVersion, PluginCapabilities: in.PluginCapabilities,
			NodeCapabilities: in.NodeCapabilities, NodeId: in.NodeID, AddonsServices: in.AddonsServices,
			AddonsEndpoint: in.AddonsEndpoint, AddonsIdentity: in.AddonsIdentity,
			AccessibleTopology: in.AccessibleTopology, MaxVolumesPerNode: in.MaxVolumesPerNode,
			ControllerCapabilities: in.ControllerCapabilities,
		})
	}
	return out
}

// ClusterNode is a fleet node in the API's terms.
func ClusterNode(n cluster.NodeStatus) *agentv1.ClusterNode {
	out := &agentv1.ClusterNode{NodeId: n.ID, Alive: n.Alive, Registered: timestamp(n.Registered), AgentVersion: n.Info.AgentVersion,
		FenceCidrs: n.Info.FenceAddresses}
	for _, p := range n.Info.Plugins {
		out.Plugins = append(out.Plugins, p.Type)
		out.PluginInfo = append(out.PluginInfo, &agentv1.ClusterNodePlugin{Type: p.Type, Topology: p.Topology, AvailableCapacity: p.AvailableCapacity, MaxVolumes: p.MaxVolumes})
	}
	return out
}

// ClusterClaim is one claim in the API's terms.
func ClusterClaim(c cluster.ClaimStatus) *agentv1.ClusterClaim {
	out := &agentv1.ClusterClaim{PluginName: c.Plugin, VolumeId: c.Volume, Mode: string(c.Mode)}
	for _, h := range c.Holders {
		out.Holders = append(out.Holders, &agentv1.ClusterHolder{NodeId: h.Node, Since: timestamp(h.Since), Alive: h.Alive})
	}
	return out
}

// ClusterClaims is the fleet's claims and locks in the API's terms.
func ClusterClaims(st cluster.Status) *agentv1.ClusterClaimsResponse {
	out := &agentv1.ClusterClaimsResponse{}
	for _, c := range st.Claims {
		out.Claims = append(out.Claims, ClusterClaim(c))
	}
	for _, l := range st.Locks {
		out.Locks = append(out.Locks, &agentv1.ClusterLock{Kind: l.Kind, Id: l.ID, Holder: l.Holder, Waiters: l.Waiters})
	}
	return out
}
