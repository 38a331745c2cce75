package cgroup

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/defaults"
)

// DefaultParent is the parent cgroup of plugin cgroups, relative to the
// cgroup2 mount, when Config.Parent is empty.
const DefaultParent = "csi-agent"

// preferredMount is the cgroup2 mount point Detect picks when there are
// several.
const preferredMount = "/sys/fs/cgroup"

// dirPerm is the mode of the cgroups this package creates.
const dirPerm = 0o755

// controllers are the controllers the limits need, in the order messages
// list them.
func controllers() []string { return []string{"cpu", "memory"} }

var (
	// ErrUnsupported marks every error from Detect about the host: no
	// cgroup2 mount, missing controllers, a hierarchy that cannot be
	// written. Limits cannot be enforced; plugins run without them.
	ErrUnsupported = errors.New("cgroup v2 limits unsupported")
	// ErrInvalidName marks a cgroup name (or a Config.Parent component)
	// that is not a plain name; see Manager.Prepare.
	ErrInvalidName = errors.New("invalid cgroup name")
	// ErrInUse marks a cgroup that still holds processes.
	ErrInUse = errors.New("cgroup has processes")
)

// Config configures Detect.
type Config struct {
	// Root is the cgroup v2 mount point. Empty: found in
	// /proc/self/mountinfo (the mount at /sys/fs/cgroup if there is one,
	// else the first cgroup2 mount). Tests point it at a fake tree.
	Root string
	// Parent is the slash-separated path, relative to Root, of the cgroup
	// under which plugin cgroups are created; each component follows the
	// rules of Prepare's name. Empty: DefaultParent. It and every cgroup
	// between it and Root must hold no processes.
	Parent string
	// Logger receives debug records of cgroups created and removed; nil
	// discards them.
	Logger *slog.Logger
}

// Manager creates and removes the cgroups of plugin containers under one
// parent cgroup in which the cpu and memory controllers are enabled.
type Manager struct {
	root   string
	parent string // absolute
	logger *slog.Logger
}

// Detect checks that cgroup v2 limits can be enforced and prepares the
// parent cgroup (see the package documentation). An invalid Config.Parent is
// an error wrapping ErrInvalidName; every other error wraps ErrUnsupported
// and says why.
func Detect(cfg Config) (*Manager, error) {
	parent := cfg.Parent
	if parent == "" {
		parent = DefaultParent
	}
	parts := strings.Split(parent, "/")
	for _, p := range parts {
		if err := validName(p); err != nil {
			return nil, fmt.Errorf("cgroup: parent %q: %w", parent, err)
		}
	}
	logger := defaults.Logger(cfg.Logger)

	root, detected := cfg.Root, cfg.Root == ""
	if detected {
		var err error
		if root, err = findMount(); err != nil {
			return nil, err
		}
	}
	raw, err := os.ReadFile(filepath.Join(root, "cgroup.controllers"))
	if err != nil {
		return nil, fmt.Errorf("%w: %s is not a cgroup v2 hierarchy: %w", ErrUnsupported, root, err)
	}
	have := strings.Fields(string(raw))
	if missing := without(controllers(), have); len(missing) > 0 {
		has := "none"
		if len(have) > 0 {
			has = strings.Join(have, ", ")
		}
		why := ""
		if detected {
			why = boundToV1(missing)
		}
		return nil, fmt.Errorf("%w: cgroup v2 at %s lacks the %s %s (it has: %s)%s",
			ErrUnsupported, root, strings.Join(missing, ", "), plural(len(missing), "controller", "controllers"), has, why)
	}

	dir := root
	if err := enable(dir); err != nil {
		return nil, err
	}
	for _, p := range parts {
		dir = filepath.Join(dir, p)
		if err := os.Mkdir(dir, dirPerm); errors.Is(err, fs.ErrExist) {
			if st, err := os.Stat(dir); err != nil || !st.IsDir() {
				return nil, fmt.Errorf("%w: cannot create the parent cgroup: %s exists and is not a cgroup", ErrUnsupported, dir)
			}
		} else if err != nil {
			return nil, fmt.Errorf("%w: cannot create the parent cgroup: %w", ErrUnsupported, err)
		}
		if err := enable(dir); err != nil {
			return nil, err
		}
	}
	logger.Debug("cgroup v2 limits available", "root", root, "parent", dir)
	return &Manager{root: root, parent: dir, logger: logger}, nil
}

// findMount returns the cgroup2 mount point.
func findMount() (string, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup2"))
	if err != nil {
		return "", fmt.Errorf("%w: read mountinfo: %w", ErrUnsupported, err)
	}
	if len(mounts) == 0 {
		return "", fmt.Errorf("%w: no cgroup2 filesystem is mounted", ErrUnsupported)
	}
	for _, m := range mounts {
		if m.Mountpoint == preferredMount {
			return m.Mountpoint, nil
		}
	}
	return mounts[0].Mountpoint, nil
}

// boundToV1 explains, if it is so, that controllers are missing from cgroup
// v2 because cgroup v1 hierarchies hold them (a hybrid host). The super
// options of a cgroup v1 mount name its controllers.
func boundToV1(missing []string) string {
	mounts, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("cgroup"))
	if err != nil {
		return ""
	}
	var bound []string
	for _, c := range missing {
		for _, m := range mounts {
			if slices.Contains(strings.Split(m.VFSOptions, ","), c) {
				bound = append(bound, c)
				break
			}
		}
	}
	if len(bound) == 0 {
		return ""
	}
	return fmt.Sprintf("; %s %s bound to cgroup v1 hierarchies", strings.Join(bound, ", "), plural(len(bound), "is", "are"))
}

