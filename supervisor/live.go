package supervisor

import (
	"context"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/pluginconfig"
)

// LiveNode is a plugin's node service (the calls that stage and publish
// volumes) that takes the plugin's current connection for each call, so a
// retry after a plugin restart reaches the new process. Its errors are
// status errors.
type LiveNode struct {
	set *Set
	typ string
}

// Node is the live node service of plugin typ.
func (s *Set) Node(typ string) LiveNode { return LiveNode{set: s, typ: typ} }

// Conn waits for the plugin's node instance to be ready and returns the
// connection serving service (a discovery name) on it; an error is
// Unavailable (a status error: retry policies read its code).
func (n LiveNode) Conn(ctx context.Context, service string) (*grpc.ClientConn, error) {
	return liveConn(ctx, n.set, n.typ, pluginconfig.NodeService, service)
}

// LiveController is a plugin's controller service for the calls that
// attach and detach volumes, on the plugin's current connection like
// LiveNode.
type LiveController struct {
	set *Set
	typ string
}

// Controller is the live controller service of plugin typ.
func (s *Set) Controller(typ string) LiveController { return LiveController{set: s, typ: typ} }

func liveConn(ctx context.Context, s *Set, typ string, svc pluginconfig.Service, service string) (*grpc.ClientConn, error) {
	_, conn, err := s.Ready(ctx, typ, svc)
	if err != nil {
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	return s.ConnFor(typ, svc, service, conn), nil
}

// liveCall makes one RPC of a CSI service (svc's instance, client made by
// mk) on the current connection.
func liveCall[C, Req, Resp any](ctx context.Context, s *Set, typ string, svc pluginconfig.Service, service string, mk func(grpc.ClientConnInterface) C,
	rpc func(C, context.Context, Req, ...grpc.CallOption) (Resp, error), in Req, opts []grpc.CallOption) (Resp, error) {
	conn, err := liveConn(ctx, s, typ, svc, service)
	if err != nil {
		var none Resp
		return none, err
	}
	resp, err := rpc(mk(conn), ctx, in, opts...)
	return resp, connGone(ctx, err)
}

// nodeCall makes one node RPC on the current connection.
func nodeCall[Req, Resp any](ctx context.Context, n LiveNode, rpc func(csi.NodeClient, context.Context, Req, ...grpc.CallOption) (Resp, error), in Req, opts []grpc.CallOption) (Resp, error) {
	return liveCall(ctx, n.set, n.typ, pluginconfig.NodeService, "csi.v1.Node", csi.NewNodeClient, rpc, in, opts)
}

// ControllerPublishVolume is the CSI call on the current connection.
func (c LiveController) ControllerPublishVolume(ctx context.Context, in *csi.ControllerPublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerPublishVolumeResponse, error) {
	return liveCall(ctx, c.set, c.typ, pluginconfig.ControllerService, "csi.v1.Controller", csi.NewControllerClient, csi.ControllerClient.ControllerPublishVolume, in, opts)
}

// ControllerUnpublishVolume is the CSI call on the current connection.
func (c LiveController) ControllerUnpublishVolume(ctx context.Context, in *csi.ControllerUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.ControllerUnpublishVolumeResponse, error) {
	return liveCall(ctx, c.set, c.typ, pluginconfig.ControllerService, "csi.v1.Controller", csi.NewControllerClient, csi.ControllerClient.ControllerUnpublishVolume, in, opts)
}

// connGone turns the error of a call cut off by its connection closing
// (the plugin died and its instance closed the connection) into
// Unavailable, which callers retry on the new connection; Canceled stays
// Canceled when it is the caller who gave up.
func connGone(ctx context.Context, err error) error {
	if status.Code(err) == codes.Canceled && ctx.Err() == nil {
		return status.Error(codes.Unavailable, status.Convert(err).Message())
	}
	return err
}

// NodeStageVolume is the CSI call on the current connection.
func (n LiveNode) NodeStageVolume(ctx context.Context, in *csi.NodeStageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeStageVolumeResponse, error) {
	return nodeCall(ctx, n, csi.NodeClient.NodeStageVolume, in, opts)
}

// NodeUnstageVolume is the CSI call on the current connection.
func (n LiveNode) NodeUnstageVolume(ctx context.Context, in *csi.NodeUnstageVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnstageVolumeResponse, error) {
	return nodeCall(ctx, n, csi.NodeClient.NodeUnstageVolume, in, opts)
}

// NodePublishVolume is the CSI call on the current connection.
func (n LiveNode) NodePublishVolume(ctx context.Context, in *csi.NodePublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodePublishVolumeResponse, error) {
	return nodeCall(ctx, n, csi.NodeClient.NodePublishVolume, in, opts)
}

// NodeUnpublishVolume is the CSI call on the current connection.
func (n LiveNode) NodeUnpublishVolume(ctx context.Context, in *csi.NodeUnpublishVolumeRequest, opts ...grpc.CallOption) (*csi.NodeUnpublishVolumeResponse, error) {
	return nodeCall(ctx, n, csi.NodeClient.NodeUnpublishVolume, in, opts)
}
