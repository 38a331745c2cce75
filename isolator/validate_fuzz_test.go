package isolator

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/internal/atomicfile"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// Fuzz targets for everything the isolator takes from outside and turns
// into paths or state: volume ids (percent-encoded into directory names),
// container ids (directory names), whole Prepare requests, and checkpoint
// files read back from the work dir. `make fuzz` runs each of them.

// hostileIDs are seeds that have broken path handling elsewhere.
var hostileIDs = []string{
	"", ".", "..", "../..", "../../etc/passwd", "/", "/etc/passwd", "a/b", "a\x00b", "\x00",
	"%", "%2", "%2F", "%2f", "%41", "%%", ".hidden", "a.", "a..b", "\u2215etc", "\uff0e\uff0e",
	"a\u202eb", "\xff\xfe", strings.Repeat("a", 300), strings.Repeat("/", 100), "vol-1", "pool/data.img",
}

// FuzzVolumeIDRoundTrip: any id encodes to one safe path component that
// decodes back to it, and a directory name decodes only if it is the
// canonical encoding of its id (so no two directories claim one volume).
func FuzzVolumeIDRoundTrip(f *testing.F) {
	for _, s := range hostileIDs {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, id string) {
		enc := encodeVolumeID(id)
		if id != "" && (enc == "" || enc == "." || enc == ".." || enc[0] == '.') {
			t.Fatalf("encodeVolumeID(%q) = %q: not a safe path component", id, enc)
		}
		for i := 0; i < len(enc); i++ {
			c := enc[i]
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("-_.%", c) >= 0) {
				t.Fatalf("encodeVolumeID(%q) = %q has byte %q", id, enc, c)
			}
		}
		root := "/work/csi/p/default/volumes"
		if id != "" && filepath.Dir(filepath.Join(root, enc)) != root {
			t.Fatalf("encoded id %q leaves %s", enc, root)
		}
		dec, err := decodeVolumeID(enc)
		if err != nil || dec != id {
			t.Fatalf("decodeVolumeID(encodeVolumeID(%q)) = %q, %v", id, dec, err)
		}
		// The fuzzed string as a directory name found on disk.
		if d, err := decodeVolumeID(id); err == nil && encodeVolumeID(d) != id {
			t.Fatalf("decodeVolumeID(%q) = %q, which encodes to %q: not canonical", id, d, encodeVolumeID(d))
		}
	})
}

// FuzzValidateContainerID: an accepted container id is one plain ASCII
// path component of at most 128 bytes.
func FuzzValidateContainerID(f *testing.F) {
	for _, s := range hostileIDs {
		f.Add(s)
	}
	f.Add("mesos-0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0.1")
	f.Fuzz(func(t *testing.T, id string) {
		err := ValidateContainerID(id)
		if err != nil {
			if !strings.Contains(err.Error(), "container_id") {
				t.Fatalf("error %q does not name container_id", err)
			}
			return
		}
		if id == "" || len(id) > maxContainerID || id[0] == '.' || strings.ContainsAny(id, "/\x00") {
			t.Fatalf("accepted unsafe container id %q", id)
		}
		for i := 0; i < len(id); i++ {
			if id[i] >= utf8.RuneSelf || id[i] < ' ' {
				t.Fatalf("accepted non-printable or non-ASCII container id %q", id)
			}
		}
		root := "/work/isolators/volume/csi"
		if filepath.Join(root, id) != root+"/"+id {
			t.Fatalf("container id %q is not one path component", id)
		}
	})
}

// fakePlugins knows the plugins "loop" and "p" (whose target_path_root is
// /targets) and has none ready.
type fakePlugins struct{}

func (fakePlugins) Lookup(typ string) (Plugin, error) {
	switch typ {
	case "loop":
		return Plugin{Type: "loop", Name: "default"}, nil
	case "p":
		return Plugin{Type: "p", Name: "default", TargetPathRoot: "/targets"}, nil
	}
	return Plugin{}, ErrUnknownPlugin
}

func (fakePlugins) Node(ctx context.Context, typ string) (Node, error) {
	return Node{}, ErrUnavailable
}

func seedRequest(mutate func(r *statev1.PrepareRequest)) []byte {
	r := &statev1.PrepareRequest{ContainerId: "c1", Sandbox: "/sandbox", Volumes: []*statev1.Volume{{
		ContainerPath: "data", Mode: statev1.Volume_RW,
		Source: &statev1.Volume_Source{Type: statev1.Volume_Source_CSI_VOLUME, CsiVolume: &statev1.CSIVolume{
			PluginName: "loop",
			StaticProvisioning: &statev1.StaticProvisioning{VolumeId: "vol-1", VolumeCapability: &csi.VolumeCapability{
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
				AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			}},
		}},
	}}}
	if mutate != nil {
		mutate(r)
	}
	b, err := proto.Marshal(r)
	if err != nil {
		panic(err)
	}
	return b
}

