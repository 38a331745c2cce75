package namedvol

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// ErrInvalid marks a definition or option that is malformed.
var ErrInvalid = errors.New("invalid named volume")

const (
	// MaxName bounds a volume's name (a file name and part of engine
	// paths).
	MaxName = 128
	// MaxValue bounds every option value.
	MaxValue = 1024
	// MaxDefinition bounds a definition as Store.Create takes it: its
	// Options encoded as JSON, the form in which engines send it and Get
	// and List answer with it. CSI's general limit for a map<string,
	// string> (volume_context) is 4 KiB and the other fields are short, so
	// 64 KiB leaves room for plugins beyond the spec's limits while one
	// definition stays a small part of an answer.
	MaxDefinition = 64 << 10
)

// Option keys, as Mesos and CSI name the fields.
const (
	KeyPlugin        = "plugin"
	KeyVolumeID      = "volume_id"
	KeyFSType        = "fs_type"
	KeyBlock         = "block"
	KeyAccessMode    = "access_mode"
	KeyMountFlags    = "mount_flags"
	KeyStageSecret   = "stage_secret"
	KeyPublishSecret = "publish_secret"
	// KeyAllowAnnotations lets containers name the volume in the
	// csi.csiagent.io/mounts annotation (false when absent).
	KeyAllowAnnotations = "allow_annotations"
	// KeyShareEngineMounts lets annotation users have the volume while
	// engine mounts hold it (false when absent; needs allow_annotations).
	KeyShareEngineMounts = "share_engine_mounts"
	// KeyUID and KeyGID are the user engine containers run as (docker run
	// -u UID:GID): a fresh volume's root is given to them at its engine
	// mount, as the OCI hook does with the container's process.user. Both
	// or neither.
	KeyUID = "uid"
	KeyGID = "gid"
	// KeyControllerPublishSecret is the secret reference of
	// ControllerPublishVolume and ControllerUnpublishVolume (a plugin that
	// attaches).
	KeyControllerPublishSecret = "controller_publish_secret"
	// ContextPrefix starts the keys of volume_context entries.
	ContextPrefix = "context."
)

var knownKeys = []string{KeyPlugin, KeyVolumeID, KeyFSType, KeyBlock, KeyAccessMode, KeyMountFlags, KeyStageSecret, KeyPublishSecret, KeyControllerPublishSecret,
	KeyAllowAnnotations, KeyShareEngineMounts, KeyUID, KeyGID, ContextPrefix + "KEY",
	KeySize, KeyFromSnapshot, KeyFromVolume, KeyDeleteOnRemove, ParamPrefix + "KEY"}

// Definition is a named volume.
type Definition struct {
	Name     string `json:"name"`
	Plugin   string `json:"plugin"`
	VolumeID string `json:"volume_id"`
	// FSType is the mount capability's fs_type ("" lets the plugin choose);
	// Block asks for a raw block device instead.
	FSType string `json:"fs_type,omitempty"`
	Block  bool   `json:"block,omitempty"`
	// AccessMode is a CSI access mode name; SINGLE_NODE_WRITER when empty.
	AccessMode    string            `json:"access_mode,omitempty"`
	MountFlags    []string          `json:"mount_flags,omitempty"`
	VolumeContext map[string]string `json:"volume_context,omitempty"`
	// StageSecret and PublishSecret are secret references NAME/KEY,
	// resolved by the agent from its secrets directory; the values are
	// never stored here.
	StageSecret   string `json:"stage_secret,omitempty"`
	PublishSecret string `json:"publish_secret,omitempty"`
	// ControllerPublishSecret likewise, for ControllerPublishVolume.
	ControllerPublishSecret string `json:"controller_publish_secret,omitempty"`
	// AllowAnnotations lets containers name the volume in the
	// csi.csiagent.io/mounts annotation, which whoever creates a container
	// (with CRI-O, a pod) may set: the operator's choice per volume.
	// Definitions stored before the field existed lack it: not allowed.
	AllowAnnotations bool `json:"allow_annotations,omitempty"`
	// ShareEngineMounts lets annotation users have the volume while engine
	// mounts (docker run -v NAME:...) hold it; without it the hook refuses
	// a volume an engine has mounted.
	ShareEngineMounts bool `json:"share_engine_mounts,omitempty"`
	// UID and GID (decimal; both or neither) are who engine containers run
	// as: a fresh volume's root is given to them (see KeyUID).
	UID string `json:"uid,omitempty"`
	GID string `json:"gid,omitempty"`
	// Creator is who defined it: an engine (docker, podman, other for a
	// peer of the plugin socket the agent did not recognise) or CreatorAPI.
	// Engines share one name space; an engine may remove only what it
	// created (CheckRemove). Definitions stored before the field existed
	// lack it: any may remove them, as then. Not an option: the agent sets
	// it.
	Creator string `json:"creator,omitempty"`
	// Provision is set when the agent creates the backend volume
	// (CreateVolume) instead of naming a pre-provisioned one: see
	// provision.go.
	Provision *Provision `json:"provision,omitempty"`
}

