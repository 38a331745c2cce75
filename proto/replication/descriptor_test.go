package replication_test

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/csiagent/csiagent/proto/replication"
)

func TestService(t *testing.T) {
	sd := replication.File_proto_replication_replication_proto.Services().ByName("Controller")
	if sd == nil {
		t.Fatal("no service Controller")
	}
	if got, want := sd.FullName(), protoreflect.FullName("replication.Controller"); got != want {
		t.Fatalf("service = %s, want %s", got, want)
	}
	tests := []struct {
		method     protoreflect.Name
		fullMethod string // generated constant
	}{
		{"EnableVolumeReplication", replication.Controller_EnableVolumeReplication_FullMethodName},
		{"DisableVolumeReplication", replication.Controller_DisableVolumeReplication_FullMethodName},
		{"PromoteVolume", replication.Controller_PromoteVolume_FullMethodName},
		{"DemoteVolume", replication.Controller_DemoteVolume_FullMethodName},
		{"ResyncVolume", replication.Controller_ResyncVolume_FullMethodName},
		{"GetVolumeReplicationInfo", replication.Controller_GetVolumeReplicationInfo_FullMethodName},
	}
	if sd.Methods().Len() != len(tests) {
		t.Errorf("%d methods, want %d", sd.Methods().Len(), len(tests))
	}
	for _, tc := range tests {
		t.Run(string(tc.method), func(t *testing.T) {
			if sd.Methods().ByName(tc.method) == nil {
				t.Fatal("method missing")
			}
			if want := "/replication.Controller/" + string(tc.method); tc.fullMethod != want {
				t.Errorf("full method name = %q, want %q", tc.fullMethod, want)
			}
		})
	}
}

func TestRequestFields(t *testing.T) {
	// Field numbers of the fields every request shares, as in the seed.
	tests := []struct {
		message                                   protoreflect.ProtoMessage
		secrets, replicationID, replicationSource protoreflect.FieldNumber
	}{
		{&replication.EnableVolumeReplicationRequest{}, 3, 4, 5},
		{&replication.DisableVolumeReplicationRequest{}, 3, 4, 5},
		{&replication.PromoteVolumeRequest{}, 4, 5, 6},
		{&replication.DemoteVolumeRequest{}, 4, 5, 6},
		{&replication.ResyncVolumeRequest{}, 4, 5, 6},
		{&replication.GetVolumeReplicationInfoRequest{}, 2, 3, 4},
	}
	for _, tc := range tests {
		md := tc.message.ProtoReflect().Descriptor()
		t.Run(string(md.Name()), func(t *testing.T) {
			field := func(name protoreflect.Name, want protoreflect.FieldNumber) *descriptorpb.FieldOptions {
				t.Helper()
				fd := md.Fields().ByName(name)
				if fd == nil {
					t.Fatalf("no field %s", name)
				}
				if fd.Number() != want {
					t.Errorf("%s = %d, want %d", name, fd.Number(), want)
				}
				opts, _ := fd.Options().(*descriptorpb.FieldOptions)
				return opts
			}
			if id := md.Fields().ByName("volume_id"); id == nil || id.Number() != 1 {
				t.Error("volume_id is not field 1")
			}
			if !proto.GetExtension(field("secrets", tc.secrets), csi.E_CsiSecret).(bool) {
				t.Error("secrets lacks (csi.v1.csi_secret) = true")
			}
			if !proto.GetExtension(field("replication_id", tc.replicationID), replication.E_AlphaField).(bool) {
				t.Error("replication_id lacks (alpha_field) = true")
			}
			field("replication_source", tc.replicationSource)
		})
	}
}
