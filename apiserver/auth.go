package apiserver

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
)

// PeerCredentials is a gRPC transport "security" that records each unix
// connection's peer credentials (SO_PEERCRED) for Access to check.
type PeerCredentials struct{}

var _ credentials.TransportCredentials = PeerCredentials{}

// peerInfo is the AuthInfo PeerCredentials attaches to a connection.
type peerInfo struct {
	cred *unix.Ucred
}

func (peerInfo) AuthType() string { return "peercred" }

// ServerHandshake reads the connecting process's credentials.
func (PeerCredentials) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	cred, err := PeerCred(conn)
	if err != nil {
		return nil, nil, err
	}
	return conn, peerInfo{cred: cred}, nil
}

// ClientHandshake does nothing: the credentials are the server's to read.
func (PeerCredentials) ClientHandshake(_ context.Context, _ string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return conn, peerInfo{}, nil
}

// Info names the protocol.
func (PeerCredentials) Info() credentials.ProtocolInfo {
	return credentials.ProtocolInfo{SecurityProtocol: "peercred"}
}

// Clone returns the (stateless) credentials.
func (PeerCredentials) Clone() credentials.TransportCredentials { return PeerCredentials{} }

// OverrideServerName is required by the interface and deprecated in it.
func (PeerCredentials) OverrideServerName(string) error { return nil }

// PeerCred reads a unix socket connection's peer credentials.
func PeerCred(conn net.Conn) (*unix.Ucred, error) {
	if _, ok := conn.LocalAddr().(*net.UnixAddr); !ok {
		return nil, fmt.Errorf("API connection is not a unix socket: %T", conn)
	}
	sc, ok := conn.(syscall.Conn) // a *net.UnixConn, or a wrapper of one
	if !ok {
		return nil, fmt.Errorf("API connection has no file descriptor: %T", conn)
	}
	raw, err := sc.SyscallConn()
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

// Access says who may use the agent's sockets: root, and members of Group
// when it is >= 0 (--api-group).
type Access struct{ Group int }

// Permitted reports whether the peer c may use the agent's sockets.
func (a Access) Permitted(c *unix.Ucred) bool {
	if c.Uid == 0 {
		return true
	}
	return a.Group >= 0 && (int(c.Gid) == a.Group || inGroup(int(c.Pid), a.Group))
}

// Unary refuses unary calls of peers not Permitted.
func (a Access) Unary(ctx context.Context, req any, _ *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	if err := a.allowed(ctx); err != nil {
		return nil, err
	}
	return handler(ctx, req)
}

// Stream is Unary for streaming calls.
func (a Access) Stream(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	if err := a.allowed(ss.Context()); err != nil {
		return err
	}
	return handler(srv, ss)
}

func (a Access) allowed(ctx context.Context) error {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return status.Error(codes.Unauthenticated, "no peer credentials")
	}
	pi, ok := p.AuthInfo.(peerInfo)
	if !ok || pi.cred == nil {
		return status.Error(codes.Unauthenticated, "no peer credentials")
	}
	if !a.Permitted(pi.cred) {
		return status.Errorf(codes.PermissionDenied, "uid %d may not use the csi-agent API: only root and members of the --api-group may", pi.cred.Uid)
	}
	return nil
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

// peerCredKey holds a connection's peer credentials in its context.
type peerCredKey struct{}

// ConnContext is an http.Server's ConnContext for a unix socket: it
// records the peer's credentials for HTTP to check.
func ConnContext(ctx context.Context, c net.Conn) context.Context {
	cred, err := PeerCred(c)
	if err != nil {
		return ctx
	}
	return context.WithValue(ctx, peerCredKey{}, cred)
}

// HTTPPeer is the peer credentials of r's connection (ConnContext), nil
// if unknown.
func HTTPPeer(r *http.Request) *unix.Ucred {
	cred, _ := r.Context().Value(peerCredKey{}).(*unix.Ucred)
	return cred
}

// HTTP serves h to Permitted peers (the server's ConnContext must be
// ConnContext); others get 403 with a JSON error, in the form of Docker's
// plugin protocol.
func (a Access) HTTP(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if cred := HTTPPeer(r); cred == nil || !a.Permitted(cred) {
			who := "root and members of the agent's --api-group"
			if a.Group < 0 {
				who = "root"
			}
			http.Error(w, `{"Err": "only `+who+` may use this socket"}`, http.StatusForbidden)
			return
		}
		h.ServeHTTP(w, r)
	})
}
