package namedvol

import (
	"context"
	"errors"
	"strings"
	"testing"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

func TestParseOptionsErrorsNameTheKey(t *testing.T) {
	long := strings.Repeat("x", 10000)
	for _, tc := range []struct {
		name string
		opts map[string]string
		want string
	}{
		{"v", map[string]string{"volume_id": "a"}, "option plugin is required"},
		{"v", map[string]string{"plugin": "p"}, "option volume_id is required"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "size": "1G"}, "options volume_id (an existing volume) and size (create one) exclude each other"},
		{"v", map[string]string{"plugin": "p", "size": "lots"}, `option size="lots": expected a size`},
		{"v", map[string]string{"plugin": "p", "size": "0"}, `option size="0": expected a size`},
		{"v", map[string]string{"plugin": "p", "param.x": "y"}, "option size is required to create a volume"},
		{"v", map[string]string{"plugin": "p", "size": "1G", "from_snapshot": "s", "from_volume": "v"}, "options from_snapshot and from_volume exclude each other"},
		{"v", map[string]string{"plugin": "p", "size": "1G", "delete_on_remove": "yes"}, `option delete_on_remove="yes": expected true or false`},
		{"v", map[string]string{"plugin": "p", "size": "1G", "context.k": "v"}, "options context.KEY are for an existing volume"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "controller_publish_secret": "x"}, "option controller_publish_secret: expected a secret reference NAME/KEY"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "access_mode": "RW"}, `option access_mode="RW" is not a CSI access mode`},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "block": "yes"}, "option block="},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "block": "true", "fs_type": "ext4"}, "exclude each other"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "stage_secret": "noslash"}, "option stage_secret: expected a secret reference NAME/KEY"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "stage_secret": "../shadow"}, "option stage_secret: expected a secret reference NAME/KEY"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "publish_secret": "./k"}, "option publish_secret: expected a secret reference NAME/KEY"},
		{"v", map[string]string{"plugin": "p", "volume_id": long}, "option volume_id is 10000 bytes"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "context." + long: "x"}, "option context.KEY is 10000 bytes"},
		{"a/b", map[string]string{"plugin": "p", "volume_id": "a"}, `has the character '/'`},
		{"..", map[string]string{"plugin": "p", "volume_id": "a"}, "must start with a letter"},
		{long, map[string]string{"plugin": "p", "volume_id": "a"}, "is 10000 bytes, longer than 128"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "uid": "1000"}, "options uid and gid go together"},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "uid": "-1", "gid": "0"}, `option uid="-1": expected a decimal id`},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "uid": "1000", "gid": "01"}, `option gid="01": expected a decimal id`},
		{"v", map[string]string{"plugin": "p", "volume_id": "a", "uid": "1", "gid": "1", "block": "true"}, "are for read-write filesystem volumes"},
	} {
		_, err := ParseOptions(tc.name, tc.opts)
		if err == nil || !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ParseOptions(%.20q, %.60v) = %v, want an error containing %q", tc.name, tc.opts, err, tc.want)
		}
		if err != nil && len(err.Error()) > 600 {
			t.Errorf("error quotes back %d bytes", len(err.Error()))
		}
	}
}

func TestDefinitionBecomesAVolume(t *testing.T) {
	d, err := ParseOptions("data", map[string]string{
		"plugin": "loop", "volume_id": "vol1", "fs_type": "ext4", "mount_flags": "noatime,nodev",
		"context.k": "v", "stage_secret": "creds/token", "access_mode": "MULTI_NODE_READER_ONLY",
	})
	if err != nil {
		t.Fatal(err)
	}
	v := d.Volume("/data", false)
	if v.GetMode() != statev1.Volume_RO {
		t.Errorf("a reader-only definition mounted %v, want RO", v.GetMode())
	}
	st := v.GetSource().GetCsiVolume().GetStaticProvisioning()
	if got := st.GetVolumeCapability().GetMount().GetMountFlags(); strings.Join(got, ",") != "noatime,nodev" {
		t.Errorf("mount flags %v", got)
	}
	ref := st.GetNodeStageSecrets()["token"].GetReference()
	if ref.GetName() != "creds" || ref.GetKey() != "token" {
		t.Errorf("stage secret %v, want reference creds/token", st.GetNodeStageSecrets())
	}
	back, err := ParseOptions("data", d.Options())
	if err != nil || back.VolumeContext["k"] != "v" || back.AccessMode != d.AccessMode {
		t.Errorf("Options does not parse back: %+v, %v", back, err)
	}
}

func TestStoreCreateGetListRemove(t *testing.T) {
	ctx := context.Background()
	s := newTestStore(t)
	d := &Definition{Name: "a", Plugin: "p", VolumeID: "1"}
	if err := s.Create(ctx, d); err != nil {
		t.Fatal(err)
	}
	if err := s.Create(ctx, &Definition{Name: "a", Plugin: "p", VolumeID: "1"}); err != nil {
		t.Errorf("the same definition again: %v", err)
	}
	if err := s.Create(ctx, &Definition{Name: "a", Plugin: "p", VolumeID: "2"}); !errors.Is(err, ErrExists) {
		t.Errorf("another definition under the name: %v, want ErrExists", err)
	}
	if err := s.Create(ctx, &Definition{Name: "b", Plugin: "p", VolumeID: "2"}); err != nil {
		t.Fatal(err)
	}
	all, err := s.List()
	if err != nil || len(all) != 2 || all[0].Name != "a" || all[1].VolumeID != "2" {
		t.Fatalf("List = %v, %v", all, err)
	}
	if err := s.Remove(ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get("a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Get after Remove: %v", err)
	}
	if err := s.Remove(ctx, "a"); !errors.Is(err, ErrNotFound) {
		t.Errorf("Remove twice: %v", err)
	}
}

// uid and gid round-trip and become the engine mount's user.
func TestEngineUser(t *testing.T) {
	d, err := ParseOptions("v", map[string]string{"plugin": "p", "volume_id": "a", "uid": "1000", "gid": "1001"})
	if err != nil || d.EngineUser() != "1000:1001" {
		t.Fatalf("ParseOptions = %+v, %v; want user 1000:1001", d, err)
	}
	again, err := ParseOptions("v", d.Options())
	if err != nil || again.EngineUser() != "1000:1001" {
		t.Fatalf("round trip: %+v, %v", again, err)
	}
	if d, _ := ParseOptions("v", map[string]string{"plugin": "p", "volume_id": "a"}); d.EngineUser() != "" {
		t.Errorf("no uid: user %q", d.EngineUser())
	}
}

// TestCSIName: the name CreateVolume gets is the same for the same name,
// node and nonce, another for another node or nonce, within CSI's 128
// bytes, and long names that share a prefix differ.
func TestCSIName(t *testing.T) {
	web := CSIName("web", "node-1", "x")
	if !strings.HasPrefix(web, "csi-agent-web-") || web != CSIName("web", "node-1", "x") || web == CSIName("web", "node-2", "x") || web == CSIName("web", "node-1", "y") {
		t.Errorf("CSIName(web) = %q, on node-2 %q, another nonce %q", web, CSIName("web", "node-2", "x"), CSIName("web", "node-1", "y"))
	}
	a, b := CSIName(strings.Repeat("a", 128), "n", "x"), CSIName(strings.Repeat("a", 127)+"b", "n", "x")
	if len(a) > 128 || len(b) > 128 || a == b {
		t.Errorf("long names: %q (%d), %q (%d)", a, len(a), b, len(b))
	}
}
