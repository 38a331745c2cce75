package apiserver

import (
	"encoding/json"
	"reflect"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/csiagent/csiagent/isolator"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
	"github.com/csiagent/csiagent/supervisor"
)

// populate sets every field of m, recursively (the first member of each
// oneof), to a value other than its zero.
func populate(t *testing.T, m protoreflect.Message, depth int) {
	if depth > 6 {
		t.Fatalf("%s: nested too deep", m.Descriptor().FullName())
	}
	fields := m.Descriptor().Fields()
	oneofs := map[protoreflect.FullName]bool{}
	for i := range fields.Len() {
		fd := fields.Get(i)
		if od := fd.ContainingOneof(); od != nil && !od.IsSynthetic() {
			if oneofs[od.FullName()] {
				continue
			}
			oneofs[od.FullName()] = true
		}
		switch {
		case fd.IsMap():
			key := protoreflect.ValueOfString("key-" + string(fd.Name())).MapKey()
			mp := m.Mutable(fd).Map()
			if fd.MapValue().Kind() == protoreflect.MessageKind {
				populate(t, mp.Mutable(key).Message(), depth+1)
			} else {
				mp.Set(key, scalar(t, fd.MapValue()))
			}
		case fd.IsList():
			l := m.Mutable(fd).List()
			if fd.Kind() == protoreflect.MessageKind {
				populate(t, l.AppendMutable().Message(), depth+1)
			} else {
				l.Append(scalar(t, fd))
			}
		case fd.Kind() == protoreflect.MessageKind:
			populate(t, m.Mutable(fd).Message(), depth+1)
		default:
			m.Set(fd, scalar(t, fd))
		}
	}
}

func scalar(t *testing.T, fd protoreflect.FieldDescriptor) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.StringKind:
		return protoreflect.ValueOfString("v-" + string(fd.Name()))
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte("b-" + string(fd.Name())))
	case protoreflect.BoolKind:
		return protoreflect.ValueOfBool(true)
	case protoreflect.Int32Kind, protoreflect.Sint32Kind, protoreflect.Sfixed32Kind:
		return protoreflect.ValueOfInt32(7)
	case protoreflect.Int64Kind, protoreflect.Sint64Kind, protoreflect.Sfixed64Kind:
		return protoreflect.ValueOfInt64(7)
	case protoreflect.Uint32Kind, protoreflect.Fixed32Kind:
		return protoreflect.ValueOfUint32(7)
	case protoreflect.Uint64Kind, protoreflect.Fixed64Kind:
		return protoreflect.ValueOfUint64(7)
	case protoreflect.EnumKind:
		vals := fd.Enum().Values()
		return protoreflect.ValueOfEnum(vals.Get(vals.Len() - 1).Number())
	}
	t.Fatalf("%s: kind %v not handled", fd.FullName(), fd.Kind())
	return protoreflect.Value{}
}

// sameJSON compares two messages by their protojson forms (proto field
// names): the isolator's schema names its fields as the API does.
func sameJSON(t *testing.T, what string, a, b proto.Message) {
	t.Helper()
	decode := func(m proto.Message) any {
		raw, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var v any
		if err := json.Unmarshal(raw, &v); err != nil {
			t.Fatal(err)
		}
		return v
	}
	if da, db := decode(a), decode(b); !reflect.DeepEqual(da, db) {
		t.Errorf("%s: converted\n%v\nfrom\n%v", what, db, da)
	}
}

