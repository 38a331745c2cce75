package reclaimspace_test

import (
	"context"
	"fmt"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/csiagent/csiagent/proto/reclaimspace"
)

// rpcTimeout bounds every call in these tests; nothing here should take more
// than a few milliseconds.
const rpcTimeout = 10 * time.Second

// nodeServer answers NodeReclaimSpace only when it receives exactly want, so
// a field lost or renumbered on the wire fails the call.
type nodeServer struct {
	reclaimspace.UnimplementedReclaimSpaceNodeServer
	want *reclaimspace.NodeReclaimSpaceRequest
	resp *reclaimspace.NodeReclaimSpaceResponse
}

func (s *nodeServer) NodeReclaimSpace(_ context.Context, req *reclaimspace.NodeReclaimSpaceRequest) (*reclaimspace.NodeReclaimSpaceResponse, error) {
	if !proto.Equal(req, s.want) {
		return nil, status.Errorf(codes.InvalidArgument, "server got %v, want %v", req, s.want)
	}
	return s.resp, nil
}

// serve starts a gRPC server with srv on a unix socket in a fresh temp dir
// and returns a client connection to it. Both are closed on cleanup.
func serve(t *testing.T, srv reclaimspace.ReclaimSpaceNodeServer) *grpc.ClientConn {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "rs.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatalf("listen on %s: %v", sock, err)
	}
	s := grpc.NewServer()
	reclaimspace.RegisterReclaimSpaceNodeServer(s, srv)
	served := make(chan error, 1)
	go func() { served <- s.Serve(lis) }()
	t.Cleanup(func() {
		s.Stop()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})

	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("grpc.NewClient: %v", err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

func TestNodeReclaimSpaceWire(t *testing.T) {
	req := &reclaimspace.NodeReclaimSpaceRequest{
		VolumeId:          "vol-1",
		VolumePath:        "/var/lib/csiagent/mounts/vol-1/target",
		StagingTargetPath: "/var/lib/csiagent/mounts/vol-1/staging",
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{
				Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4"},
			},
			AccessMode: &csi.VolumeCapability_AccessMode{
				Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
			},
		},
		Secrets: map[string]string{"user": "admin", "key": "s3cr3t"},
	}
	want := &reclaimspace.NodeReclaimSpaceResponse{
		PreUsage:  &reclaimspace.StorageConsumption{UsageBytes: 3 << 30},
		PostUsage: &reclaimspace.StorageConsumption{UsageBytes: 1 << 30},
	}
	conn := serve(t, &nodeServer{want: req, resp: want})

	tests := []struct {
		name     string
		call     func(ctx context.Context) (*reclaimspace.NodeReclaimSpaceResponse, error)
		wantCode codes.Code
	}{
		{
			// The literal string proves the wire name, independent of the
			// generated constants.
			name: "invoke literal method name",
			call: func(ctx context.Context) (*reclaimspace.NodeReclaimSpaceResponse, error) {
				resp := new(reclaimspace.NodeReclaimSpaceResponse)
				err := conn.Invoke(ctx, "/reclaimspace.ReclaimSpaceNode/NodeReclaimSpace", req, resp)
				return resp, err
			},
		},
		{
			name: "generated client",
			call: func(ctx context.Context) (*reclaimspace.NodeReclaimSpaceResponse, error) {
				return reclaimspace.NewReclaimSpaceNodeClient(conn).NodeReclaimSpace(ctx, req)
			},
		},
		{
			name: "other service name is unimplemented",
			call: func(ctx context.Context) (*reclaimspace.NodeReclaimSpaceResponse, error) {
				resp := new(reclaimspace.NodeReclaimSpaceResponse)
				err := conn.Invoke(ctx, "/reclaimspace.ReclaimSpaceController/NodeReclaimSpace", req, resp)
				return resp, err
			},
			wantCode: codes.Unimplemented,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), rpcTimeout)
			defer cancel()
			got, err := tc.call(ctx)
			if code := status.Code(err); code != tc.wantCode {
				t.Fatalf("code = %v (err %v), want %v", code, err, tc.wantCode)
			}
			if tc.wantCode != codes.OK {
				return
			}
			if !proto.Equal(got, want) {
				t.Errorf("response = %v, want %v", got, want)
			}
		})
	}
}

