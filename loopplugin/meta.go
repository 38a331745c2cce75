package loopplugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// Pool metadata. Volume groups, snapshots, group snapshots, replication
// state and the content source of restored volumes live in the pool, next
// to the images, under <pool>/.csi-loop/ (a name no volume id can take:
// ids never start with a dot):
//
//	.csi-loop/groups/<group id>.json
//	.csi-loop/snapshots/<snapshot id>.json and <snapshot id>.img
//	.csi-loop/group-snapshots/<group snapshot id>.json
//	.csi-loop/replication/<volume id>.json and <volume id>.lock
//	.csi-loop/volumes/<volume id>.json (content source, if any)
//	.csi-loop/attachments/<volume id>.json (ControllerPublishVolume's loop device)
//
// Every record is written atomically (temporary file, fsync, rename, fsync
// of the directory): a crash leaves the old record or the new one. A
// missing record is "none". Files whose names start with a dot are
// temporary and ignored.
const metaDirName = ".csi-loop"

// Kinds of records: the subdirectories of the metadata directory.
const (
	metaGroups         = "groups"
	metaSnapshots      = "snapshots"
	metaGroupSnapshots = "group-snapshots"
	metaReplication    = "replication"
	metaVolumes        = "volumes"
	metaAttachments    = "attachments"
)

// metaDir returns the directory of one kind of record.
func (p *Pool) metaDir(kind string) string { return filepath.Join(p.dir, metaDirName, kind) }

// metaPath returns the path of a record.
func (p *Pool) metaPath(kind, id string) string { return filepath.Join(p.metaDir(kind), id+".json") }

// readRecord decodes the record into v. A missing record is an error
// wrapping ErrNotFound.
func (p *Pool) readRecord(kind, id string, v any) error {
	b, err := os.ReadFile(p.metaPath(kind, id))
	if errors.Is(err, os.ErrNotExist) {
		return notFoundf("%s record %q does not exist", strings.TrimSuffix(kind, "s"), id)
	}
	if err != nil {
		return fmt.Errorf("read %s record %s: %w", kind, id, err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("read %s record %s: %w", kind, id, err)
	}
	return nil
}

// writeRecord stores v as the record, atomically.
func (p *Pool) writeRecord(kind, id string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return fmt.Errorf("write %s record %s: %w", kind, id, err)
	}
	if err := writeFileAtomic(p.metaDir(kind), id+".json", append(b, '\n')); err != nil {
		return fmt.Errorf("write %s record %s: %w", kind, id, err)
	}
	return nil
}

// removeRecord deletes the record; a missing one is already deleted.
func (p *Pool) removeRecord(kind, id string) error {
	return removeFile(p.metaPath(kind, id))
}

// listRecords returns the ids of the records of a kind, sorted.
func (p *Pool) listRecords(kind string) ([]string, error) {
	entries, err := os.ReadDir(p.metaDir(kind))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list %s: %w", kind, err)
	}
	var ids []string
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || strings.HasPrefix(e.Name(), ".") || !e.Type().IsRegular() {
			continue
		}
		ids = append(ids, id)
	}
	slices.Sort(ids)
	return ids, nil
}

// ensureDir creates dir (and its parents) if missing.
func ensureDir(dir string) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("create %s: %w", dir, err)
	}
	return nil
}

// writeFileAtomic replaces dir/name with data: temporary file, fsync,
// rename, fsync of the directory.
func writeFileAtomic(dir, name string, data []byte) (err error) {
	if err := ensureDir(dir); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, "."+name+".tmp-*")
	if err != nil {
		return err
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if _, err := tmp.Write(data); err != nil {
		return err
	}
	if err := tmp.Sync(); err != nil {
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	if err := os.Rename(tmp.Name(), filepath.Join(dir, name)); err != nil {
		return err
	}
	return syncDir(dir)
}

// removeFile removes path and syncs its directory; a missing file is
// already removed.
func removeFile(path string) error {
	err := os.Remove(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	return syncDir(filepath.Dir(path))
}

// flockFile takes an exclusive advisory lock on path (created if missing)
// without waiting: a lock held elsewhere (another call, another plugin
// process serving the peer pool) is ErrBusy. The returned function
// releases it. Lock files are never removed: removing one while another
// process holds it open would let two holders in.
func flockFile(path string) (unlock func(), err error) {
	if err := ensureDir(filepath.Dir(path)); err != nil {
		return nil, err
	}
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return nil, fmt.Errorf("%w: %s is locked by another operation", ErrBusy, path)
		}
		return nil, fmt.Errorf("lock %s: %w", path, err)
	}
	return func() { f.Close() }, nil
}
