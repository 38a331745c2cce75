package redact

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	"github.com/csiagent/csiagent/proto/reclaimspace"
)

const secretValue = "hunter2-do-not-log"

func mountCapability() *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "ext4", MountFlags: []string{"noatime"}}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
	}
}

func stageRequest() *csi.NodeStageVolumeRequest {
	return &csi.NodeStageVolumeRequest{
		VolumeId:          "vol-1",
		PublishContext:    map[string]string{"device": "/dev/loop7"},
		StagingTargetPath: "/var/lib/csi/staging",
		VolumeCapability:  mountCapability(),
		Secrets:           map[string]string{"user": "admin", "password": secretValue},
		VolumeContext:     map[string]string{"pool": "fast"},
	}
}

// redactOK runs Message and checks the original is left as it was.
func redactOK[M proto.Message](t *testing.T, m M) M {
	t.Helper()
	before := proto.Clone(m)
	got, ok := Message(m).(M)
	if !ok {
		t.Fatalf("Message(%T) returned %T", m, Message(m))
	}
	if !proto.Equal(m, before) {
		t.Errorf("the original was modified:\n got %v\nwant %v", m, before)
	}
	return got
}

func TestNodeStageVolumeRequest(t *testing.T) {
	req := stageRequest()
	got := redactOK(t, req)

	want := stageRequest()
	want.Secrets = map[string]string{"user": Stripped, "password": Stripped}
	if !proto.Equal(got, want) {
		t.Errorf("Message =\n%v\nwant\n%v", got, want)
	}
	// A deep copy: changing it leaves the original alone.
	got.VolumeCapability.GetMount().MountFlags[0] = "changed"
	got.Secrets["password"] = "changed"
	if !proto.Equal(req, stageRequest()) {
		t.Errorf("changing the copy changed the original: %v", req)
	}
}

func TestReclaimSpaceRequests(t *testing.T) {
	node := redactOK(t, &reclaimspace.NodeReclaimSpaceRequest{
		VolumeId: "v", VolumePath: "/p", StagingTargetPath: "/s",
		VolumeCapability: mountCapability(),
		Secrets:          map[string]string{"token": secretValue},
	})
	wantNode := &reclaimspace.NodeReclaimSpaceRequest{
		VolumeId: "v", VolumePath: "/p", StagingTargetPath: "/s",
		VolumeCapability: mountCapability(),
		Secrets:          map[string]string{"token": Stripped},
	}
	if !proto.Equal(node, wantNode) {
		t.Errorf("NodeReclaimSpaceRequest: got %v, want %v", node, wantNode)
	}
	ctrl := redactOK(t, &reclaimspace.ControllerReclaimSpaceRequest{
		VolumeId: "v", Parameters: map[string]string{"k": secretValue}, Secrets: map[string]string{"token": secretValue},
	})
	wantCtrl := &reclaimspace.ControllerReclaimSpaceRequest{
		VolumeId: "v", Parameters: map[string]string{"k": secretValue}, Secrets: map[string]string{"token": Stripped},
	}
	if !proto.Equal(ctrl, wantCtrl) {
		t.Errorf("ControllerReclaimSpaceRequest: got %v, want %v (parameters are not secret)", ctrl, wantCtrl)
	}
}

func TestNoSecretsUnchanged(t *testing.T) {
	for _, m := range []proto.Message{
		&csi.NodePublishVolumeRequest{VolumeId: "v", TargetPath: "/t", VolumeCapability: mountCapability(), Readonly: true},
		&csi.NodeStageVolumeRequest{VolumeId: "v", VolumeCapability: mountCapability()}, // secrets field unset
		&csi.NodeGetInfoResponse{NodeId: "n", AccessibleTopology: &csi.Topology{Segments: map[string]string{"zone": "a"}}},
		&csi.CreateVolumeRequest{
			Name:               "v",
			VolumeCapabilities: []*csi.VolumeCapability{mountCapability(), mountCapability()},
			Parameters:         map[string]string{"p": "q"},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: "s"},
			}},
		},
		&agentv1.PrepareRequest{ContainerId: "c", Volumes: []*agentv1.Volume{{ContainerPath: "/data"}}},
	} {
		t.Run(string(m.ProtoReflect().Descriptor().Name()), func(t *testing.T) {
			got := redactOK(t, m)
			if !proto.Equal(got, m) {
				t.Errorf("Message = %v, want it unchanged: %v", got, m)
			}
			if got == m {
				t.Error("Message returned the original, want a copy")
			}
		})
	}
}