// enable turns on the missing ones of controllers in dir's
// cgroup.subtree_control, so that dir's children get them.
func enable(dir string) error {
	file := filepath.Join(dir, "cgroup.subtree_control")
	raw, err := os.ReadFile(file)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %w", ErrUnsupported, err)
	}
	missing := without(controllers(), strings.Fields(string(raw)))
	if len(missing) == 0 {
		return nil
	}
	value := "+" + strings.Join(missing, " +")
	if err := writeFile(file, value); err != nil {
		hint := ""
		if errors.Is(err, unix.EBUSY) {
			hint = " (it has processes of its own, and a cgroup v2 cgroup with processes cannot hand controllers to its children)"
		}
		return fmt.Errorf("%w: cannot enable %s: %w%s", ErrUnsupported, strings.Join(missing, ", "), err, hint)
	}
	return nil
}

// Root is the cgroup2 mount point in use.
func (m *Manager) Root() string { return m.root }

// Parent is the absolute path of the parent of plugin cgroups.
func (m *Manager) Parent() string { return m.parent }

// Prepare creates the cgroup name under the parent, or reuses it if it exists
// without processes (left by an earlier instance of the plugin), writes l to
// its cpu.max and memory.max, and opens its directory. Use the descriptor as
// syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: int(dir.Fd())} and close
// dir once the child has started; call Remove after the child has exited.
//
// name must be 1 to 255 characters of letters, digits and ._-+:@=, and not
// "." or "..". A name whose cgroup still holds processes is an
// error wrapping ErrInUse.
func (m *Manager) Prepare(name string, l Limits) (dir *os.File, err error) {
	path, created, err := m.leaf(name)
	if err != nil {
		return nil, err
	}
	defer func() {
		if err != nil && created {
			_ = os.Remove(path)
		}
	}()
	for _, f := range []struct{ file, value string }{
		{"cpu.max", l.CPUMax()},
		{"memory.max", l.MemoryMax()},
	} {
		if err := writeFile(filepath.Join(path, f.file), f.value); err != nil {
			return nil, fmt.Errorf("cgroup: set limits of %s: %w", name, err)
		}
	}
	if dir, err = openDir(path); err != nil {
		return nil, err
	}
	m.logger.Debug("cgroup prepared", "cgroup", path, "cpu.max", l.CPUMax(), "memory.max", l.MemoryMax(), "created", created)
	return dir, nil
}

// leaf creates the cgroup name, or checks that the existing one holds no
// processes. created says which.
func (m *Manager) leaf(name string) (path string, created bool, err error) {
	if err := validName(name); err != nil {
		return "", false, fmt.Errorf("cgroup: %w", err)
	}
	path = filepath.Join(m.parent, name)
	err = os.Mkdir(path, dirPerm)
	if err == nil {
		return path, true, nil
	}
	if !errors.Is(err, fs.ErrExist) {
		return "", false, fmt.Errorf("cgroup: %w", err)
	}
	if st, err := os.Lstat(path); err != nil {
		return "", false, fmt.Errorf("cgroup: %w", err)
	} else if !st.IsDir() {
		return "", false, fmt.Errorf("cgroup: %s exists and is not a cgroup: %w", path, ErrInvalidName)
	}
	procs, err := os.ReadFile(filepath.Join(path, "cgroup.procs"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return "", false, fmt.Errorf("cgroup: %w", err)
	}
	if pids := strings.Fields(string(procs)); len(pids) > 0 {
		return "", false, fmt.Errorf("cgroup: %s holds pids %s: %w", path, strings.Join(pids, " "), ErrInUse)
	}
	return path, false, nil
}

// Remove removes the cgroup name. A missing cgroup is already removed; one
// that still holds processes is an error wrapping ErrInUse (and EBUSY).
func (m *Manager) Remove(name string) error {
	if err := validName(name); err != nil {
		return fmt.Errorf("cgroup: %w", err)
	}
	path := filepath.Join(m.parent, name)
	err := os.Remove(path)
	switch {
	case err == nil:
		m.logger.Debug("cgroup removed", "cgroup", path)
		return nil
	case errors.Is(err, fs.ErrNotExist):
		return nil
	case errors.Is(err, unix.EBUSY):
		return fmt.Errorf("cgroup: remove: %w: %w", ErrInUse, err)
	default:
		return fmt.Errorf("cgroup: remove: %w", err)
	}
}

// openDir opens a cgroup directory for CLONE_INTO_CGROUP.
func openDir(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("cgroup: %w", err)
	}
	return f, nil
}

// writeFile writes value to a cgroup interface file in one write, as the
// kernel wants. O_CREATE only matters in a fake tree: cgroupfs refuses to
// create files, so a missing interface file is still an error there.
func writeFile(path, value string) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write([]byte(value)); err != nil {
		f.Close()
		return fmt.Errorf("write %q to %s: %w", value, path, err)
	}
	return f.Close()
}

// validName checks a cgroup directory name: see Manager.Prepare.
func validName(name string) error {
	if name == "" || len(name) > 255 || name == "." || name == ".." {
		return fmt.Errorf("%q: %w", name, ErrInvalidName)
	}
	for i := range len(name) {
		c := name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("._-+:@=", c) >= 0) {
			return fmt.Errorf("%q: %w", name, ErrInvalidName)
		}
	}
	return nil
}

// without returns the elements of want that are not in have.
func without(want, have []string) []string {
	var out []string
	for _, w := range want {
		if !slices.Contains(have, w) {
			out = append(out, w)
		}
	}
	return out
}

func plural(n int, one, many string) string {
	if n == 1 {
		return one
	}
	return many
}
