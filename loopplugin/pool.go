package loopplugin

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/loopdev"
)

// imageSuffix ends every volume image's file name: <pool>/<volume id>.img.
const imageSuffix = ".img"

// Pool is a directory of sparse volume images, one file per volume, named
// after the volume id. The directory is the only record: there is no index
// to keep in sync. Pool does not lock; the plugin serializes calls per
// volume.
type Pool struct {
	dir string
}

// Volume is one image in the pool.
type Volume struct {
	ID   string
	Path string // the image file
	Size int64  // apparent size in bytes (the volume's capacity)
}

// OpenPool returns the pool in dir, made (0700, durably, parents
// included) when it does not exist yet.
func OpenPool(dir string) (*Pool, error) {
	if dir == "" {
		return nil, fmt.Errorf("%w: pool directory is required", ErrInvalid)
	}
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("pool %s: %w", dir, err)
	}
	fi, err := os.Stat(abs)
	if errors.Is(err, os.ErrNotExist) {
		if err := atomicfile.MkdirAll(abs, 0o700); err != nil {
			return nil, fmt.Errorf("pool %s: making it: %w", abs, err)
		}
		fi, err = os.Stat(abs)
	}
	if err != nil {
		return nil, fmt.Errorf("pool: %w", err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("%w: pool %s is not a directory", ErrInvalid, abs)
	}
	return &Pool{dir: abs}, nil
}

// Dir returns the pool's directory.
func (p *Pool) Dir() string { return p.dir }

// path returns the image path of a validated volume id.
func (p *Pool) path(id string) string { return filepath.Join(p.dir, id+imageSuffix) }

// Get returns the volume with the id, or an error wrapping ErrNotFound.
func (p *Pool) Get(id string) (Volume, error) {
	if err := ValidateVolumeID(id); err != nil {
		return Volume{}, err
	}
	path := p.path(id)
	fi, err := os.Stat(path)
	if errors.Is(err, os.ErrNotExist) {
		return Volume{}, notFoundf("volume %q does not exist", id)
	}
	if err != nil {
		return Volume{}, fmt.Errorf("volume %s: %w", id, err)
	}
	if !fi.Mode().IsRegular() {
		return Volume{}, fmt.Errorf("volume %s: %s is not a regular file", id, path)
	}
	return Volume{ID: id, Path: path, Size: fi.Size()}, nil
}

// Create makes a sparse image of size bytes for the id and returns it with
// created = true. No data blocks are allocated. If the volume already exists
// it is returned unchanged with created = false, whatever its size: callers
// decide whether it fits. The image appears atomically (temporary file,
// fsync, rename without replacing, fsync of the directory), so a crash
// leaves either no volume or a complete one.
func (p *Pool) Create(id string, size int64) (vol Volume, created bool, err error) {
	return p.create(id, size, nil, nil)
}

// create is Create for a volume with content: fill writes it into the
// temporary file (which it may leave shorter than size, never longer)
// before the image appears, and src, recorded before that, says where the
// content came from (nil for a blank volume).
func (p *Pool) create(id string, size int64, src *contentSource, fill func(*os.File) error) (vol Volume, created bool, err error) {
	if err := ValidateVolumeID(id); err != nil {
		return Volume{}, false, err
	}
	if size <= 0 || size%512 != 0 {
		return Volume{}, false, fmt.Errorf("%w: size %d is not a positive multiple of 512", ErrOutOfRange, size)
	}
	if v, err := p.Get(id); err == nil {
		return v, false, nil
	} else if !errors.Is(err, ErrNotFound) {
		return Volume{}, false, err
	}
	tmp, err := os.CreateTemp(p.dir, "."+id+".tmp-*")
	if err != nil {
		return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
	}
	defer func() {
		if err != nil {
			tmp.Close()
			os.Remove(tmp.Name())
		}
	}()
	if fill != nil {
		if err := fill(tmp); err != nil {
			return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
		}
	}
	if err := tmp.Truncate(size); err != nil {
		if errors.Is(err, unix.EFBIG) {
			return Volume{}, false, fmt.Errorf("%w: create volume %s: %w", ErrOutOfRange, id, err)
		}
		return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
	}
	if err := tmp.Sync(); err != nil {
		return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
	}
	if err := tmp.Close(); err != nil {
		return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
	}
	// The record goes first: a crash before the rename leaves a record
	// without an image, which the next create of the id replaces.
	if src != nil {
		err = p.writeRecord(metaVolumes, id, volumeRecord{ContentSource: src})
	} else {
		err = p.removeRecord(metaVolumes, id)
	}
	if err != nil {
		return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
	}
	path := p.path(id)
	err = unix.Renameat2(unix.AT_FDCWD, tmp.Name(), unix.AT_FDCWD, path, unix.RENAME_NOREPLACE)
	if errors.Is(err, unix.EEXIST) {
		// Created by someone else (another process) meanwhile.
		os.Remove(tmp.Name())
		v, gerr := p.Get(id)
		return v, false, gerr
	}
	if err != nil {
		return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
	}
	if err := syncDir(p.dir); err != nil {
		return Volume{}, false, fmt.Errorf("create volume %s: %w", id, err)
	}
	return Volume{ID: id, Path: path, Size: size}, true, nil
}

