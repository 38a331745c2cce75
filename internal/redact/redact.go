package redact

import (
	"bytes"
	"encoding/json"
	"log/slog"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
)

// Stripped replaces the value of each string or bytes secret.
const Stripped = "***stripped***"

// anyName is the full name of google.protobuf.Any, whose packed message is
// redacted too.
const anyName protoreflect.FullName = "google.protobuf.Any"

// Message returns a deep copy of m with every csi_secret field stripped,
// at any depth, and unknown fields dropped; see the package doc. A nil m
// gives nil.
func Message(m proto.Message) proto.Message {
	if m == nil {
		return nil
	}
	c := proto.Clone(m)
	if r := c.ProtoReflect(); r.IsValid() {
		redactMessage(r)
	}
	return c
}

// isSecret reports whether fd is marked (csi.v1.csi_secret) = true.
func isSecret(fd protoreflect.FieldDescriptor) bool {
	opts := fd.Options()
	if opts == nil {
		return false
	}
	secret, _ := proto.GetExtension(opts, csi.E_CsiSecret).(bool)
	return secret
}

// redactMessage strips the secrets of m, a mutable copy, in place.
func redactMessage(m protoreflect.Message) {
	if m.Descriptor().FullName() == anyName {
		redactAny(m)
		return
	}
	m.SetUnknown(nil)
	m.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case isSecret(fd):
			strip(m, fd, v)
		case fd.IsMap():
			if fd.MapValue().Message() != nil {
				v.Map().Range(func(_ protoreflect.MapKey, mv protoreflect.Value) bool {
					redactMessage(mv.Message())
					return true
				})
			}
		case fd.IsList():
			if fd.Message() != nil {
				l := v.List()
				for i := range l.Len() {
					redactMessage(l.Get(i).Message())
				}
			}
		case fd.Message() != nil:
			redactMessage(v.Message())
		}
		return true
	})
}

// strip replaces the value v of the secret field fd of m, keeping map keys
// and list lengths.
func strip(m protoreflect.Message, fd protoreflect.FieldDescriptor, v protoreflect.Value) {
	switch {
	case fd.IsMap():
		mp := v.Map()
		mp.Range(func(k protoreflect.MapKey, _ protoreflect.Value) bool {
			mp.Set(k, placeholder(fd.MapValue(), mp.NewValue))
			return true
		})
	case fd.IsList():
		l := v.List()
		for i := range l.Len() {
			l.Set(i, placeholder(fd, l.NewElement))
		}
	default:
		m.Set(fd, placeholder(fd, func() protoreflect.Value { return m.NewField(fd) }))
	}
}

// placeholder is what a secret value of field fd becomes; newMessage makes
// an empty message where one belongs.
func placeholder(fd protoreflect.FieldDescriptor, newMessage func() protoreflect.Value) protoreflect.Value {
	switch fd.Kind() {
	case protoreflect.StringKind:
		return protoreflect.ValueOfString(Stripped)
	case protoreflect.BytesKind:
		return protoreflect.ValueOfBytes([]byte(Stripped))
	case protoreflect.MessageKind, protoreflect.GroupKind:
		return newMessage()
	default:
		return fd.Default()
	}
}

// redactAny redacts the message packed in an Any. A value that cannot be
// resolved or decoded is dropped (the type URL stays): nothing says what
// it holds.
func redactAny(m protoreflect.Message) {
	m.SetUnknown(nil)
	fields := m.Descriptor().Fields()
	typeURL, value := fields.ByName("type_url"), fields.ByName("value")
	if typeURL == nil || value == nil || !m.Has(value) {
		return
	}
	redacted, err := func() ([]byte, error) {
		mt, err := protoregistry.GlobalTypes.FindMessageByURL(m.Get(typeURL).String())
		if err != nil {
			return nil, err
		}
		inner := mt.New()
		if err := proto.Unmarshal(m.Get(value).Bytes(), inner.Interface()); err != nil {
			return nil, err
		}
		redactMessage(inner)
		return proto.MarshalOptions{Deterministic: true}.Marshal(inner.Interface())
	}()
	if err != nil {
		m.Clear(value)
		return
	}
	m.Set(value, protoreflect.ValueOfBytes(redacted))
}

// Value returns a slog value for m: its redacted copy as compact protojson
// with proto field names, computed only when a handler emits the record.
// slog.JSONHandler embeds it as a JSON object, slog.TextHandler as a
// string. Usage:
//
//	logger.Debug("NodeStageVolume", "request", redact.Value(req))
func Value(m proto.Message) slog.LogValuer { return logValue{m} }

type logValue struct{ m proto.Message }

func (v logValue) LogValue() slog.Value {
	b, err := protojson.MarshalOptions{UseProtoNames: true}.Marshal(Message(v.m))
	if err != nil {
		return slog.StringValue("!ERROR redact: " + err.Error())
	}
	// protojson varies its whitespace on purpose; logs want one stable
	// line.
	var compact bytes.Buffer
	if err := json.Compact(&compact, b); err != nil {
		return slog.StringValue("!ERROR redact: " + err.Error())
	}
	return slog.AnyValue(jsonText(compact.Bytes()))
}

// jsonText is JSON that slog.JSONHandler embeds as is (json.Marshaler) and
// slog.TextHandler writes as a string (encoding.TextMarshaler).
type jsonText []byte

func (j jsonText) MarshalJSON() ([]byte, error) { return j, nil }
func (j jsonText) MarshalText() ([]byte, error) { return j, nil }
func (j jsonText) String() string               { return string(j) }
