package namedvol

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"strconv"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csiagent/csiagent/internal/bytesize"
)

// Provisioning options: a definition with size (and no volume_id) has the
// agent create its backend volume with the plugin's CreateVolume.
const (
	// KeySize is the new volume's capacity (required_bytes), as 10GiB or
	// bytes.
	KeySize = "size"
	// KeyFromSnapshot and KeyFromVolume give the new volume the content of
	// a snapshot or another volume (the plugin's ids).
	KeyFromSnapshot = "from_snapshot"
	KeyFromVolume   = "from_volume"
	// KeyDeleteOnRemove: an engine's removal (docker volume rm) deletes
	// the backend volume (DeleteVolume) too; without it the backend volume
	// is kept.
	KeyDeleteOnRemove = "delete_on_remove"
	// ParamPrefix starts the keys of CreateVolume parameters.
	ParamPrefix = "param."
)

// Provisioning states.
const (
	// ProvisionCreating: the intent, recorded before CreateVolume. A
	// definition in it has no volume id and cannot be mounted; creating it
	// again with the same options (or the agent's start) finishes it: the
	// plugin finds the volume by its name (CSIName), never makes a second.
	ProvisionCreating = "creating"
	// ProvisionCreated: CreateVolume answered; VolumeID is its id.
	ProvisionCreated = "created"
)

// ErrCreating marks a definition whose backend volume is still being
// created (or whose creation was interrupted).
var ErrCreating = errors.New("volume is being created")

// ErrNotCreated marks a failed creation after which the plugin has made
// no volume: refused before CreateVolume, or answered with a code that
// says the plugin did not act (InvalidArgument, OutOfRange,
// ResourceExhausted, NotFound, Unimplemented, PermissionDenied,
// Unauthenticated). A creation that fails so is no intent to finish.
var ErrNotCreated = errors.New("no volume was created")

// Provision is how the agent creates a definition's backend volume.
type Provision struct {
	// State is ProvisionCreating or ProvisionCreated.
	State string `json:"state"`
	// CSIName is CreateVolume's name (see CSIName), fixed with the
	// intent.
	CSIName string `json:"csi_name"`
	// Size is the capacity asked for, in bytes.
	Size int64 `json:"size"`
	// Parameters are CreateVolume's parameters.
	Parameters map[string]string `json:"parameters,omitempty"`
	// FromSnapshot and FromVolume are the content source, if any.
	FromSnapshot string `json:"from_snapshot,omitempty"`
	FromVolume   string `json:"from_volume,omitempty"`
	// DeleteOnRemove: see KeyDeleteOnRemove.
	DeleteOnRemove bool `json:"delete_on_remove,omitempty"`
	// AccessibleTopology is CreateVolume's answer: where the volume can be
	// used (empty: everywhere).
	AccessibleTopology []map[string]string `json:"accessible_topology,omitempty"`
}

func isProvisionKey(k string) bool {
	return k == KeySize || k == KeyFromSnapshot || k == KeyFromVolume || k == KeyDeleteOnRemove || (strings.HasPrefix(k, ParamPrefix) && len(k) > len(ParamPrefix))
}

// parseProvisionOption sets one provisioning option.
func (d *Definition) parseProvisionOption(k, v string) error {
	if d.Provision == nil {
		d.Provision = &Provision{}
	}
	p := d.Provision
	switch {
	case k == KeySize:
		n, err := bytesize.Parse(v)
		if err != nil || n <= 0 {
			return fmt.Errorf("%w: option %s=%q: expected a size such as 10GiB or 1073741824", ErrInvalid, k, Clip(v))
		}
		p.Size = n
	case k == KeyFromSnapshot:
		p.FromSnapshot = v
	case k == KeyFromVolume:
		p.FromVolume = v
	case k == KeyDeleteOnRemove:
		b, err := parseBool(k, v)
		if err != nil {
			return err
		}
		p.DeleteOnRemove = b
	default:
		if p.Parameters == nil {
			p.Parameters = map[string]string{}
		}
		p.Parameters[strings.TrimPrefix(k, ParamPrefix)] = v
	}
	return nil
}

