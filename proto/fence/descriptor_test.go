package fence_test

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/csiagent/csiagent/proto/fence"
)

// TestWire checks the names and numbers upstream's fence.proto has, and
// that every secrets field is marked secret.
func TestWire(t *testing.T) {
	sd := fence.File_proto_fence_fence_proto.Services().ByName("FenceController")
	if sd == nil || sd.FullName() != "fence.FenceController" {
		t.Fatal("no service fence.FenceController")
	}
	for _, m := range []protoreflect.Name{"FenceClusterNetwork", "UnfenceClusterNetwork", "ListClusterFence", "GetFenceClients"} {
		if sd.Methods().ByName(m) == nil {
			t.Errorf("no method %s", m)
		}
	}
	for _, tc := range []struct {
		msg    proto.Message
		fields map[protoreflect.Name]protoreflect.FieldNumber
	}{
		{&fence.FenceClusterNetworkRequest{}, map[protoreflect.Name]protoreflect.FieldNumber{"parameters": 1, "secrets": 2, "cidrs": 3}},
		{&fence.UnfenceClusterNetworkRequest{}, map[protoreflect.Name]protoreflect.FieldNumber{"parameters": 1, "secrets": 2, "cidrs": 3}},
		{&fence.ListClusterFenceRequest{}, map[protoreflect.Name]protoreflect.FieldNumber{"parameters": 1, "secrets": 2}},
		{&fence.ListClusterFenceResponse{}, map[protoreflect.Name]protoreflect.FieldNumber{"cidrs": 1}},
		{&fence.CIDR{}, map[protoreflect.Name]protoreflect.FieldNumber{"cidr": 1}},
		{&fence.GetFenceClientsRequest{}, map[protoreflect.Name]protoreflect.FieldNumber{"parameters": 1, "secrets": 2}},
		{&fence.GetFenceClientsResponse{}, map[protoreflect.Name]protoreflect.FieldNumber{"clients": 1}},
		{&fence.ClientDetails{}, map[protoreflect.Name]protoreflect.FieldNumber{"id": 1, "addresses": 2}},
	} {
		md := tc.msg.ProtoReflect().Descriptor()
		if md.Fields().Len() != len(tc.fields) {
			t.Errorf("%s has %d fields, want %d", md.FullName(), md.Fields().Len(), len(tc.fields))
		}
		for name, num := range tc.fields {
			fd := md.Fields().ByName(name)
			if fd == nil || fd.Number() != num {
				t.Errorf("%s.%s is not field %d", md.FullName(), name, num)
				continue
			}
			if secret := proto.GetExtension(fd.Options(), csi.E_CsiSecret).(bool); secret != (name == "secrets") {
				t.Errorf("%s.%s: csi_secret = %v", md.FullName(), name, secret)
			}
		}
	}
}