func TestNil(t *testing.T) {
	if got := Message(nil); got != nil {
		t.Errorf("Message(nil) = %v, want nil", got)
	}
	var typedNil *csi.NodeStageVolumeRequest
	if got := Message(typedNil); got.ProtoReflect().IsValid() {
		t.Errorf("Message(typed nil) = %v, want an invalid (nil) message", got)
	}
}

// TestAgentPrepareRequest: secrets are map<string, Secret> values two
// levels down a repeated field.
func TestAgentPrepareRequest(t *testing.T) {
	volume := func(id string, stage, publish map[string]*agentv1.Secret) *agentv1.Volume {
		return &agentv1.Volume{
			ContainerPath: "/data/" + id,
			Mode:          agentv1.Volume_RW,
			Source: &agentv1.Volume_Source{Type: agentv1.Volume_Source_CSI_VOLUME, CsiVolume: &agentv1.CSIVolume{
				PluginName: "loop",
				StaticProvisioning: &agentv1.StaticProvisioning{
					VolumeId: id, VolumeCapability: mountCapability(),
					NodeStageSecrets: stage, NodePublishSecrets: publish,
					VolumeContext: map[string]string{"ctx": id},
				},
			}},
		}
	}
	valueSecret := func(s string) *agentv1.Secret {
		return &agentv1.Secret{Type: agentv1.Secret_VALUE, Value: &agentv1.Secret_Value{Data: []byte(s)}}
	}
	refSecret := &agentv1.Secret{Type: agentv1.Secret_REFERENCE, Reference: &agentv1.Secret_Reference{Name: "creds", Key: "password"}}
	req := &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: "/r", Volumes: []*agentv1.Volume{
		volume("a", map[string]*agentv1.Secret{"password": valueSecret(secretValue), "user": refSecret}, nil),
		volume("b", nil, map[string]*agentv1.Secret{"token": valueSecret(secretValue)}),
	}}
	got := redactOK(t, req)
	want := &agentv1.PrepareRequest{ContainerId: "c1", Rootfs: "/r", Volumes: []*agentv1.Volume{
		volume("a", map[string]*agentv1.Secret{"password": {}, "user": {}}, nil),
		volume("b", nil, map[string]*agentv1.Secret{"token": {}}),
	}}
	if !proto.Equal(got, want) {
		t.Errorf("Message =\n%v\nwant\n%v", got, want)
	}
}

