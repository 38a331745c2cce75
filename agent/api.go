package agent

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// apiServer is the Agent gRPC service. It maps the agent's state to the
// API's messages and its errors to status codes.
type apiServer struct {
	agentv1.UnimplementedAgentServer
	a *Agent
}

var _ agentv1.AgentServer = (*apiServer)(nil)

func (s *apiServer) ListPlugins(ctx context.Context, _ *agentv1.ListPluginsRequest) (*agentv1.ListPluginsResponse, error) {
	select {
	case <-s.a.configured:
		return s.list(), nil
	case <-ctx.Done():
		return nil, status.Errorf(codes.Unavailable, "the agent has not read its config directory yet: %v", ctx.Err())
	}
}

func (s *apiServer) list() *agentv1.ListPluginsResponse {
	plugins, errs := s.a.snapshot()
	resp := &agentv1.ListPluginsResponse{Plugins: plugins}
	for _, fe := range errs {
		resp.ConfigErrors = append(resp.ConfigErrors, &agentv1.ConfigError{File: fe.File, Error: fe.Err.Error()})
	}
	return resp
}

func (s *apiServer) WatchPlugins(_ *agentv1.ListPluginsRequest, stream grpc.ServerStreamingServer[agentv1.ListPluginsResponse]) error {
	for {
		changed := s.a.set.Changed()
		if err := stream.Send(s.list()); err != nil {
			return err
		}
		select {
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-s.a.stopping:
			return status.Error(codes.Unavailable, "csi-agent is shutting down")
		case <-changed:
		}
	}
}

func (s *apiServer) GetPlugin(_ context.Context, req *agentv1.GetPluginRequest) (*agentv1.GetPluginResponse, error) {
	if req.GetType() == "" {
		return nil, status.Error(codes.InvalidArgument, "type is required")
	}
	plugins, _ := s.a.snapshot()
	for _, p := range plugins {
		if p.Type == req.GetType() {
			return &agentv1.GetPluginResponse{Plugin: p}, nil
		}
	}
	return nil, status.Errorf(codes.NotFound, "no plugin of type %q in %s", req.GetType(), s.a.cfg.ConfigDir)
}

// peerCredentials is a gRPC transport "security" that records each unix
// connection's peer credentials (SO_PEERCRED) for authorize to check.
type peerCredentials struct{}

// peerInfo is the AuthInfo peerCredentials attaches to a connection.
type peerInfo struct {
	cred *unix.Ucred
}

func (peerInfo) AuthType() string { return "peercred" }

func (peerCredentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	cred, err := peerCred(conn)
	if err != nil {
		return nil, nil, err
	}
	return conn, peerInfo{cred: cred}, nil
}

// peerCred reads a unix socket connection's peer credentials.
func peerCred(conn net.Conn) (*unix.Ucred, error) {
	uc, ok := conn.(*net.UnixConn)
	if !ok {
		return nil, fmt.Errorf("API connection is not a unix socket: %T", conn)
	}
	raw, err := uc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("reading peer credentials: %w", err)
	}
	var cred *unix.Ucred
	var credErr error
	if err := raw.Control(func(fd uintptr) {
		cred, credErr = unix.GetsockoptUcred(int(fd), unix.SOL_SOCKET, unix.SO_PEERCRED)
	}); err != nil {
		return nil, fmt.Errorf("reading peer credentials: %w", err)
	}
	if credErr != nil {
		return nil, fmt.Errorf("reading peer credentials: %w", credErr)
	}
	return cred, nil
}

func (peerCredentials) ClientHandshake(_ context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return conn, peerInfo{}, nil
}

func (peerCredentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}

func (peerCredentials) Clone() credentials.TransportCredentials { return peerCredentials{} }

// OverrideServerName is required by the interface and deprecated in it.
func (peerCredentials) OverrideServerName(string) error { return nil }

// authorize lets root and members of the API group call the API.
func (a *Agent) authorize(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := a.allowed(ctx); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

// authorizeStream is authorize for streaming calls.
func (a *Agent) authorizeStream(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := a.allowed(ss.Context()); err != nil {
		return err
	}
	return handler(srv, ss)
}

func (a *Agent) allowed(ctx context.Context) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return status.Error(codes.Unauthenticated, "no peer credentials")
	}
	pi, ok := p.AuthInfo.(peerInfo)
	if !ok || pi.cred == nil {
		return status.Error(codes.Unauthenticated, "no peer credentials")
	}
	if !a.permitted(pi.cred) {
		return status.Errorf(codes.PermissionDenied, "uid %d may not use the csi-agent API: only root and members of the --api-group may", pi.cred.Uid)
	}
	return nil
}

// permitted reports whether a peer may use the agent's sockets: root, or
// a member of --api-group.
func (a *Agent) permitted(c *unix.Ucred) bool {
	if c.Uid == 0 {
		return true
	}
	g := a.cfg.APIGroup
	return g >= 0 && (int(c.Gid) == g || inGroup(int(c.Pid), g))
}

// inGroup reports whether process pid has gid among its supplementary
// groups.
func inGroup(pid, gid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Groups:"); ok {
			for _, f := range strings.Fields(rest) {
				if f == strconv.Itoa(gid) {
					return true
				}
			}
		}
	}
	return false
}