// The engines the agent tells apart by the peer of its volume plugin
// socket: creators of definitions and makers of engine mounts.
const (
	EngineDocker = "docker"
	EnginePodman = "podman"
	// EngineUnknown names, where one is shown, an engine the agent did not
	// recognise (its mounts are recorded with engine "").
	EngineUnknown = "other"
)

// EngineMountPrefix starts the isolator container id of every engine
// mount (dockerplugin); the agent API refuses such ids from its callers.
const EngineMountPrefix = "engine+"

// CreatorAPI is the Creator of definitions made through the agent's API
// (csi-agent volume create).
const CreatorAPI = "csi-agent"

// ErrOtherCreator marks a removal an engine may not make: another
// engine, or the operator through the API, created the definition.
var ErrOtherCreator = errors.New("created by someone else")

// CheckRemove refuses engine's removal (docker volume rm) of a definition
// another creator made: Docker, Podman and the API share one name space,
// and one engine's rm would take a volume from under the other's
// containers and records. Definitions without a Creator are anyone's.
func (d *Definition) CheckRemove(engine string) error {
	if d.Creator == "" || d.Creator == engine {
		return nil
	}
	how := "csi-agent volume rm " + d.Name
	switch d.Creator {
	case CreatorAPI:
	case EngineDocker, EnginePodman:
		how = fmt.Sprintf("%s volume rm %s (or %s as root)", d.Creator, d.Name, how)
	default:
		how = fmt.Sprintf("the engine that created it (or %s as root)", how)
	}
	return fmt.Errorf("volume %s was created by %s, not %s: %w; the engines share one name space of volumes, and each removes only its own: remove it with %s", d.Name, d.Creator, engine, ErrOtherCreator, how)
}

// ParseOptions makes a definition from engine options (docker volume
// create --opt KEY=VALUE): the keys are the constants above; mount_flags
// is a comma-separated list. Unknown keys, missing plugin or volume_id
// and bad values are errors naming the key.
func ParseOptions(name string, opts map[string]string) (*Definition, error) {
	d := &Definition{Name: name}
	keys := make([]string, 0, len(opts))
	for k := range opts {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := opts[k]
		switch {
		case k == KeyPlugin:
			d.Plugin = v
		case k == KeyVolumeID:
			d.VolumeID = v
		case k == KeyFSType:
			d.FSType = v
		case k == KeyBlock:
			switch v {
			case "true", "":
				d.Block = true
			case "false":
			default:
				return nil, fmt.Errorf("%w: option %s=%q: expected true or false", ErrInvalid, k, Clip(v))
			}
		case k == KeyAllowAnnotations || k == KeyShareEngineMounts:
			b, err := parseBool(k, v)
			if err != nil {
				return nil, err
			}
			if k == KeyAllowAnnotations {
				d.AllowAnnotations = b
			} else {
				d.ShareEngineMounts = b
			}
		case k == KeyAccessMode:
			d.AccessMode = v
		case k == KeyMountFlags:
			if v != "" {
				d.MountFlags = strings.Split(v, ",")
			}
		case k == KeyUID:
			d.UID = v
		case k == KeyGID:
			d.GID = v
		case k == KeyStageSecret:
			d.StageSecret = v
		case k == KeyPublishSecret:
			d.PublishSecret = v
		case k == KeyControllerPublishSecret:
			d.ControllerPublishSecret = v
		case isProvisionKey(k):
			if err := d.parseProvisionOption(k, v); err != nil {
				return nil, err
			}
		case strings.HasPrefix(k, ContextPrefix) && len(k) > len(ContextPrefix):
			if d.VolumeContext == nil {
				d.VolumeContext = map[string]string{}
			}
			d.VolumeContext[strings.TrimPrefix(k, ContextPrefix)] = v
		default:
			return nil, fmt.Errorf("%w: unknown option %q; known options: %s", ErrInvalid, Clip(k), strings.Join(knownKeys, ", "))
		}
	}
	if err := d.Validate(); err != nil {
		return nil, err
	}
	return d, nil
}

