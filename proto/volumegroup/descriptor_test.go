package volumegroup_test

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"

	"github.com/csiagent/csiagent/proto/volumegroup"
)

func TestService(t *testing.T) {
	sd := volumegroup.File_proto_volumegroup_volumegroup_proto.Services().ByName("Controller")
	if sd == nil {
		t.Fatal("no service Controller")
	}
	if got, want := sd.FullName(), protoreflect.FullName("volumegroup.Controller"); got != want {
		t.Fatalf("service = %s, want %s", got, want)
	}
	tests := []struct {
		method     protoreflect.Name
		fullMethod string // generated constant
	}{
		{"CreateVolumeGroup", volumegroup.Controller_CreateVolumeGroup_FullMethodName},
		{"ModifyVolumeGroupMembership", volumegroup.Controller_ModifyVolumeGroupMembership_FullMethodName},
		{"DeleteVolumeGroup", volumegroup.Controller_DeleteVolumeGroup_FullMethodName},
		{"ListVolumeGroups", volumegroup.Controller_ListVolumeGroups_FullMethodName},
		{"ControllerGetVolumeGroup", volumegroup.Controller_ControllerGetVolumeGroup_FullMethodName},
	}
	if sd.Methods().Len() != len(tests) {
		t.Errorf("%d methods, want %d", sd.Methods().Len(), len(tests))
	}
	for _, tc := range tests {
		t.Run(string(tc.method), func(t *testing.T) {
			md := sd.Methods().ByName(tc.method)
			if md == nil {
				t.Fatal("method missing")
			}
			if want := "/volumegroup.Controller/" + string(tc.method); tc.fullMethod != want {
				t.Errorf("full method name = %q, want %q", tc.fullMethod, want)
			}
			opts := md.Options().(*descriptorpb.MethodOptions)
			if !proto.GetExtension(opts, volumegroup.E_VgAlphaMethod).(bool) {
				t.Error("missing (vg_alpha_method) = true")
			}
		})
	}
}

func TestSecretFields(t *testing.T) {
	tests := []struct {
		message protoreflect.ProtoMessage
		number  protoreflect.FieldNumber
	}{
		{&volumegroup.CreateVolumeGroupRequest{}, 3},
		{&volumegroup.DeleteVolumeGroupRequest{}, 2},
		{&volumegroup.ModifyVolumeGroupMembershipRequest{}, 3},
		{&volumegroup.ControllerGetVolumeGroupRequest{}, 2},
		{&volumegroup.ListVolumeGroupsRequest{}, 3},
	}
	for _, tc := range tests {
		md := tc.message.ProtoReflect().Descriptor()
		t.Run(string(md.Name()), func(t *testing.T) {
			fd := md.Fields().ByName("secrets")
			if fd == nil {
				t.Fatal("no secrets field")
			}
			if fd.Number() != tc.number {
				t.Errorf("secrets = %d, want %d", fd.Number(), tc.number)
			}
			opts := fd.Options().(*descriptorpb.FieldOptions)
			if !proto.GetExtension(opts, csi.E_CsiSecret).(bool) {
				t.Error("missing (csi.v1.csi_secret) = true")
			}
			if !proto.GetExtension(opts, volumegroup.E_VgCsiSecret).(bool) {
				t.Error("missing (vg_csi_secret) = true")
			}
		})
	}

	// No secrets field anywhere in the file may lack the option.
	msgs := volumegroup.File_proto_volumegroup_volumegroup_proto.Messages()
	count := 0
	for i := range msgs.Len() {
		if fd := msgs.Get(i).Fields().ByName("secrets"); fd != nil {
			count++
			if !proto.GetExtension(fd.Options().(*descriptorpb.FieldOptions), csi.E_CsiSecret).(bool) {
				t.Errorf("%s lacks (csi.v1.csi_secret)", fd.FullName())
			}
		}
	}
	if count != len(tests) {
		t.Errorf("found %d secrets fields, table lists %d", count, len(tests))
	}
}

// TestVgVolumeMatchesCSIVolume checks the claim in volumegroup.proto that
// VgVolume is csi.v1.Volume on the wire: a fully populated csi.Volume survives
// a round trip through VgVolume unchanged.
func TestVgVolumeMatchesCSIVolume(t *testing.T) {
	tests := []struct {
		name string
		vol  *csi.Volume
	}{
		{"from snapshot", &csi.Volume{
			CapacityBytes: 1 << 30,
			VolumeId:      "vol-1",
			VolumeContext: map[string]string{"pool": "rbd"},
			ContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "snap-1"},
			}},
			AccessibleTopology: []*csi.Topology{
				{Segments: map[string]string{"region": "R1", "zone": "Z2"}},
				{Segments: map[string]string{"region": "R1", "zone": "Z3"}},
			},
		}},
		{"clone", &csi.Volume{
			VolumeId: "vol-2",
			ContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
				Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: "vol-1"},
			}},
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b, err := proto.Marshal(tc.vol)
			if err != nil {
				t.Fatal(err)
			}
			var vg volumegroup.VgVolume
			if err := proto.Unmarshal(b, &vg); err != nil {
				t.Fatal(err)
			}
			if n := len(vg.ProtoReflect().GetUnknown()); n != 0 {
				t.Errorf("VgVolume left %d unknown bytes", n)
			}
			b, err = proto.Marshal(&vg)
			if err != nil {
				t.Fatal(err)
			}
			var back csi.Volume
			if err := proto.Unmarshal(b, &back); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(&back, tc.vol) {
				t.Errorf("round trip = %v, want %v", &back, tc.vol)
			}
		})
	}
}
