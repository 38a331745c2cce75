package encryptionkeyrotation_test

import (
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	ekr "github.com/csiagent/csiagent/proto/encryptionkeyrotation"
)

// TestWire checks the names and numbers upstream's
// encryptionkeyrotation.proto has, and which fields are secret.
func TestWire(t *testing.T) {
	sd := ekr.File_proto_encryptionkeyrotation_encryptionkeyrotation_proto.Services().ByName("EncryptionKeyRotationController")
	if sd == nil || sd.FullName() != "encryptionkeyrotation.EncryptionKeyRotationController" || sd.Methods().ByName("EncryptionKeyRotate") == nil {
		t.Fatal("no EncryptionKeyRotationController/EncryptionKeyRotate")
	}
	md := (&ekr.EncryptionKeyRotateRequest{}).ProtoReflect().Descriptor()
	secret := map[protoreflect.Name]bool{"encryption_key": true, "secrets": true}
	for name, num := range map[protoreflect.Name]protoreflect.FieldNumber{
		"volume_id": 1, "volume_path": 2, "encryption_key": 3, "parameters": 4, "secrets": 5, "volume_capability": 6,
	} {
		fd := md.Fields().ByName(name)
		if fd == nil || fd.Number() != num {
			t.Errorf("%s is not field %d", name, num)
			continue
		}
		if got := proto.GetExtension(fd.Options(), csi.E_CsiSecret).(bool); got != secret[name] {
			t.Errorf("%s: csi_secret = %v", name, got)
		}
	}
	if got := md.Fields().ByName("volume_capability").Message().FullName(); got != "csi.v1.VolumeCapability" {
		t.Errorf("volume_capability is %s", got)
	}
}