// parseBool reads the value of a boolean option: true or false, nothing
// else (not even "", which block takes for true).
func parseBool(key, v string) (bool, error) {
	switch v {
	case "true":
		return true, nil
	case "false":
		return false, nil
	}
	return false, fmt.Errorf("%w: option %s=%q: expected true or false", ErrInvalid, key, Clip(v))
}

// Options is the inverse of ParseOptions: the definition as engine
// options, for display.
func (d *Definition) Options() map[string]string {
	o := map[string]string{KeyPlugin: d.Plugin, KeyVolumeID: d.VolumeID, KeyAccessMode: d.accessMode().String()}
	set := func(k, v string) {
		if v != "" {
			o[k] = v
		}
	}
	set(KeyFSType, d.FSType)
	if d.Block {
		o[KeyBlock] = "true"
	}
	if d.AllowAnnotations {
		o[KeyAllowAnnotations] = "true"
	}
	if d.ShareEngineMounts {
		o[KeyShareEngineMounts] = "true"
	}
	set(KeyMountFlags, strings.Join(d.MountFlags, ","))
	set(KeyStageSecret, d.StageSecret)
	set(KeyPublishSecret, d.PublishSecret)
	set(KeyControllerPublishSecret, d.ControllerPublishSecret)
	d.Provision.options(set)
	set(KeyUID, d.UID)
	set(KeyGID, d.GID)
	for k, v := range d.VolumeContext {
		o[ContextPrefix+k] = v
	}
	return o
}

// Size is the length of the definition's Options encoded as JSON, what
// MaxDefinition bounds.
func (d *Definition) Size() int {
	b, _ := json.Marshal(d.Options()) // a map of strings always encodes
	return len(b)
}

// ValidateName checks a volume name: letters, digits, '_', '.', '-', not
// starting with '.' or '-', at most MaxName bytes.
func ValidateName(name string) error {
	switch {
	case name == "":
		return fmt.Errorf("%w: a name is required", ErrInvalid)
	case len(name) > MaxName:
		return fmt.Errorf("%w: name %q... is %d bytes, longer than %d", ErrInvalid, name[:32], len(name), MaxName)
	case name[0] == '.' || name[0] == '-':
		return fmt.Errorf("%w: name %q must start with a letter, a digit or '_'", ErrInvalid, name)
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("._-", r)) {
			return fmt.Errorf("%w: name %q has the character %q; use letters, digits, '.', '_' and '-'", ErrInvalid, name, r)
		}
	}
	return nil
}

// Validate checks a definition, naming the option that is wrong.
func (d *Definition) Validate() error {
	if err := ValidateName(d.Name); err != nil {
		return err
	}
	if d.Plugin == "" {
		return fmt.Errorf("%w: option %s is required (the CSI plugin's type)", ErrInvalid, KeyPlugin)
	}
	if err := d.validateProvision(); err != nil {
		return err
	}
	check := func(key, v string) error {
		if len(v) > MaxValue {
			return fmt.Errorf("%w: option %s is %d bytes, longer than %d", ErrInvalid, Clip(key), len(v), MaxValue)
		}
		if strings.ContainsRune(v, 0) {
			return fmt.Errorf("%w: option %s contains a NUL byte", ErrInvalid, Clip(key))
		}
		return nil
	}
	for k, v := range d.Options() {
		if err := check(k, v); err != nil {
			return err
		}
	}
	for k := range d.VolumeContext {
		if err := check(ContextPrefix+"KEY", k); err != nil {
			return err
		}
	}
	if d.Block && d.FSType != "" {
		return fmt.Errorf("%w: options %s and %s exclude each other", ErrInvalid, KeyBlock, KeyFSType)
	}
	if d.ShareEngineMounts && !d.AllowAnnotations {
		return fmt.Errorf("%w: option %s needs %s=true (it lets annotation users share the volume with engine mounts)", ErrInvalid, KeyShareEngineMounts, KeyAllowAnnotations)
	}
	if d.AccessMode != "" {
		if m, ok := csi.VolumeCapability_AccessMode_Mode_value[d.AccessMode]; !ok || m == 0 {
			return fmt.Errorf("%w: option %s=%q is not a CSI access mode (SINGLE_NODE_WRITER, SINGLE_NODE_READER_ONLY, MULTI_NODE_READER_ONLY, MULTI_NODE_SINGLE_WRITER, MULTI_NODE_MULTI_WRITER, SINGLE_NODE_SINGLE_WRITER, SINGLE_NODE_MULTI_WRITER)", ErrInvalid, KeyAccessMode, Clip(d.AccessMode))
		}
	}
	if (d.UID == "") != (d.GID == "") {
		return fmt.Errorf("%w: options %s and %s go together (the user and group engine containers run as)", ErrInvalid, KeyUID, KeyGID)
	}
	for key, v := range map[string]string{KeyUID: d.UID, KeyGID: d.GID} {
		if n, err := strconv.ParseUint(v, 10, 31); v != "" && (err != nil || strconv.FormatUint(n, 10) != v) {
			return fmt.Errorf("%w: option %s=%q: expected a decimal id below 2^31", ErrInvalid, key, Clip(v))
		}
	}
	if d.UID != "" && (d.Block || d.ReadOnly()) {
		return fmt.Errorf("%w: options %s and %s are for read-write filesystem volumes (a fresh root is given to that user)", ErrInvalid, KeyUID, KeyGID)
	}
	for key, ref := range map[string]string{KeyStageSecret: d.StageSecret, KeyPublishSecret: d.PublishSecret, KeyControllerPublishSecret: d.ControllerPublishSecret} {
		if ref == "" {
			continue
		}
		if _, _, err := splitSecret(ref); err != nil {
			return fmt.Errorf("%w: option %s: %w", ErrInvalid, key, err)
		}
	}
	return nil
}