// testFile describes, without generated code, a message with a secret of
// every shape.
const testFile = `{
  "name": "redact_test.proto", "package": "redacttest", "syntax": "proto3",
  "dependency": ["google/protobuf/any.proto"],
  "messageType": [
    {"name": "Inner", "field": [
      {"name": "name", "number": 1, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING"},
      {"name": "creds", "number": 2, "label": "LABEL_REPEATED", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Inner.CredsEntry", "options": {}},
      {"name": "children", "number": 3, "label": "LABEL_REPEATED", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Inner"}
    ], "nestedType": [
      {"name": "CredsEntry", "options": {"mapEntry": true}, "field": [
        {"name": "key", "number": 1, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING"},
        {"name": "value", "number": 2, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING"}]}
    ]},
    {"name": "Outer", "field": [
      {"name": "plain", "number": 1, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING"},
      {"name": "token", "number": 2, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING", "options": {}},
      {"name": "key", "number": 3, "label": "LABEL_OPTIONAL", "type": "TYPE_BYTES", "options": {}},
      {"name": "passwords", "number": 4, "label": "LABEL_REPEATED", "type": "TYPE_STRING", "options": {}},
      {"name": "inner_secret", "number": 5, "label": "LABEL_OPTIONAL", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Inner", "options": {}},
      {"name": "inners", "number": 6, "label": "LABEL_REPEATED", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Inner"},
      {"name": "by_name", "number": 7, "label": "LABEL_REPEATED", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Outer.ByNameEntry"},
      {"name": "blobs", "number": 8, "label": "LABEL_REPEATED", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Outer.BlobsEntry", "options": {}},
      {"name": "pin", "number": 9, "label": "LABEL_OPTIONAL", "type": "TYPE_INT64", "options": {}},
      {"name": "oneof_secret", "number": 10, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING", "oneofIndex": 0, "options": {}},
      {"name": "oneof_inner", "number": 11, "label": "LABEL_OPTIONAL", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Inner", "oneofIndex": 0},
      {"name": "any", "number": 12, "label": "LABEL_OPTIONAL", "type": "TYPE_MESSAGE", "typeName": ".google.protobuf.Any"},
      {"name": "secret_inners", "number": 13, "label": "LABEL_REPEATED", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Inner", "options": {}}
    ], "oneofDecl": [{"name": "choice"}], "nestedType": [
      {"name": "ByNameEntry", "options": {"mapEntry": true}, "field": [
        {"name": "key", "number": 1, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING"},
        {"name": "value", "number": 2, "label": "LABEL_OPTIONAL", "type": "TYPE_MESSAGE", "typeName": ".redacttest.Inner"}]},
      {"name": "BlobsEntry", "options": {"mapEntry": true}, "field": [
        {"name": "key", "number": 1, "label": "LABEL_OPTIONAL", "type": "TYPE_STRING"},
        {"name": "value", "number": 2, "label": "LABEL_OPTIONAL", "type": "TYPE_BYTES"}]}
    ]}
  ]
}`

// outerType builds the test message type: every field whose JSON above has
// an "options" object is marked (csi.v1.csi_secret) = true.
func outerType(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	var fdp descriptorpb.FileDescriptorProto
	if err := protojson.Unmarshal([]byte(testFile), &fdp); err != nil {
		t.Fatal(err)
	}
	for _, msg := range fdp.MessageType {
		for _, f := range msg.Field {
			if f.Options != nil {
				proto.SetExtension(f.Options, csi.E_CsiSecret, true)
			}
		}
	}
	fd, err := protodesc.NewFile(&fdp, protoregistry.GlobalFiles)
	if err != nil {
		t.Fatal(err)
	}
	return fd.Messages().ByName("Outer")
}

func TestEveryShape(t *testing.T) {
	md := outerType(t)
	parse := func(t *testing.T, s string) proto.Message {
		t.Helper()
		m := dynamicpb.NewMessage(md)
		if err := protojson.Unmarshal([]byte(s), m); err != nil {
			t.Fatalf("%s: %v", s, err)
		}
		return m
	}
	const s = `"` + secretValue + `"`
	const b64 = `"aHVudGVyMg=="` // "hunter2"
	const stripped = `"` + Stripped + `"`
	const strippedB64 = `"Kioqc3RyaXBwZWQqKio="` // Stripped as bytes
	for _, c := range []struct{ name, in, want string }{
		{"plain only", `{"plain": "p"}`, `{"plain": "p"}`},
		{"scalar string", `{"plain": "p", "token": ` + s + `}`, `{"plain": "p", "token": ` + stripped + `}`},
		{"bytes", `{"key": ` + b64 + `}`, `{"key": ` + strippedB64 + `}`},
		{"repeated string keeps its length", `{"passwords": [` + s + `, "x", ""]}`, `{"passwords": [` + stripped + `, ` + stripped + `, ` + stripped + `]}`},
		{"secret message cleared, still set", `{"innerSecret": {"name": ` + s + `}}`, `{"innerSecret": {}}`},
		{"secret repeated messages", `{"secretInners": [{"name": ` + s + `}, {}]}`, `{"secretInners": [{}, {}]}`},
		{"int zeroed", `{"pin": "1234"}`, `{}`},
		{"oneof string", `{"oneofSecret": ` + s + `}`, `{"oneofSecret": ` + stripped + `}`},
		{"oneof message", `{"oneofInner": {"name": "n", "creds": {"k": ` + s + `}}}`, `{"oneofInner": {"name": "n", "creds": {"k": ` + stripped + `}}}`},
		{"map of bytes", `{"blobs": {"a": ` + b64 + `, "b": ""}}`, `{"blobs": {"a": ` + strippedB64 + `, "b": ` + strippedB64 + `}}`},
		{
			"nested repeated messages",
			`{"inners": [{"name": "a", "creds": {"k1": ` + s + `}, "children": [{"name": "aa", "children": [{"creds": {"deep": ` + s + `}}]}]}, {"name": "b"}]}`,
			`{"inners": [{"name": "a", "creds": {"k1": ` + stripped + `}, "children": [{"name": "aa", "children": [{"creds": {"deep": ` + stripped + `}}]}]}, {"name": "b"}]}`,
		},
		{
			"map of messages",
			`{"byName": {"x": {"name": "x", "creds": {"k": ` + s + `, "l": "v"}}, "y": {}}}`,
			`{"byName": {"x": {"name": "x", "creds": {"k": ` + stripped + `, "l": ` + stripped + `}}, "y": {}}}`,
		},
		{
			"secret packed in an Any",
			`{"any": {"@type": "type.googleapis.com/csi.v1.NodeStageVolumeRequest", "volumeId": "v", "secrets": {"password": ` + s + `}}}`,
			`{"any": {"@type": "type.googleapis.com/csi.v1.NodeStageVolumeRequest", "volumeId": "v", "secrets": {"password": ` + stripped + `}}}`,
		},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := parse(t, c.in)
			got := redactOK(t, in)
			if want := parse(t, c.want); !proto.Equal(got, want) {
				t.Errorf("Message =\n%v\nwant\n%v", got, want)
			}
			wire, err := proto.Marshal(got)
			if err != nil {
				t.Fatal(err)
			}
			if bytes.Contains(wire, []byte(secretValue)) || bytes.Contains(wire, []byte("hunter2")) {
				t.Errorf("the redacted copy still holds the secret: %v", got)
			}
		})
	}
}