// TestConvertCarriesEveryField: every field of the API messages the edge
// converts reaches the isolator's (and back), so an API field added
// without its translation fails here.
func TestConvertCarriesEveryField(t *testing.T) {
	req := &agentv1.PrepareRequest{}
	populate(t, req.ProtoReflect(), 0)
	// Named mounts are resolved into volumes before the conversion.
	req.NamedMounts, req.NamedMountsFromAnnotation = nil, false
	// The capability's other access type, and a reference secret.
	block := proto.Clone(req).(*agentv1.PrepareRequest)
	sp := block.Volumes[0].Source.CsiVolume.StaticProvisioning
	sp.VolumeCapability.AccessType = nil
	populateOneof(t, sp.VolumeCapability.ProtoReflect(), "block")
	for _, r := range []*agentv1.PrepareRequest{req, block} {
		sameJSON(t, "PrepareRequest", r, PrepareRequest(r))
	}

	m := &statev1.ContainerMount{}
	populate(t, m.ProtoReflect(), 0)
	sameJSON(t, "ContainerMount", m, Mounts([]*statev1.ContainerMount{m})[0])
	r := &statev1.ReclaimResult{}
	populate(t, r.ProtoReflect(), 0)
	sameJSON(t, "ReclaimResult", r, ReclaimResult(r))

	now := time.Unix(1700000000, 5).UTC()
	vol := isolator.VolumeInfo{}
	fill(reflect.ValueOf(&vol).Elem(), now)
	vol.LastReclaim = r
	vol.State = statev1.VolumeCheckpoint_PUBLISHED
	vs := VolumeStatus(vol)
	// Stats are the poller's, not the isolator's.
	unset(t, vs, "stats")
	ctr := isolator.ContainerInfo{Mounts: []*statev1.ContainerMount{m}}
	fill(reflect.ValueOf(&ctr).Elem(), now)
	ctr.Phase = statev1.ContainerCheckpoint_CLEANING
	unset(t, ContainerStatus(ctr))
	if got := vs.GetState().String(); got != "PUBLISHED" {
		t.Errorf("state %s, want PUBLISHED", got)
	}

	in := &supervisor.InstanceStatus{}
	fill(reflect.ValueOf(in).Elem(), now)
	in.State = supervisor.StateBackoff
	p := &supervisor.PluginStatus{Instances: []*supervisor.InstanceStatus{in}}
	fill(reflect.ValueOf(p).Elem(), now)
	ap := Plugin(p)
	// Reclaim totals are the schedules', capacity GetPlugin's, not the
	// supervisor's.
	unset(t, ap, "reclaim", "capacity")
	unset(t, ap.Instances[0])
	if got := ap.Instances[0].GetState(); got != agentv1.PluginState_PLUGIN_STATE_BACKOFF || got.String() != "PLUGIN_STATE_"+in.State.String() {
		t.Errorf("instance state %s, want PLUGIN_STATE_%s", got, in.State)
	}
	for st := supervisor.StateUnspecified; st <= supervisor.StateStopped; st++ {
		if got := agentv1.PluginState(st).String(); got != "PLUGIN_STATE_"+st.String() {
			t.Errorf("supervisor state %d is %s, the API's %s", st, st, got)
		}
	}
}

// populateOneof sets the named member of a oneof, populated.
func populateOneof(t *testing.T, m protoreflect.Message, name protoreflect.Name) {
	fd := m.Descriptor().Fields().ByName(name)
	populate(t, m.Mutable(fd).Message(), 1)
}

// fill sets every zero field of a struct to something other than zero.
func fill(v reflect.Value, now time.Time) {
	for i := range v.NumField() {
		f := v.Field(i)
		if !f.IsZero() {
			continue
		}
		switch f.Kind() {
		case reflect.String:
			f.SetString("v-" + v.Type().Field(i).Name)
		case reflect.Bool:
			f.SetBool(true)
		case reflect.Int32, reflect.Int, reflect.Int64:
			f.SetInt(1)
		case reflect.Map:
			if f.Type() == reflect.TypeOf(map[string]string{}) {
				f.Set(reflect.ValueOf(map[string]string{"k": "v"}))
			}
		case reflect.Uint32:
			f.SetUint(1)
		case reflect.Slice:
			if f.Type().Elem().Kind() == reflect.String {
				f.Set(reflect.ValueOf([]string{"c1"}))
			}
		case reflect.Struct:
			if f.Type() == reflect.TypeOf(now) {
				f.Set(reflect.ValueOf(now))
			}
		}
	}
}

// unset fails unless every field of m is set but those named.
func unset(t *testing.T, m proto.Message, except ...protoreflect.Name) {
	t.Helper()
	fields := m.ProtoReflect().Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if !m.ProtoReflect().Has(fd) && !slices.Contains(except, fd.Name()) {
			t.Errorf("%s.%s is not converted", m.ProtoReflect().Descriptor().Name(), fd.Name())
		}
	}
}
