package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pluginconfig"
	"github.com/csiagent/csiagent/supervisor"
)

// plugins gives the isolator the agent's plugins.
type plugins struct{ a *Agent }

var _ isolator.Plugins = plugins{}

func (p plugins) Lookup(typ string) (isolator.Plugin, error) {
	r := p.a.set.Get(typ)
	if r == nil {
		return isolator.Plugin{}, fmt.Errorf("%w: Unknown CSI plugin '%s' (no config in %s defines it)", isolator.ErrUnknownPlugin, typ, p.a.cfg.ConfigDir)
	}
	info := r.Config().Info
	return isolator.Plugin{Type: info.Type, Name: info.Name, TargetPathRoot: info.TargetPathRoot, TargetPathExists: info.TargetPathExists}, nil
}

func (p plugins) Node(ctx context.Context, typ string) (isolator.Node, error) {
	st, _, err := p.a.ready(ctx, typ, pluginconfig.NodeService)
	if err != nil {
		return isolator.Node{}, err
	}
	stage := slices.Contains(st.NodeCapabilities, csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME.String())
	n := isolator.Node{Client: p.a.set.Node(typ), StageUnstage: stage, MaxVolumes: st.MaxVolumesPerNode, NodeID: st.NodeID, Topology: st.AccessibleTopology}
	r := p.a.set.Get(typ)
	if r == nil || !r.Config().Info.Serves(pluginconfig.ControllerService) {
		return n, nil
	}
	// Whether volumes are attached is the controller's to say: what its
	// discovery found, once it has run (a controller down since then
	// holds up only the attach and detach calls, on their deadline, not
	// the node calls of a plugin that does not attach); before, its
	// readiness is waited for (the same instance, for most plugins).
	cst, _, _ := r.Instance(pluginconfig.ControllerService)
	if cst == nil || cst.PluginName == "" {
		var err error
		if cst, _, err = p.a.ready(ctx, typ, pluginconfig.ControllerService); err != nil {
			return isolator.Node{}, fmt.Errorf("the controller, which may attach its volumes: %w", err)
		}
	}
	if slices.Contains(cst.ControllerCapabilities, csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME.String()) {
		n.Controller = p.a.set.Controller(typ)
		n.PublishReadonly = slices.Contains(cst.ControllerCapabilities, csi.ControllerServiceCapability_RPC_PUBLISH_READONLY.String())
	}
	return n, nil
}

// ready waits until the plugin's instance serving svc is ready (see
// supervisor.Set.Ready); its errors also wrap the isolator's classes:
// ErrUnknownPlugin, ErrPrecondition (no instance serves svc) or
// ErrUnavailable (not ready when ctx ended).
func (a *Agent) ready(ctx context.Context, typ string, svc pluginconfig.Service) (*supervisor.InstanceStatus, *grpc.ClientConn, error) {
	st, conn, err := a.set.Ready(ctx, typ, svc)
	for _, c := range []struct{ from, to error }{
		{supervisor.ErrNotConfigured, isolator.ErrUnknownPlugin},
		{supervisor.ErrNoService, isolator.ErrPrecondition},
		{supervisor.ErrNotReady, isolator.ErrUnavailable},
	} {
		if errors.Is(err, c.from) {
			err = classified{class: c.to, err: err}
		}
	}
	return st, conn, err
}

// classified is an error that also is a class (errors.Is) without saying
// so in its message.
type classified struct{ class, err error }

func (c classified) Error() string   { return c.err.Error() }
func (c classified) Unwrap() []error { return []error{c.class, c.err} }
