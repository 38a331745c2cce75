package agent

import (
	"context"
	"slices"

	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/apiserver"
	"github.com/csiagent/csiagent/controllerops"
	"github.com/csiagent/csiagent/pluginconfig"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// controllerPlugins is the agent's plugin set as the Controller API
// (package controllerops) sees it.
type controllerPlugins struct{ a *Agent }

var _ controllerops.Plugins = controllerPlugins{}

func (p controllerPlugins) ControllerConn(ctx context.Context, plugin, service string) (*grpc.ClientConn, error) {
	return p.a.controllerConn(ctx, plugin, service)
}

func (p controllerPlugins) Offers(plugin, service string) bool {
	return p.a.set.Offers(plugin, service)
}

// LogDir is where a managed plugin's logs are ("" for unmanaged plugins,
// whose logs the agent does not keep).
func (p controllerPlugins) LogDir(plugin string) string { return p.a.set.LogDir(plugin) }

func (p controllerPlugins) NodeConn(ctx context.Context, plugin, service string) (*grpc.ClientConn, error) {
	_, conn, err := p.a.ready(ctx, plugin, pluginconfig.NodeService)
	if err != nil {
		return nil, apiserver.Status(err)
	}
	return p.a.set.ConnFor(plugin, pluginconfig.NodeService, service, conn), nil
}

func (p controllerPlugins) Published(plugin, volumeID string) (controllerops.PublishedVolume, bool) {
	for _, v := range p.a.iso.ListVolumes() {
		if v.Plugin == plugin && v.ID == volumeID && v.State == statev1.VolumeCheckpoint_PUBLISHED {
			return controllerops.PublishedVolume{TargetPath: v.TargetPath, StagingPath: v.StagingPath, Block: v.Block, Capability: v.Capability}, true
		}
	}
	return controllerops.PublishedVolume{}, false
}

func (p controllerPlugins) Publishing(volumeID string) []string {
	var out []string
	for _, v := range p.a.iso.ListVolumes() {
		if v.ID == volumeID && v.State == statev1.VolumeCheckpoint_PUBLISHED && !slices.Contains(out, v.Plugin) {
			out = append(out, v.Plugin)
		}
	}
	return out
}

func (p controllerPlugins) NodeCapabilities(plugin string) []string {
	return p.a.set.NodeCapabilities(plugin)
}

// NamedVolume is the plugin and volume id of a named volume (available
// once the engine endpoint has started, before the API).
func (p controllerPlugins) NamedVolume(name string) (string, string, error) {
	st, err := p.a.named.Status(name)
	if err != nil {
		return "", "", err
	}
	return st.Plugin, st.VolumeID, nil
}

func (p controllerPlugins) ContainerVolumes(containerID string) ([]controllerops.VolumeRef, bool) {
	for _, c := range p.a.iso.ListContainers() {
		if c.ID != containerID {
			continue
		}
		var out []controllerops.VolumeRef
		for _, m := range c.Mounts {
			v := controllerops.VolumeRef{Plugin: m.GetPluginName(), ID: m.GetVolumeId()}
			if !slices.Contains(out, v) {
				out = append(out, v)
			}
		}
		return out, true
	}
	return nil, false
}

// controllerConn waits for the plugin's controller service to be ready
// and returns the connection that serves service there; errors are status
// errors.
func (a *Agent) controllerConn(ctx context.Context, typ, service string) (*grpc.ClientConn, error) {
	_, conn, err := a.ready(ctx, typ, pluginconfig.ControllerService)
	if err != nil {
		return nil, apiserver.Status(err)
	}
	return a.set.ConnFor(typ, pluginconfig.ControllerService, service, conn), nil
}
