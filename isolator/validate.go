package isolator

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

const (
	// maxContainerID bounds container ids, which become path components.
	maxContainerID = 128
	// maxEncodedID bounds a percent-encoded volume id (a path component).
	maxEncodedID = 255
)

// volumeKey identifies a volume: its plugin type and volume id.
type volumeKey struct {
	plugin, id string
}

func (k volumeKey) String() string { return k.plugin + "/" + k.id }

// plannedMount is one validated volume of a Prepare request.
type plannedMount struct {
	key           volumeKey
	static        *statev1.StaticProvisioning
	containerPath string
	readonly      bool // the container's mode is RO
	block         bool
}

// ValidateContainerID checks that a container id is safe as a path
// component.
func ValidateContainerID(id string) error { return ValidateID("container_id", id) }

// ValidateID checks an id of a container's (its field's name says which:
// container_id, a manager, an entry of a list) as a container id: safe as
// a path component. Errors name field.
func ValidateID(field, id string) error {
	switch {
	case id == "":
		return fmt.Errorf("%w: %s is required", ErrInvalid, field)
	case len(id) > maxContainerID:
		return fmt.Errorf("%w: %s is longer than %d bytes", ErrInvalid, field, maxContainerID)
	case id[0] == '.':
		return fmt.Errorf("%w: %s %q must not start with '.'", ErrInvalid, field, id)
	}
	for _, r := range id {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("._+-", r)) {
			return fmt.Errorf("%w: %s %q has the character %q; use letters, digits, '.', '_', '+' and '-'", ErrInvalid, field, id, r)
		}
	}
	return nil
}

// encodeVolumeID percent-encodes a volume id into one safe path component,
// as Mesos does: every byte but letters, digits, '-', '_' and a '.' that is
// not first is written %XX.
func encodeVolumeID(id string) string {
	var b strings.Builder
	for i := 0; i < len(id); i++ {
		c := id[i]
		if c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || (c == '.' && i > 0) {
			b.WriteByte(c)
		} else {
			fmt.Fprintf(&b, "%%%02X", c)
		}
	}
	return b.String()
}

// decodeVolumeID reverses encodeVolumeID. Only the canonical encoding is
// accepted (lower-case hex, "%41" for "A", a leading "." are not): each id
// has exactly one directory, so two directories can never claim one volume.
func decodeVolumeID(s string) (string, error) {
	id, err := decodeVolumeIDLoose(s)
	if err != nil {
		return "", err
	}
	if encodeVolumeID(id) != s {
		return "", fmt.Errorf("%q is not the canonical percent-encoding of a volume id", s)
	}
	return id, nil
}

func decodeVolumeIDLoose(s string) (string, error) {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '%' {
			b.WriteByte(s[i])
			continue
		}
		var c byte
		if i+2 >= len(s) {
			return "", fmt.Errorf("bad percent-encoding in %q", s)
		}
		if _, err := fmt.Sscanf(s[i+1:i+3], "%02X", &c); err != nil {
			return "", fmt.Errorf("bad percent-encoding in %q: %w", s, err)
		}
		b.WriteByte(c)
		i += 2
	}
	return b.String(), nil
}

// VolumeError is the refusal of a Prepare request because of one of its
// volumes, volumes[Index]; a caller that added volumes of its own to the
// request (named mounts) sets Name to call it as its user does. Err says
// why and wraps the class (ErrInvalid, ErrUnknownPlugin, ...), which the
// message puts first, as in every refusal: "invalid request: volumes[2]:
// container_path is required".
type VolumeError struct {
	Index int
	Name  string
	Err   error
}

func (e *VolumeError) Error() string {
	name := e.Name
	if name == "" {
		name = fmt.Sprintf("volumes[%d]", e.Index)
	}
	msg := e.Err.Error()
	for _, class := range []error{ErrInvalid, ErrUnknownPlugin, ErrUnavailable, ErrPrecondition} {
		if rest, ok := strings.CutPrefix(msg, class.Error()+": "); ok && errors.Is(e.Err, class) {
			return class.Error() + ": " + name + ": " + rest
		}
	}
	return name + ": " + msg
}

func (e *VolumeError) Unwrap() error { return e.Err }