func TestDescriptors(t *testing.T) {
	t.Run("services", func(t *testing.T) {
		for svc, methods := range map[protoreflect.FullName][]protoreflect.Name{
			"reclaimspace.ReclaimSpaceNode":       {"NodeReclaimSpace"},
			"reclaimspace.ReclaimSpaceController": {"ControllerReclaimSpace"},
		} {
			checkService(t, svc, methods)
		}
		for got, want := range map[string]string{
			reclaimspace.ReclaimSpaceNode_NodeReclaimSpace_FullMethodName:             "/reclaimspace.ReclaimSpaceNode/NodeReclaimSpace",
			reclaimspace.ReclaimSpaceController_ControllerReclaimSpace_FullMethodName: "/reclaimspace.ReclaimSpaceController/ControllerReclaimSpace",
		} {
			if got != want {
				t.Errorf("full method name = %q, want %q", got, want)
			}
		}
	})

	fields := []struct {
		message protoreflect.FullName
		field   protoreflect.Name
		number  protoreflect.FieldNumber
		secret  bool
	}{
		{"reclaimspace.NodeReclaimSpaceRequest", "volume_id", 1, false},
		{"reclaimspace.NodeReclaimSpaceRequest", "volume_path", 2, false},
		{"reclaimspace.NodeReclaimSpaceRequest", "staging_target_path", 3, false},
		{"reclaimspace.NodeReclaimSpaceRequest", "volume_capability", 4, false},
		{"reclaimspace.NodeReclaimSpaceRequest", "secrets", 5, true},
		{"reclaimspace.NodeReclaimSpaceResponse", "pre_usage", 1, false},
		{"reclaimspace.NodeReclaimSpaceResponse", "post_usage", 2, false},
		{"reclaimspace.ControllerReclaimSpaceRequest", "volume_id", 1, false},
		{"reclaimspace.ControllerReclaimSpaceRequest", "parameters", 2, false},
		{"reclaimspace.ControllerReclaimSpaceRequest", "secrets", 3, true},
		{"reclaimspace.ControllerReclaimSpaceResponse", "pre_usage", 1, false},
		{"reclaimspace.ControllerReclaimSpaceResponse", "post_usage", 2, false},
		{"reclaimspace.StorageConsumption", "usage_bytes", 1, false},
	}
	for _, tc := range fields {
		t.Run(fmt.Sprintf("%s.%s", tc.message, tc.field), func(t *testing.T) {
			fd := findField(t, tc.message, tc.field)
			if fd.Number() != tc.number {
				t.Errorf("number = %d, want %d", fd.Number(), tc.number)
			}
			if got := isCSISecret(fd); got != tc.secret {
				t.Errorf("csi.v1.csi_secret = %v, want %v", got, tc.secret)
			}
		})
	}
}

func checkService(t *testing.T, name protoreflect.FullName, methods []protoreflect.Name) {
	t.Helper()
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(name)
	if err != nil {
		t.Fatalf("service %s: %v", name, err)
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		t.Fatalf("%s is a %T, not a service", name, d)
	}
	if sd.Methods().Len() != len(methods) {
		t.Errorf("%s has %d methods, want %d", name, sd.Methods().Len(), len(methods))
	}
	for _, m := range methods {
		if sd.Methods().ByName(m) == nil {
			t.Errorf("%s has no method %s", name, m)
		}
	}
}

func findField(t *testing.T, msg protoreflect.FullName, field protoreflect.Name) protoreflect.FieldDescriptor {
	t.Helper()
	mt, err := protoregistry.GlobalTypes.FindMessageByName(msg)
	if err != nil {
		t.Fatalf("message %s: %v", msg, err)
	}
	fd := mt.Descriptor().Fields().ByName(field)
	if fd == nil {
		t.Fatalf("message %s has no field %s", msg, field)
	}
	return fd
}

func isCSISecret(fd protoreflect.FieldDescriptor) bool {
	opts, ok := fd.Options().(*descriptorpb.FieldOptions)
	if !ok || opts == nil {
		return false
	}
	v, _ := proto.GetExtension(opts, csi.E_CsiSecret).(bool)
	return v
}
