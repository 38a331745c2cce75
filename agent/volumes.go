package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/isolator"
	"github.com/csiagent/csiagent/pluginconfig"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
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
	return isolator.Node{Client: liveNode{a: p.a, typ: typ}, StageUnstage: stage}, nil
}

// ready waits until the plugin's instance serving svc is ready (see
// supervisor.Set.Ready); its errors also wrap the isolator's classes:
// ErrUnknownPlugin, ErrPrecondition (no instance serves svc) or
// ErrUnavailable (not ready when ctx ended).
func (a *Agent) ready(ctx context.Context, typ string, svc pluginconfig.Service) (*agentv1.PluginInstance, *grpc.ClientConn, error) {
	st, conn, err := a.set.Ready(ctx, typ, svc)
	for _, c := range []struct{ from, to error }{
		{supervisor.ErrUnknownPlugin, isolator.ErrUnknownPlugin},
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

// liveNode is a node client that uses the plugin's current connection for
// each call, so a retry after a plugin restart reaches the new process.
type liveNode struct {
	a   *Agent
	typ string
}

// conn is the plugin's connection that serves service on its node
// instance, once it is ready.
func (n liveNode) conn(ctx context.Context, service string) (*grpc.ClientConn, error) {
	_, conn, err := n.a.set.Ready(ctx, n.typ, pluginconfig.NodeService)
	if err != nil {
		// A status error: the isolator's retry policy reads its code.
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	return n.a.set.ConnFor(n.typ, pluginconfig.NodeService, service, conn), nil
}

func (n liveNode) client(ctx context.Context) (csi.NodeClient, error) {
	conn, err := n.conn(ctx, "csi.v1.Node")
	if err != nil {
		return nil, err
	}
	return csi.NewNodeClient(conn), nil
}

func (n liveNode) NodeStageVolume(ctx context.Context, in *csi.NodeStageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error) {
	c, err := n.client(ctx)
	if err != nil {
		return nil, err
	}
	resp, err := c.NodeStageVolume(ctx, in, opts...)
	return resp, connGone(ctx, err)
}

func (n liveNode) NodeUnstageVolume(ctx context.Context, in *csi.NodeUnstageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error) {
	c, err := n.client(ctx)
	if err != nil {
		return nil, err
	}
	resp, err := c.NodeUnstageVolume(ctx, in, opts...)
	return resp, connGone(ctx, err)
}

func (n liveNode) NodePublishVolume(ctx context.Context, in *csi.NodePublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodePublishVolumeResponse, error) {
	c, err := n.client(ctx)
	if err != nil {
		return nil, err
	}
	resp, err := c.NodePublishVolume(ctx, in, opts...)
	return resp, connGone(ctx, err)
}

func (n liveNode) NodeUnpublishVolume(ctx context.Context, in *csi.NodeUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnpublishVolumeResponse, error) {
	c, err := n.client(ctx)
	if err != nil {
		return nil, err
	}
	resp, err := c.NodeUnpublishVolume(ctx, in, opts...)
	return resp, connGone(ctx, err)
}

// connGone turns the error of a call cut off by its connection closing
// (the plugin died and its instance closed the connection) into
// Unavailable, which the isolator retries on the new connection; Canceled
// stays Canceled when it is the caller who gave up.
func connGone(ctx context.Context, err error) error {
	if status.Code(err) == codes.Canceled && ctx.Err() == nil {
		return status.Error(codes.Unavailable, status.Convert(err).Message())
	}
	return err
}