// plan validates a Prepare request. Messages follow Mesos's volume/csi
// isolator where it has one.
func (iso *Isolator) plan(req *statev1.PrepareRequest) ([]plannedMount, error) {
	if err := ValidateContainerID(req.GetContainerId()); err != nil {
		return nil, err
	}
	if len(req.GetVolumes()) == 0 {
		return nil, fmt.Errorf("%w: no volumes", ErrInvalid)
	}
	for name, dir := range map[string]string{"rootfs": req.GetRootfs(), "sandbox": req.GetSandbox()} {
		if dir != "" && !filepath.IsAbs(dir) {
			return nil, fmt.Errorf("%w: %s %q must be an absolute path", ErrInvalid, name, dir)
		}
	}
	seen := map[volumeKey]bool{}
	var out []plannedMount
	for i, v := range req.GetVolumes() {
		field := func(format string, args ...any) error {
			return &VolumeError{Index: i, Err: fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))}
		}
		if t := v.GetSource().GetType(); t != statev1.Volume_Source_CSI_VOLUME {
			if statev1.Volume_Source_Type_name[int32(t)] == "" {
				return nil, field("source.type %d is not a Mesos volume source type; csi-agent handles CSI_VOLUME volumes only", int32(t))
			}
			return nil, field("source.type is %s; csi-agent handles CSI_VOLUME volumes only", t)
		}
		csiVol := v.GetSource().GetCsiVolume()
		if csiVol == nil {
			return nil, field("source.csi_volume is missing")
		}
		plugin := csiVol.GetPluginName()
		if plugin == "" {
			return nil, field("source.csi_volume.plugin_name is required")
		}
		if _, err := iso.cfg.Plugins.Lookup(plugin); err != nil {
			return nil, &VolumeError{Index: i, Err: err}
		}
		static := csiVol.GetStaticProvisioning()
		if static == nil {
			return nil, field("'static_provisioning' is missing: csi-agent serves pre-provisioned volumes only")
		}
		id := static.GetVolumeId()
		switch {
		case id == "":
			return nil, field("static_provisioning.volume_id is required")
		case len(encodeVolumeID(id)) > maxEncodedID:
			return nil, field("static_provisioning.volume_id is too long")
		}
		capability := static.GetVolumeCapability()
		if capability == nil || capability.GetAccessMode() == nil || capability.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_UNKNOWN {
			return nil, field("static_provisioning.volume_capability with an access_mode is required")
		}
		if m := capability.GetAccessMode().GetMode(); csi.VolumeCapability_AccessMode_Mode_name[int32(m)] == "" {
			return nil, field("static_provisioning.volume_capability.access_mode.mode %d is not a CSI access mode", int32(m))
		}
		if capability.GetBlock() == nil && capability.GetMount() == nil {
			return nil, field("static_provisioning.volume_capability needs an access type: \"mount\" or \"block\"")
		}
		var readonly bool
		switch v.GetMode() {
		case statev1.Volume_RW:
		case statev1.Volume_RO:
			readonly = true
		case statev1.Volume_MODE_UNKNOWN:
			return nil, field("mode is required: RW or RO")
		default:
			return nil, field("mode %d is not RW or RO", int32(v.GetMode()))
		}
		if readOnlyAccess(capability) && !readonly {
			return nil, fmt.Errorf("%w: Cannot use the read-only volume '%s' in read-write mode", ErrInvalid, id)
		}
		if static.GetReadonly() && !readonly {
			return nil, field("static_provisioning.readonly is true (the volume is published read-only) but mode is RW: use mode RO, or drop readonly")
		}
		key := volumeKey{plugin, id}
		if seen[key] {
			return nil, fmt.Errorf("%w: Found duplicate CSI volume with plugin '%s' and volume ID '%s'", ErrInvalid, plugin, id)
		}
		seen[key] = true
		cp := v.GetContainerPath()
		switch {
		case cp == "":
			return nil, field("container_path is required")
		case strings.ContainsRune(cp, 0):
			return nil, field("container_path contains a NUL byte")
		case filepath.IsAbs(cp) && req.GetRootfs() == "":
			// The container shares the host's root: the path must exist.
			if _, err := os.Stat(cp); err != nil {
				return nil, fmt.Errorf("%w: Absolute container path '%s' does not exist", ErrInvalid, cp)
			}
		case !filepath.IsAbs(cp) && req.GetSandbox() == "":
			return nil, field("container_path %q is relative: the request needs a sandbox to resolve it in", cp)
		}
		out = append(out, plannedMount{
			key: key, static: static, containerPath: cp, readonly: readonly, block: capability.GetBlock() != nil,
		})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].key.String() < out[j].key.String() })
	return out, nil
}

// readOnlyAccess reports whether a capability allows reading only.
func readOnlyAccess(c *csi.VolumeCapability) bool {
	switch c.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		return true
	}
	return false
}

// singleUser reports whether a capability allows one container at a time:
// SINGLE_NODE_SINGLE_WRITER (published once, read-write, at a time; a
// second container, even read-only, would share that publication).
func singleUser(c *csi.VolumeCapability) bool {
	return c.GetAccessMode().GetMode() == csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER
}

// singleWriter reports whether a capability allows a single writer:
// SINGLE_NODE_SINGLE_WRITER, SINGLE_NODE_WRITER, MULTI_NODE_SINGLE_WRITER.
func singleWriter(c *csi.VolumeCapability) bool {
	switch c.GetAccessMode().GetMode() {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_MULTI_NODE_SINGLE_WRITER:
		return true
	}
	return false
}

// sameUse reports whether two requests for one volume are compatible:
// the same capability and context (secrets may differ: a later user's are
// not needed once the volume is published).
func sameUse(a, b *statev1.StaticProvisioning) bool {
	return proto.Equal(a.GetVolumeCapability(), b.GetVolumeCapability()) && a.GetReadonly() == b.GetReadonly() &&
		proto.Equal(&statev1.StaticProvisioning{VolumeContext: a.GetVolumeContext()}, &statev1.StaticProvisioning{VolumeContext: b.GetVolumeContext()})
}