func TestUnknownFieldsDropped(t *testing.T) {
	req := &csi.NodePublishVolumeRequest{VolumeId: "v", VolumeCapability: mountCapability()}
	// Field 99, bytes: what a newer schema's secret would look like to us.
	unknown := protoreflect.RawFields(protowire.AppendString(protowire.AppendTag(nil, 99, protowire.BytesType), secretValue))
	req.ProtoReflect().SetUnknown(unknown)
	req.VolumeCapability.ProtoReflect().SetUnknown(unknown)
	got := redactOK(t, req)
	if len(got.ProtoReflect().GetUnknown()) != 0 || len(got.VolumeCapability.ProtoReflect().GetUnknown()) != 0 {
		t.Errorf("unknown fields kept: %v", got)
	}
	if len(req.ProtoReflect().GetUnknown()) == 0 {
		t.Error("the original lost its unknown fields")
	}
}

func TestUnresolvableAny(t *testing.T) {
	in := &anypb.Any{TypeUrl: "type.googleapis.com/no.such.Type", Value: []byte(secretValue)}
	got := redactOK(t, in)
	if got.GetTypeUrl() != in.GetTypeUrl() || len(got.GetValue()) != 0 {
		t.Errorf("Message = %v, want the type URL kept and the value dropped", got)
	}
}

func TestValue(t *testing.T) {
	var buf bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&buf, nil))
	logger.Info("stage", "request", Value(stageRequest()))
	line := buf.String()
	if strings.Contains(line, secretValue) {
		t.Fatalf("the log holds the secret: %s", line)
	}
	var rec struct {
		Request struct {
			VolumeID string            `json:"volume_id"`
			Secrets  map[string]string `json:"secrets"`
		} `json:"request"`
	}
	if err := json.Unmarshal([]byte(line), &rec); err != nil {
		t.Fatalf("log line %q: %v", line, err)
	}
	if rec.Request.VolumeID != "vol-1" || !slices.Equal(slices.Sorted(maps.Keys(rec.Request.Secrets)), []string{"password", "user"}) ||
		rec.Request.Secrets["password"] != Stripped {
		t.Errorf("request logged as %+v, want the volume id and the secrets' keys with stripped values: %s", rec.Request, line)
	}

	buf.Reset()
	slog.New(slog.NewTextHandler(&buf, nil)).Info("stage", "request", Value(stageRequest()))
	if text := buf.String(); strings.Contains(text, secretValue) || !strings.Contains(text, `\"password\":\"***stripped***\"`) ||
		strings.Contains(text, "\n ") {
		t.Errorf("text handler line: %s", text)
	}

	buf.Reset()
	slog.New(slog.NewJSONHandler(&buf, nil)).Info("nil", "request", Value(nil))
	if !strings.Contains(buf.String(), `"request":{}`) {
		t.Errorf("nil message logged as %s, want {}", buf.String())
	}
}

