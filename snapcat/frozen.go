package snapcat

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/mount"
)

const frozenDir = "frozen"

// FrozenFS is one filesystem a group snapshot freezes: the agent's own
// target path of a volume, and what identifies the mount there.
type FrozenFS struct {
	Path    string `json:"path"`
	MountID uint64 `json:"mount_id"`
	Dev     uint64 `json:"dev"`
}

// Identify reads the mount id and device number of the filesystem at path.
func Identify(path string) (FrozenFS, error) {
	f, err := os.OpenFile(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return FrozenFS{}, fmt.Errorf("identifying the filesystem at %s: %w", path, err)
	}
	defer f.Close()
	return identify(f)
}

func identify(f *os.File) (FrozenFS, error) {
	id, err := mount.ID(f)
	if err != nil {
		return FrozenFS{}, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return FrozenFS{}, fmt.Errorf("stat %s: %w", f.Name(), err)
	}
	return FrozenFS{Path: f.Name(), MountID: id, Dev: st.Dev}, nil
}

// FreezeRecord says which filesystems a group snapshot freezes, until
// when at most.
type FreezeRecord struct {
	Group       string     `json:"group"`
	Container   string     `json:"container"`
	Deadline    time.Time  `json:"deadline"`
	Filesystems []FrozenFS `json:"filesystems"`
}

func (c *Catalogue) freezePath(group string) string {
	return filepath.Join(c.dir, frozenDir, group+".json")
}

// RecordFreeze writes r durably: call it before freezing anything.
func (c *Catalogue) RecordFreeze(r *FreezeRecord) error {
	if err := ValidateName(r.Group); err != nil {
		return err
	}
	data, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding the freeze record of %s: %w", r.Group, err)
	}
	if err := atomicfile.Write(c.freezePath(r.Group), append(data, '\n'), 0o600); err != nil {
		return fmt.Errorf("recording the filesystems group snapshot %s freezes: %w", r.Group, err)
	}
	return nil
}

// FreezeDone removes the freeze record of group, durably: call it once
// every filesystem is thawed.
func (c *Catalogue) FreezeDone(group string) error {
	if err := removeDurably(c.freezePath(group)); err != nil {
		return fmt.Errorf("removing the freeze record of %s: %w", group, err)
	}
	return nil
}

// ThawRecorded is the recovery after a crash while filesystems were
// frozen: it thaws (FITHAW; one not frozen is fine) every filesystem of
// every freeze record whose mount id and device still match what was
// recorded, then removes the record. A filesystem that is gone or is
// another mount now is logged and left alone. The records are removed
// only when every thaw succeeded, so a failed one is tried again at the
// next start.
func (c *Catalogue) ThawRecorded(log *slog.Logger) error {
	dir := filepath.Join(c.dir, frozenDir)
	files, err := readDir(dir, log)
	if err != nil {
		return err
	}
	var errs []error
	for group, data := range files {
		r := &FreezeRecord{}
		if err := json.Unmarshal(data, r); err != nil {
			errs = append(errs, fmt.Errorf("freeze record %s: %w", filepath.Join(dir, group+".json"), err))
			continue
		}
		var failed bool
		for _, fsys := range r.Filesystems {
			if err := thawRecorded(fsys, log); err != nil {
				failed = true
				errs = append(errs, fmt.Errorf("group snapshot %s: %w", group, err))
			}
		}
		log.Info("thawed the filesystems a crash left frozen", "group_snapshot", group, "container", r.Container, "filesystems", len(r.Filesystems))
		if !failed {
			if err := c.FreezeDone(group); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

func thawRecorded(want FrozenFS, log *slog.Logger) error {
	f, err := os.OpenFile(want.Path, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		log.Warn("not thawing a recorded filesystem: it cannot be opened (unmounted?)", "path", want.Path, "error", err)
		return nil
	}
	defer f.Close()
	have, err := identify(f)
	if err != nil {
		return err
	}
	if have.MountID != want.MountID || have.Dev != want.Dev {
		log.Warn("not thawing a recorded filesystem: another mount is there now", "path", want.Path,
			"mount_id", have.MountID, "recorded_mount_id", want.MountID, "dev", have.Dev, "recorded_dev", want.Dev)
		return nil
	}
	return mount.ThawFile(f)
}