// splitSecret parses a secret reference NAME/KEY.
func splitSecret(ref string) (name, key string, err error) {
	name, key, ok := strings.Cut(ref, "/")
	if !ok || name == "" || name == "." || name == ".." || key == "" || strings.Contains(key, "/") {
		return "", "", errors.New("expected a secret reference NAME/KEY (a file of the agent's secrets directory, not . or .., and a key in it)")
	}
	return name, key, nil
}

func (d *Definition) accessMode() csi.VolumeCapability_AccessMode_Mode {
	if m, ok := csi.VolumeCapability_AccessMode_Mode_value[d.AccessMode]; ok && m != 0 {
		return csi.VolumeCapability_AccessMode_Mode(m)
	}
	return csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
}

// ReadOnly reports whether the definition's access mode allows reading
// only: such a volume is published, and mounted, read-only.
func (d *Definition) ReadOnly() bool {
	switch d.accessMode() {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		return true
	}
	return false
}

// EngineUser is who engine containers of the volume run as, "UID:GID"
// (the PrepareRequest's user), "" when the definition does not say.
func (d *Definition) EngineUser() string {
	if d.UID == "" {
		return ""
	}
	return d.UID + ":" + d.GID
}

// Capability is the volume's capability: its access mode, and block or
// mount with the filesystem type and flags.
func (d *Definition) Capability() *csi.VolumeCapability {
	capability := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: d.accessMode()}}
	if d.Block {
		capability.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
	} else {
		capability.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: d.FSType, MountFlags: d.MountFlags}}
	}
	return capability
}

// Volume is the definition as the isolator's (Mesos's) CSI volume at
// containerPath; a read-only definition is always mounted read-only.
func (d *Definition) Volume(containerPath string, readonly bool) *statev1.Volume {
	static := &statev1.StaticProvisioning{VolumeId: d.VolumeID, VolumeCapability: d.Capability(), VolumeContext: d.VolumeContext}
	if d.StageSecret != "" {
		static.NodeStageSecrets = secretRef(d.StageSecret)
	}
	if d.PublishSecret != "" {
		static.NodePublishSecrets = secretRef(d.PublishSecret)
	}
	if d.ControllerPublishSecret != "" {
		static.ControllerPublishSecrets = secretRef(d.ControllerPublishSecret)
	}
	static.AccessibleTopology = d.Provision.topology()
	mode := statev1.Volume_RW
	if readonly || d.ReadOnly() {
		mode = statev1.Volume_RO
	}
	return &statev1.Volume{
		ContainerPath: containerPath,
		Mode:          mode,
		Source: &statev1.Volume_Source{
			Type:      statev1.Volume_Source_CSI_VOLUME,
			CsiVolume: &statev1.CSIVolume{PluginName: d.Plugin, StaticProvisioning: static},
		},
	}
}

// secretRef makes the one-entry secret map of a NAME/KEY reference: the
// CSI secret is called KEY.
func secretRef(ref string) map[string]*statev1.Secret {
	name, key, _ := splitSecret(ref)
	return map[string]*statev1.Secret{key: {
		Type:      statev1.Secret_REFERENCE,
		Reference: &statev1.Secret_Reference{Name: name, Key: key},
	}}
}

// Clip shortens user input an error quotes back (to 64 bytes).
func Clip(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