// validateProvision checks the volume id against provisioning: a
// pre-provisioned volume needs one; a provisioned one gets one from
// CreateVolume (none asked for, one once created).
func (d *Definition) validateProvision() error {
	p := d.Provision
	if p == nil {
		if d.VolumeID == "" {
			return fmt.Errorf("%w: option %s is required (the pre-provisioned volume's id), or %s to create one", ErrInvalid, KeyVolumeID, KeySize)
		}
		return nil
	}
	switch {
	case p.Size <= 0:
		return fmt.Errorf("%w: option %s is required to create a volume (with %s, %s, %s or %s)", ErrInvalid, KeySize, KeyFromSnapshot, KeyFromVolume, ParamPrefix+"KEY", KeyDeleteOnRemove)
	case p.FromSnapshot != "" && p.FromVolume != "":
		return fmt.Errorf("%w: options %s and %s exclude each other (one content source)", ErrInvalid, KeyFromSnapshot, KeyFromVolume)
	case p.State == "" && d.VolumeID != "":
		return fmt.Errorf("%w: options %s (an existing volume) and %s (create one) exclude each other", ErrInvalid, KeyVolumeID, KeySize)
	case p.State == "" && len(d.VolumeContext) > 0:
		return fmt.Errorf("%w: options %s are for an existing volume: a created volume's context is the plugin's answer (use %s for CreateVolume)", ErrInvalid, ContextPrefix+"KEY", ParamPrefix+"KEY")
	case p.State == ProvisionCreated && d.VolumeID == "":
		return fmt.Errorf("%w: %s: created, but no volume id recorded", ErrInvalid, d.Name)
	}
	return nil
}

// options adds the provisioning options to a definition's Options.
func (p *Provision) options(set func(k, v string)) {
	if p == nil {
		return
	}
	set(KeySize, strconv.FormatInt(p.Size, 10))
	set(KeyFromSnapshot, p.FromSnapshot)
	set(KeyFromVolume, p.FromVolume)
	if p.DeleteOnRemove {
		set(KeyDeleteOnRemove, "true")
	}
	for k, v := range p.Parameters {
		set(ParamPrefix+k, v)
	}
}

// topology is the recorded accessible topology in CSI's terms.
func (p *Provision) topology() []*csi.Topology {
	if p == nil {
		return nil
	}
	var out []*csi.Topology
	for _, seg := range p.AccessibleTopology {
		out = append(out, &csi.Topology{Segments: maps.Clone(seg)})
	}
	return out
}

// Creating reports whether the backend volume is not created yet.
func (d *Definition) Creating() bool {
	return d.Provision != nil && d.Provision.State != ProvisionCreated
}

// CheckUsable refuses a definition whose backend volume is not created
// (ErrCreating).
func (d *Definition) CheckUsable() error {
	if d.Creating() {
		return fmt.Errorf("volume %s: %w: its creation did not finish; create it again with the same options (csi-agent volume create, docker volume create) to finish it", d.Name, ErrCreating)
	}
	return nil
}

// SameRequest reports whether d and other ask for the same volume: other
// is a new request (no state, no id), d may be created already.
func (d *Definition) SameRequest(other *Definition) bool {
	a, b := *d, *other
	a.Creator, b.Creator = "", ""
	a.VolumeID, b.VolumeID = "", ""
	a.VolumeContext, b.VolumeContext = nil, nil
	if d.Provision == nil || other.Provision == nil {
		return false
	}
	pa, pb := *a.Provision, *b.Provision
	pa.State, pb.State = "", ""
	pa.CSIName, pb.CSIName = "", ""
	pa.AccessibleTopology, pb.AccessibleTopology = nil, nil
	a.Provision, b.Provision = &pa, &pb
	return sameDefinition(&a, &b)
}

// Created records CreateVolume's answer: the volume's id, its context
// (added to the requested one) and where it is accessible.
func (d *Definition) Created(id string, volumeContext map[string]string, topology []*csi.Topology) {
	d.VolumeID = id
	if len(volumeContext) > 0 {
		if d.VolumeContext == nil {
			d.VolumeContext = map[string]string{}
		}
		maps.Copy(d.VolumeContext, volumeContext)
	}
	d.Provision.State = ProvisionCreated
	d.Provision.AccessibleTopology = nil
	for _, t := range topology {
		d.Provision.AccessibleTopology = append(d.Provision.AccessibleTopology, maps.Clone(t.GetSegments()))
	}
}

// maxCSIName bounds the names the agent gives CreateVolume: CSI's limit
// on a name is 128 bytes.
const maxCSIName = 128

// CSIName is the name CreateVolume is given for the named volume name of
// node nodeID, made once with the creation's intent (nonce: random, drawn
// then) and recorded with it: the creation repeated after a crash finds
// the volume it made; another node's volume of the same name on shared
// storage, or a later creation under a name whose volume was kept (volume
// rm without --delete), is another volume, never one with someone else's
// data. "csi-agent-NAME-HASH", HASH the first 8 bytes of SHA-256(node id,
// name, nonce, NUL-separated) in hex, NAME cut to keep within CSI's 128
// bytes.
func CSIName(name, nodeID, nonce string) string {
	const prefix = "csi-agent-"
	sum := sha256.Sum256([]byte(nodeID + "\x00" + name + "\x00" + nonce))
	h := hex.EncodeToString(sum[:8])
	if room := maxCSIName - len(prefix) - len(h) - 1; len(name) > room {
		name = name[:room]
	}
	return prefix + name + "-" + h
}