// Delete removes the volume's image. A volume that does not exist is already
// deleted. A volume whose image is attached to a loop device (staged) is in
// use, a member of a volume group must leave it first, and a replicated
// volume needs replication disabled first: Delete refuses these with
// ErrPrecondition.
func (p *Pool) Delete(id string) error {
	if err := ValidateVolumeID(id); err != nil {
		return err
	}
	if g, err := p.groupOf(id); err != nil {
		return err
	} else if g != "" {
		return preconditionf("volume %s is a member of volume group %s: remove it from the group first", id, g)
	}
	var rep replicationRecord
	if err := p.readRecord(metaReplication, id, &rep); err == nil {
		return preconditionf("volume %s is replicated (%s): disable replication first", id, rep.Role)
	} else if !errors.Is(err, ErrNotFound) {
		return err
	}
	return p.remove(id)
}

// remove deletes the image unless it is attached, and its record.
func (p *Pool) remove(id string) error {
	v, err := p.Get(id)
	if errors.Is(err, ErrNotFound) {
		return errors.Join(p.removeRecord(metaVolumes, id), p.removeRecord(formattingKind, id), p.removeRecord(metaAttachments, id))
	}
	if err != nil {
		return err
	}
	if dev, err := loopdev.Find(v.Path); err == nil {
		return preconditionf("volume %s is in use: attached to %s", id, dev.Path)
	} else if !errors.Is(err, loopdev.ErrNotAttached) {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	if err := os.Remove(v.Path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	if err := syncDir(p.dir); err != nil {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	// An attachment record left by a reboot (its device gone) goes too.
	if err := errors.Join(p.removeRecord(metaVolumes, id), p.removeRecord(formattingKind, id), p.removeRecord(metaAttachments, id)); err != nil {
		return fmt.Errorf("delete volume %s: %w", id, err)
	}
	return nil
}

// contentSource is where a volume's initial content came from.
type contentSource struct {
	SnapshotID string `json:"snapshot_id,omitempty"`
	VolumeID   string `json:"volume_id,omitempty"`
}

// volumeRecord is what the pool records about a volume besides its image.
type volumeRecord struct {
	ContentSource *contentSource `json:"content_source,omitempty"`
}

// contentSourceOf returns the volume's content source, nil for a blank
// volume.
func (p *Pool) contentSourceOf(id string) (*contentSource, error) {
	var r volumeRecord
	if err := p.readRecord(metaVolumes, id, &r); errors.Is(err, ErrNotFound) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	return r.ContentSource, nil
}

// List returns the pool's volumes ordered by id. Files that are not volume
// images (other names, temporary files, directories) are ignored.
func (p *Pool) List() ([]Volume, error) {
	entries, err := os.ReadDir(p.dir)
	if err != nil {
		return nil, fmt.Errorf("list pool: %w", err)
	}
	var vols []Volume
	for _, e := range entries {
		id, ok := strings.CutSuffix(e.Name(), imageSuffix)
		if !ok || ValidateVolumeID(id) != nil || !e.Type().IsRegular() {
			continue
		}
		fi, err := e.Info()
		if errors.Is(err, os.ErrNotExist) {
			continue // deleted meanwhile
		}
		if err != nil {
			return nil, fmt.Errorf("list pool: %w", err)
		}
		vols = append(vols, Volume{ID: id, Path: filepath.Join(p.dir, e.Name()), Size: fi.Size()})
	}
	slices.SortFunc(vols, func(a, b Volume) int { return strings.Compare(a.ID, b.ID) })
	return vols, nil
}

// Available returns the bytes available to new data on the pool's
// filesystem. Volumes are thin: their capacities may add up to more.
func (p *Pool) Available() (int64, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(p.dir, &st); err != nil {
		return 0, fmt.Errorf("statfs pool: %w", err)
	}
	return int64(st.Bavail) * st.Bsize, nil
}

// Allocated returns the bytes of storage the file at path occupies
// (st_blocks × 512, what du reports), which for a sparse image is less than
// its size.
func Allocated(path string) (int64, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("stat %s: %w", path, err)
	}
	return st.Blocks * 512, nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("fsync %s: %w", dir, err)
	}
	return nil
}

// CreateExact is Create for an operator: size is rounded up to a multiple of
// 512 bytes, and an existing volume of another size is an error wrapping
// ErrIncompatible (the same size is success).
func (p *Pool) CreateExact(id string, size int64) (Volume, error) {
	if size <= 0 {
		return Volume{}, fmt.Errorf("%w: size must be positive", ErrOutOfRange)
	}
	size = (size + sectorSize - 1) / sectorSize * sectorSize
	v, created, err := p.Create(id, size)
	if err != nil {
		return Volume{}, err
	}
	if !created && v.Size != size {
		return Volume{}, incompatiblef("volume %s exists with %d bytes, not %d", id, v.Size, size)
	}
	return v, nil
}
