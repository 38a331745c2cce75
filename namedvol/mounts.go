package namedvol

import (
	"errors"
	"fmt"
	"strings"
)

var (
	// ErrInUse marks a removal refused because engine mounts or
	// containers use the volume.
	ErrInUse = errors.New("named volume in use")
	// ErrAnnotationRefused marks a named volume the annotation policy
	// keeps from an annotation's container.
	ErrAnnotationRefused = errors.New("refused by the annotation policy")
)

// MountsAnnotation is the OCI annotation that names named volumes for a
// container (NAME:PATH[:ro];...), read by the OCI hook.
const MountsAnnotation = "csi.csiagent.io/mounts"

// Status is a named volume as the agent reports it: its definition and
// its use.
type Status struct {
	*Definition
	// State is its CSI volume's state in the agent (PUBLISHED, ...), or
	// NotPublished.
	State string
	// Containers is how many containers use its CSI volume.
	Containers int
	// EngineMounts are the ids of the engine mounts that hold it.
	EngineMounts []string
	// Mountpoint is where it is mounted for the engines, or "".
	Mountpoint string
}

// NotPublished is the State of a named volume whose CSI volume the agent
// does not track.
const NotPublished = "NOT_PUBLISHED"

// Creating is the State of a named volume whose backend volume is not
// created yet (Definition.Creating).
const Creating = "CREATING"

// Mount is a named volume asked for at a container path.
type Mount struct {
	Name, ContainerPath string
	ReadOnly            bool
}

// MountLabel is how errors name a request's named mount i (from 0): "named
// mount 2", or, for mounts from the annotation, "annotation
// csi.csiagent.io/mounts: mount 2".
func MountLabel(annotation bool, i int) string {
	if annotation {
		return fmt.Sprintf("annotation %s: mount %d", MountsAnnotation, i+1)
	}
	return fmt.Sprintf("named mount %d", i+1)
}

// ParseMounts parses NAME:PATH[:ro][;NAME:PATH[:ro]...], the form of the
// csi.csiagent.io/mounts annotation and of csi-agent prepare --mounts.
func ParseMounts(value string) ([]Mount, error) {
	var out []Mount
	for i, m := range strings.Split(value, ";") {
		parts := strings.Split(m, ":")
		ro := false
		if len(parts) == 3 && parts[2] == "ro" {
			ro, parts = true, parts[:2]
		}
		if len(parts) != 2 || parts[0] == "" || parts[1] == "" {
			return nil, fmt.Errorf("%w: mount %d %q: expected NAME:PATH or NAME:PATH:ro", ErrInvalid, i+1, Clip(m))
		}
		out = append(out, Mount{Name: parts[0], ContainerPath: parts[1], ReadOnly: ro})
	}
	return out, nil
}

// CheckAnnotationUse is the annotation policy of one named volume, given
// the engine mounts that hold it: it must allow annotations, and sharing
// with engine mounts while any holds it.
func (s Status) CheckAnnotationUse() error {
	if !s.AllowAnnotations {
		return fmt.Errorf("named volume %s may not be named in an annotation: %w: its definition lacks %s=true (definitions made before the option existed lack it too); "+
			"if any container that may be created here may have it, remove it (csi-agent volume rm %s) and recreate it with csi-agent volume create %s ... --allow-annotations "+
			"(docker volume create -d csi-agent --opt %s=true ...)", s.Name, ErrAnnotationRefused, KeyAllowAnnotations, s.Name, s.Name, KeyAllowAnnotations)
	}
	if len(s.EngineMounts) > 0 && !s.ShareEngineMounts {
		return fmt.Errorf("named volume %s is held by %d engine mount(s) (docker run -v %s:...): %w: an annotation user may not share it unless its definition has %s=true "+
			"(csi-agent volume create %s ... --allow-annotations --share-engine-mounts)", s.Name, len(s.EngineMounts), s.Name, ErrAnnotationRefused, KeyShareEngineMounts, s.Name)
	}
	return nil
}