// FuzzPrepareRequest feeds arbitrary wire bytes, as a client could send
// them, to Prepare's validation. It must never panic, and what it accepts
// must be safe: every volume's directories stay in the work dir (or the
// plugin's target_path_root), modes and access modes are known values,
// container paths carry no NUL and relative ones have a sandbox.
func FuzzPrepareRequest(f *testing.F) {
	f.Add(seedRequest(nil))
	v := func(r *statev1.PrepareRequest) *statev1.Volume { return r.Volumes[0] }
	sp := func(r *statev1.PrepareRequest) *statev1.StaticProvisioning {
		return v(r).Source.CsiVolume.StaticProvisioning
	}
	for _, m := range []func(r *statev1.PrepareRequest){
		func(r *statev1.PrepareRequest) { v(r).Mode = 7 },
		func(r *statev1.PrepareRequest) { v(r).Source.Type = 9 },
		func(r *statev1.PrepareRequest) { sp(r).VolumeCapability.AccessMode.Mode = 99 },
		func(r *statev1.PrepareRequest) { sp(r).VolumeId = "../../../etc" },
		func(r *statev1.PrepareRequest) { sp(r).VolumeId = strings.Repeat("\u2215", 90) },
		func(r *statev1.PrepareRequest) { r.ContainerId = "../x" },
		func(r *statev1.PrepareRequest) { v(r).ContainerPath = "/../../etc" },
		func(r *statev1.PrepareRequest) { v(r).ContainerPath = "a\x00b" },
		func(r *statev1.PrepareRequest) { v(r).Source.CsiVolume.PluginName = "p" },
		func(r *statev1.PrepareRequest) { r.Sandbox = "relative" },
		func(r *statev1.PrepareRequest) {
			r.Volumes = append(r.Volumes, proto.Clone(r.Volumes[0]).(*statev1.Volume))
		},
		func(r *statev1.PrepareRequest) { sp(r).VolumeCapability.AccessType = nil },
	} {
		f.Add(seedRequest(m))
	}
	iso := &Isolator{cfg: Config{WorkDir: "/work", Plugins: fakePlugins{}}}
	f.Fuzz(func(t *testing.T, data []byte) {
		req := &statev1.PrepareRequest{}
		if err := proto.Unmarshal(data, req); err != nil {
			return
		}
		plan, err := iso.plan(req)
		if err != nil {
			return
		}
		if ValidateContainerID(req.GetContainerId()) != nil {
			t.Fatalf("accepted container id %q", req.GetContainerId())
		}
		for _, pm := range plan {
			p, _ := fakePlugins{}.Lookup(pm.key.plugin)
			nv := iso.newVolume(pm.key, p, pm.static, pm.readonly)
			for _, path := range []string{nv.dir, nv.cp.StagingPath, nv.cp.TargetPath} {
				root := iso.mountRoot(p)
				if path == nv.dir {
					root = filepath.Join(iso.pluginDir(p), "volumes")
				}
				if rel, err := filepath.Rel(root, path); err != nil || strings.HasPrefix(rel, "..") || filepath.Clean(path) != path {
					t.Fatalf("volume id %q: path %s escapes %s", pm.key.id, path, root)
				}
			}
			if m := pm.static.GetVolumeCapability().GetAccessMode().GetMode(); csi.VolumeCapability_AccessMode_Mode_name[int32(m)] == "" || m == 0 {
				t.Fatalf("accepted access mode %d", m)
			}
			if strings.ContainsRune(pm.containerPath, 0) || (!filepath.IsAbs(pm.containerPath) && req.GetSandbox() == "") {
				t.Fatalf("accepted container path %q (sandbox %q)", pm.containerPath, req.GetSandbox())
			}
		}
		for _, vol := range req.GetVolumes() {
			if m := vol.GetMode(); m != statev1.Volume_RW && m != statev1.Volume_RO {
				t.Fatalf("accepted mode %d", m)
			}
		}
	})
}

