// Package redact makes protobuf messages safe to log: secrets never reach a
// log.
//
// A field is secret when its descriptor carries the CSI field option
// (csi.v1.csi_secret) = true, as CSI's own secrets fields, the csi-addons
// protos in proto/ and the agent API's node_stage_secrets,
// node_publish_secrets, controller_publish_secrets and the named volumes'
// CreateVolume and DeleteVolume secrets do. Message returns a deep copy in which every such
// field, at any depth (singular, repeated and map-valued messages, messages
// packed in a google.protobuf.Any whose type is linked in), shows which
// secrets were passed but not their values:
//
//   - map fields keep their keys; string and bytes values become
//     "***stripped***", message values become empty messages, other values
//     their zero value;
//   - singular and repeated string and bytes fields become "***stripped***"
//     (one per element), message fields empty messages, other kinds their
//     zero value.
//
// The copy also drops unknown fields at every depth, since nothing says
// whether they are secret, and the value of an Any whose type cannot be
// resolved. The original is never modified. No descriptor information is
// cached: each call reads the field options afresh.
//
// Value wraps a message for log/slog: the redacted copy is rendered as
// compact protojson (proto field names) only when a handler emits the
// record, so debug logging that is switched off costs nothing. The message
// must not be modified until the log call returns.
//
// When not to call it: a message whose type has no secret fields anywhere
// below it (the agent's responses, CSI's node responses) can be logged
// directly. Redaction is for logs and errors shown to people; never send
// the redacted copy to a plugin, which needs the real secrets.
package redact
