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
		{"GetReplicationDestinationInfo", replication.Controller_GetReplicationDestinationInfo_FullMethodName},
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
	// Field numbers of the fields every request shares, as in the seed;
	// volume_id (1) is reserved, as upstream has it since 80d74f9.
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
			if md.Fields().ByName("volume_id") != nil || md.Fields().ByNumber(1) != nil ||
				!md.ReservedRanges().Has(1) || !md.ReservedNames().Has("volume_id") {
				t.Error("field 1 (volume_id) is not reserved by number and name")
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

// TestUpstreamAdditions checks what upstream added after the seed: the
// replication's health and GetReplicationDestinationInfo's messages.
func TestUpstreamAdditions(t *testing.T) {
	info := (&replication.GetVolumeReplicationInfoResponse{}).ProtoReflect().Descriptor()
	for name, num := range map[protoreflect.Name]protoreflect.FieldNumber{"status": 4, "status_message": 5} {
		if fd := info.Fields().ByName(name); fd == nil || fd.Number() != num {
			t.Errorf("GetVolumeReplicationInfoResponse.%s is not field %d", name, num)
		}
	}
	for name, num := range map[string]int32{"UNKNOWN": 0, "HEALTHY": 1, "DEGRADED": 2, "ERROR": 3} {
		if got := replication.GetVolumeReplicationInfoResponse_Status_value[name]; got != num {
			t.Errorf("Status %s = %d, want %d", name, got, num)
		}
	}
	if got := info.Enums().ByName("Status").FullName(); got != "replication.GetVolumeReplicationInfoResponse.Status" {
		t.Errorf("status enum is %s", got)
	}
	req := (&replication.GetReplicationDestinationInfoRequest{}).ProtoReflect().Descriptor()
	if fd := req.Fields().ByName("secrets"); fd == nil || fd.Number() != 1 ||
		!proto.GetExtension(fd.Options(), csi.E_CsiSecret).(bool) {
		t.Error("GetReplicationDestinationInfoRequest.secrets is not secret field 1")
	}
	if fd := req.Fields().ByName("replication_source"); fd == nil || fd.Number() != 2 {
		t.Error("GetReplicationDestinationInfoRequest.replication_source is not field 2")
	}
	dest := (&replication.ReplicationDestination{}).ProtoReflect().Descriptor()
	for name, num := range map[protoreflect.Name]protoreflect.FieldNumber{"volume": 1, "volumegroup": 2} {
		if fd := dest.Fields().ByName(name); fd == nil || fd.Number() != num || fd.ContainingOneof().Name() != "type" {
			t.Errorf("ReplicationDestination.%s is not field %d of oneof type", name, num)
		}
	}
	group := (&replication.ReplicationDestination_VolumeGroupDestination{}).ProtoReflect().Descriptor()
	if fd := group.Fields().ByName("volume_ids"); fd == nil || fd.Number() != 2 || !fd.IsMap() {
		t.Error("VolumeGroupDestination.volume_ids is not map field 2")
	}
}