// TestValueLazy: the message is read when the record is emitted, not when
// Value is called, and not at all for a disabled level.
func TestValueLazy(t *testing.T) {
	var buf bytes.Buffer
	logger := slog.New(slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelInfo}))
	req := &csi.NodeStageVolumeRequest{VolumeId: "before"}
	v := Value(req)
	req.VolumeId = "after"
	logger.Debug("dropped", "request", v)
	if buf.Len() != 0 {
		t.Fatalf("a debug record was emitted at level info: %s", buf.String())
	}
	logger.Info("kept", "request", v)
	if !strings.Contains(buf.String(), `"volume_id":"after"`) {
		t.Errorf("record %s, want the message as it was when logged", buf.String())
	}
}

// FuzzMessage checks, on arbitrary wire bytes, that the redacted copy is the
// original with unknown fields dropped and each secret value replaced, and
// that the original is untouched.
func FuzzMessage(f *testing.F) {
	for _, m := range []proto.Message{
		stageRequest(),
		&csi.CreateVolumeRequest{
			Name: "v", VolumeCapabilities: []*csi.VolumeCapability{mountCapability(), {AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}}},
			Parameters: map[string]string{"p": "q"}, Secrets: map[string]string{"a": secretValue, "b": ""},
			MutableParameters: map[string]string{"m": "n"},
		},
		&agentv1.PrepareRequest{ContainerId: "c", Volumes: []*agentv1.Volume{{Source: &agentv1.Volume_Source{CsiVolume: &agentv1.CSIVolume{
			StaticProvisioning: &agentv1.StaticProvisioning{
				NodeStageSecrets:   map[string]*agentv1.Secret{"k": {Value: &agentv1.Secret_Value{Data: []byte(secretValue)}}},
				NodePublishSecrets: map[string]*agentv1.Secret{"": {}},
			},
		}}}}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		var create csi.CreateVolumeRequest
		if proto.Unmarshal(data, &create) == nil {
			got := redactOK(t, &create)
			want := proto.Clone(&create).(*csi.CreateVolumeRequest)
			dropUnknown(want.ProtoReflect())
			for k := range want.Secrets {
				want.Secrets[k] = Stripped
			}
			if !proto.Equal(got, want) {
				t.Errorf("CreateVolumeRequest: Message =\n%v\nwant\n%v", got, want)
			}
		}
		var prepare agentv1.PrepareRequest
		if proto.Unmarshal(data, &prepare) == nil {
			got := redactOK(t, &prepare)
			want := proto.Clone(&prepare).(*agentv1.PrepareRequest)
			dropUnknown(want.ProtoReflect())
			for _, v := range want.Volumes {
				sp := v.GetSource().GetCsiVolume().GetStaticProvisioning()
				for _, secrets := range []map[string]*agentv1.Secret{sp.GetNodeStageSecrets(), sp.GetNodePublishSecrets(), sp.GetControllerPublishSecrets()} {
					for k := range secrets {
						secrets[k] = &agentv1.Secret{}
					}
				}
			}
			if !proto.Equal(got, want) {
				t.Errorf("PrepareRequest: Message =\n%v\nwant\n%v", got, want)
			}
		}
	})
}

// dropUnknown removes unknown fields at every depth.
func dropUnknown(m protoreflect.Message) {
	m.SetUnknown(nil)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case fd.IsMap() && fd.MapValue().Message() != nil:
			v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
				dropUnknown(mv.Message())
				return true
			})
		case fd.IsList() && fd.Message() != nil:
			for i := range v.List().Len() {
				dropUnknown(v.List().Get(i).Message())
			}
		case !fd.IsMap() && !fd.IsList() && fd.Message() != nil:
			dropUnknown(v.Message())
		}
		return true
	})
}
