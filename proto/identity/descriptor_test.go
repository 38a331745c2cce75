package identity_test

import (
	"testing"

	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/csiagent/csiagent/proto/identity"
)

// TestWire checks the names and numbers upstream's identity.proto has.
func TestWire(t *testing.T) {
	sd := identity.File_proto_identity_identity_proto.Services().ByName("Identity")
	if sd == nil || sd.FullName() != "identity.Identity" {
		t.Fatal("no service identity.Identity")
	}
	for _, m := range []protoreflect.Name{"GetIdentity", "GetCapabilities", "Probe"} {
		if sd.Methods().ByName(m) == nil {
			t.Errorf("no method %s", m)
		}
	}
	capd := (&identity.Capability{}).ProtoReflect().Descriptor()
	for name, num := range map[protoreflect.Name]protoreflect.FieldNumber{
		"service": 1, "reclaim_space": 2, "network_fence": 3, "volume_replication": 4, "volume_group": 5, "encryption_key_rotation": 6,
	} {
		if fd := capd.Fields().ByName(name); fd == nil || fd.Number() != num || fd.ContainingOneof().Name() != "type" {
			t.Errorf("Capability.%s is not field %d of oneof type", name, num)
		}
	}
	enums := map[string]map[string]int32{
		"Service":               identity.Capability_Service_Type_value,
		"ReclaimSpace":          identity.Capability_ReclaimSpace_Type_value,
		"NetworkFence":          identity.Capability_NetworkFence_Type_value,
		"VolumeReplication":     identity.Capability_VolumeReplication_Type_value,
		"VolumeGroup":           identity.Capability_VolumeGroup_Type_value,
		"EncryptionKeyRotation": identity.Capability_EncryptionKeyRotation_Type_value,
	}
	want := map[string]map[string]int32{
		"Service":           {"UNKNOWN": 0, "CONTROLLER_SERVICE": 1, "NODE_SERVICE": 2},
		"ReclaimSpace":      {"UNKNOWN": 0, "OFFLINE": 1, "ONLINE": 2},
		"NetworkFence":      {"UNKNOWN": 0, "NETWORK_FENCE": 1, "GET_CLIENTS_TO_FENCE": 2},
		"VolumeReplication": {"UNKNOWN": 0, "VOLUME_REPLICATION": 1, "GET_REPLICATION_DESTINATION_INFO": 2},
		"VolumeGroup": {"UNKNOWN": 0, "VOLUME_GROUP": 1, "LIMIT_VOLUME_TO_ONE_VOLUME_GROUP": 2, "DO_NOT_ALLOW_VG_TO_DELETE_VOLUMES": 3,
			"MODIFY_VOLUME_GROUP": 4, "GET_VOLUME_GROUP": 5, "LIST_VOLUME_GROUPS": 6},
		"EncryptionKeyRotation": {"UNKNOWN": 0, "ENCRYPTIONKEYROTATION": 1},
	}
	for msg, values := range want {
		if len(enums[msg]) != len(values) {
			t.Errorf("Capability.%s.Type has %d values, want %d", msg, len(enums[msg]), len(values))
		}
		for name, num := range values {
			if got, ok := enums[msg][name]; !ok || got != num {
				t.Errorf("Capability.%s.Type %s = %d, want %d", msg, name, got, num)
			}
		}
	}
	resp := (&identity.GetIdentityResponse{}).ProtoReflect().Descriptor()
	for name, num := range map[protoreflect.Name]protoreflect.FieldNumber{"name": 1, "vendor_version": 2, "manifest": 3} {
		if fd := resp.Fields().ByName(name); fd == nil || fd.Number() != num {
			t.Errorf("GetIdentityResponse.%s is not field %d", name, num)
		}
	}
	if fd := (&identity.ProbeResponse{}).ProtoReflect().Descriptor().Fields().ByName("ready"); fd == nil || fd.Number() != 1 ||
		fd.Message().FullName() != "google.protobuf.BoolValue" {
		t.Error("ProbeResponse.ready is not BoolValue field 1")
	}
}