// FuzzCheckpointDecode writes arbitrary bytes as a volume checkpoint and a
// container checkpoint, as a torn write or a disk error could leave them,
// and starts an isolator on them: it must start, never panic, move what it
// cannot read aside, and answer ListVolumes and ListContainers. Whatever
// decodes must survive a write and a re-read unchanged.
func FuzzCheckpointDecode(f *testing.F) {
	vcp, _ := protojson.Marshal(&statev1.VolumeCheckpoint{State: statev1.VolumeCheckpoint_PUBLISHED, PluginName: "loop", Users: []string{"c1"}, StagingPath: "/s", TargetPath: "/t", BootId: "b"})
	ccp, _ := protojson.Marshal(&statev1.ContainerCheckpoint{ContainerId: "c1", Phase: statev1.ContainerCheckpoint_PREPARED})
	for _, s := range [][]byte{vcp, ccp, []byte(`{"state": "PUBL`), {}, []byte("null"), []byte(`{"users":[null]}`),
		[]byte(`{"state": 99, "users": ["../x"]}`), []byte(`{"request": {"volumes": [{"source": {}}]}}`), []byte("\x00\xff")} {
		f.Add(s, s)
	}
	// The same in the record format (see atomicfile.ReadRecord), each
	// framed with the identity of the file the fuzz body writes it to.
	volumeRecord := filepath.Join("csi", "loop", "default", "volumes", "vol-1", volumeStateFile)
	containerRecord := filepath.Join("isolators", "volume", "csi", "c1", containerStateFile)
	record := func(b []byte, rel string) []byte {
		root := f.TempDir()
		c, err := atomicfile.New(root)
		if err != nil {
			f.Fatal(err)
		}
		p := filepath.Join(root, rel)
		if err := c.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			f.Fatal(err)
		}
		if _, err := c.Put(p, b, 0o600); err != nil {
			f.Fatal(err)
		}
		if err := c.Sync(context.Background()); err != nil { // renamed into place
			f.Fatal(err)
		}
		out, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		return out
	}
	f.Add(record(vcp, volumeRecord), record(ccp, containerRecord))
	f.Fuzz(func(t *testing.T, volumeState, containerState []byte) {
		work := t.TempDir()
		vdir := filepath.Dir(filepath.Join(work, volumeRecord))
		for dir, b := range map[string][]byte{filepath.Join(work, volumeRecord): volumeState, filepath.Join(work, containerRecord): containerState} {
			if err := os.MkdirAll(filepath.Dir(dir), 0o700); err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(dir, b, 0o600); err != nil {
				t.Fatal(err)
			}
		}
		iso, err := newTestIsolator(t, Config{WorkDir: work, Plugins: fakePlugins{}, BootID: "b"})
		if err != nil {
			t.Fatalf("New on fuzzed checkpoints: %v", err)
		}
		// What loading wrote (reconstructed records) is committed before
		// the work dir is removed, not while.
		t.Cleanup(func() {
			if err := iso.commit.Sync(context.Background()); err != nil {
				t.Error(err)
			}
		})
		iso.ListVolumes()
		iso.ListContainers()
		if iso.volumes[volumeKey{"loop", "vol-1"}] == nil {
			t.Fatalf("the volume was lost (corrupt checkpoints are reconstructed): %v", iso.volumes)
		}
		cp := &statev1.VolumeCheckpoint{}
		if protojson.Unmarshal(volumeState, cp) == nil && len(volumeState) > 0 {
			if _, err := iso.writeCheckpoint(vdir, volumeStateFile, cp); err != nil {
				t.Fatal(err)
			}
			again := &statev1.VolumeCheckpoint{}
			if err := readCheckpoint(iso.commit, filepath.Join(vdir, volumeStateFile), again); err != nil || !proto.Equal(cp, again) {
				t.Fatalf("checkpoint changed across write and read: %v", err)
			}
		}
	})
}

// TestPlanNamesTheVolume: a refusal because of one volume is a
// VolumeError with its index, the class first in its message; a caller's
// Name replaces volumes[N].
func TestPlanNamesTheVolume(t *testing.T) {
	iso := &Isolator{cfg: Config{WorkDir: "/work", Plugins: fakePlugins{}}}
	second := func(mutate func(v *statev1.Volume)) *statev1.PrepareRequest {
		req := &statev1.PrepareRequest{}
		if err := proto.Unmarshal(seedRequest(nil), req); err != nil {
			t.Fatal(err)
		}
		v := proto.Clone(req.Volumes[0]).(*statev1.Volume)
		v.ContainerPath, v.Source.CsiVolume.StaticProvisioning.VolumeId = "other", "vol-2"
		mutate(v)
		req.Volumes = append(req.Volumes, v)
		return req
	}
	for _, c := range []struct {
		name   string
		req    *statev1.PrepareRequest
		class  error
		msg    string
		called string
	}{
		{"mode", second(func(v *statev1.Volume) { v.Mode = 0 }), ErrInvalid,
			"invalid request: volumes[1]: mode is required: RW or RO", "invalid request: named_mounts[0] (x): mode is required"},
		{"unknown plugin", second(func(v *statev1.Volume) { v.Source.CsiVolume.PluginName = "nope" }), ErrUnknownPlugin,
			"volumes[1]: unknown plugin", "named_mounts[0] (x): unknown plugin"}, // the fake's bare class
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := iso.plan(c.req)
			var ve *VolumeError
			if !errors.As(err, &ve) || ve.Index != 1 || !errors.Is(err, c.class) {
				t.Fatalf("plan = %v; want a VolumeError of volumes[1] wrapping %v", err, c.class)
			}
			if !strings.HasPrefix(err.Error(), c.msg) {
				t.Errorf("message %q; want it to start %q", err, c.msg)
			}
			ve.Name = "named_mounts[0] (x)"
			if !strings.HasPrefix(err.Error(), c.called) {
				t.Errorf("renamed: %q; want it to start %q", err, c.called)
			}
		})
	}
}
