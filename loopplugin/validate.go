package loopplugin

import (
	"fmt"
	"path/filepath"
	"strings"
	"unicode"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/mount"
)

// MaxVolumeIDLength bounds volume ids (and CreateVolume names, which become
// ids). CSI guarantees 128 bytes for both; the image file name adds 4.
const MaxVolumeIDLength = 128

// DefaultFSType is the filesystem NodeStageVolume makes on a blank volume
// when the capability names none.
const DefaultFSType = "ext4"

// ValidateVolumeID checks that id can name an image file in the pool and
// nothing else: non-empty, at most MaxVolumeIDLength bytes, no path
// separator, no "..", no leading dot (the pool's temporary files start with
// one), no control characters.
func ValidateVolumeID(id string) error { return validateID("volume id", id) }

// validateID applies ValidateVolumeID's rules to the id of any object kept
// in the pool (volume groups, snapshots, group snapshots): what names them
// are file names too.
func validateID(what, id string) error {
	switch {
	case id == "":
		return invalidf("%s is empty", what)
	case len(id) > MaxVolumeIDLength:
		return invalidf("%s is %d bytes long, the limit is %d", what, len(id), MaxVolumeIDLength)
	case strings.ContainsRune(id, '/'):
		return invalidf("%s %q contains a path separator", what, id)
	case strings.Contains(id, ".."):
		return invalidf("%s %q contains \"..\"", what, id)
	case strings.HasPrefix(id, "."):
		return invalidf("%s %q starts with a dot", what, id)
	case strings.IndexFunc(id, unicode.IsControl) >= 0:
		return invalidf("%s %q contains a control character", what, id)
	}
	return nil
}

// requireID validates a required id field of a request.
func requireID(field, id string) error {
	if id == "" {
		return invalidf("%s is required", field)
	}
	return validateID(field, id)
}

// requireVolumeID validates the volume_id field of a request.
func requireVolumeID(id string) error {
	if id == "" {
		return invalidf("volume_id is required")
	}
	return ValidateVolumeID(id)
}

// requireAbsPath validates a required path field.
func requireAbsPath(field, p string) error {
	if p == "" {
		return invalidf("%s is required", field)
	}
	if !filepath.IsAbs(p) {
		return invalidf("%s %q is not an absolute path", field, p)
	}
	return nil
}

// ValidatePluginName checks the CSI rules for a plugin name: domain-name
// notation, at most 63 characters of [a-zA-Z0-9.-], starting and ending
// alphanumeric.
func ValidatePluginName(name string) error {
	alnum := func(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' }
	ok := name != "" && len(name) <= 63 && alnum(name[0]) && alnum(name[len(name)-1])
	for i := 0; ok && i < len(name); i++ {
		ok = alnum(name[i]) || name[i] == '.' || name[i] == '-'
	}
	if !ok {
		return fmt.Errorf("%w: plugin name %q: want at most 63 characters of [a-zA-Z0-9.-], starting and ending alphanumeric", ErrInvalid, name)
	}
	return nil
}

// access is a validated volume capability.
type access struct {
	block      bool
	fsType     string   // mount access only; DefaultFSType if unset
	mountFlags []string // mount access only
	mode       csi.VolumeCapability_AccessMode_Mode
}

// readOnlyMode reports whether the access mode only allows reading.
func (a access) readOnlyMode() bool {
	return a.mode == csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY || a.sharedReaders()
}

// sharedReaders reports whether nodes may read the volume at once (a
// shared pool): each attaches the image read-only, so none can write it
// (not even a journal replay).
func (a access) sharedReaders() bool {
	return a.mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
}

// mountOptions returns the options for mounting the staged filesystem.
func (a access) mountOptions() []string {
	if a.readOnlyMode() {
		return append(append([]string(nil), a.mountFlags...), "ro")
	}
	return a.mountFlags
}

// supportedMode reports whether a loop volume can serve the access mode:
// the single-node ones, and readers on many nodes of a shared pool.
func supportedMode(m csi.VolumeCapability_AccessMode_Mode, sharedPool bool) bool {
	switch m {
	case csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_READER_ONLY,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER,
		csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER:
		return true
	case csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY:
		return sharedPool
	}
	return false
}

// parseCapability validates a capability against what this plugin supports:
// a single-node access mode, block access, or mount access with a filesystem
// that has a mkfs on this host and mount flags that mount(2) takes.
func (p *Plugin) parseCapability(c *csi.VolumeCapability) (access, error) {
	if c == nil {
		return access{}, invalidf("volume_capability is required")
	}
	mode := c.GetAccessMode().GetMode()
	if !supportedMode(mode, p.sharedPool) {
		if mode == csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY {
			return access{}, invalidf("access mode %s is not supported: loop volumes are local to one node unless the pool is shared (--shared-pool)", mode)
		}
		return access{}, invalidf("access mode %s is not supported: loop volumes are local to one node (readers on many nodes of a shared pool excepted)", mode)
	}
	a := access{mode: mode}
	switch t := c.GetAccessType().(type) {
	case *csi.VolumeCapability_Block:
		a.block = true
	case *csi.VolumeCapability_Mount:
		a.fsType = t.Mount.GetFsType()
		if a.fsType == "" {
			a.fsType = DefaultFSType
		}
		if _, ok := p.tools.mkfs[a.fsType]; !ok {
			return access{}, invalidf("fs_type %q is not supported on this host (supported: %s)", a.fsType, strings.Join(p.tools.fsTypes(), ", "))
		}
		if _, _, err := mount.ParseOptions(t.Mount.GetMountFlags()); err != nil {
			return access{}, fmt.Errorf("%w: mount_flags: %w", ErrInvalid, err)
		}
		a.mountFlags = t.Mount.GetMountFlags()
	default:
		return access{}, invalidf("volume_capability needs an access type (block or mount)")
	}
	return a, nil
}

// stagedDiff reports why an existing staging mount (fstype and mountinfo
// per-mount options) differs from what a, staged again, would produce, or ""
// if it does not.
func (a access) stagedDiff(fsType, options string) string {
	if fsType != a.fsType {
		return fmt.Sprintf("staged with fs_type %s, requested %s", fsType, a.fsType)
	}
	// Compared: the per-mount flags, which the mount table shows exactly
	// as requested. Filesystem options are not (the kernel rewrites them).
	comparedFlags := []struct {
		name string
		flag uintptr
	}{
		{"ro", unix.MS_RDONLY},
		{"nosuid", unix.MS_NOSUID},
		{"nodev", unix.MS_NODEV},
		{"noexec", unix.MS_NOEXEC},
	}
	flags, _, _ := mount.ParseOptions(a.mountOptions())
	for _, f := range comparedFlags {
		want, have := flags&f.flag != 0, mount.HasOption(options, f.name)
		if want != have {
			return fmt.Sprintf("staged with options %q, requested %q", options, strings.Join(a.mountOptions(), ","))
		}
	}
	return ""
}
