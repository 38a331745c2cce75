package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/types/known/timestamppb"
)

// Snapshots. A snapshot is a full copy of a volume's image, cut while the
// volume's filesystem is frozen (if it is staged): a reflink where the
// pool's filesystem can share extents, a sparse copy otherwise. It lives
// in the pool as .csi-loop/snapshots/<id>.img with a record next to it,
// and is independent of its source: deleting either leaves the other
// intact. CreateVolume with a snapshot source copies it back the same
// way. Members of a group snapshot carry its id and can only be deleted
// with it.

type snapshotRecord struct {
	ID              string    `json:"id"`
	SourceVolumeID  string    `json:"source_volume_id"`
	SizeBytes       int64     `json:"size_bytes"`
	CreationTime    time.Time `json:"creation_time"`
	GroupSnapshotID string    `json:"group_snapshot_id,omitempty"`
	Reflinked       bool      `json:"reflinked,omitempty"`
}

func (p *Pool) snapshotImage(id string) string {
	return filepath.Join(p.metaDir(metaSnapshots), id+imageSuffix)
}

// trySnapshot takes the snapshot's lock without waiting (ErrBusy when it
// is held) and reads its record, if it has one (found). The caller
// releases the lock with unlock.
func (p *Plugin) trySnapshot(id string) (r snapshotRecord, found bool, unlock func(), err error) {
	if unlock, err = p.locks.tryLock(snapshotLockKey(id)); err != nil {
		return r, false, nil, err
	}
	switch err := p.pool.readRecord(metaSnapshots, id, &r); {
	case err == nil:
		return r, true, unlock, nil
	case errors.Is(err, ErrNotFound):
		return snapshotRecord{}, false, unlock, nil
	default:
		unlock()
		return snapshotRecord{}, false, nil, err
	}
}

// getSnapshot returns a snapshot whose image exists, or ErrNotFound. A
// member of a group snapshot whose group record is missing (a crash or a
// failure before the group was complete) does not exist either.
func (p *Pool) getSnapshot(id string) (snapshotRecord, error) {
	if validateID("snapshot id", id) != nil {
		return snapshotRecord{}, notFoundf("snapshot %q does not exist", id)
	}
	var r snapshotRecord
	if err := p.readRecord(metaSnapshots, id, &r); err != nil {
		return r, err
	}
	if _, err := os.Stat(p.snapshotImage(id)); errors.Is(err, os.ErrNotExist) {
		return r, notFoundf("snapshot %q has no image", id)
	} else if err != nil {
		return r, err
	}
	if r.GroupSnapshotID != "" {
		if _, err := os.Stat(p.metaPath(metaGroupSnapshots, r.GroupSnapshotID)); errors.Is(err, os.ErrNotExist) {
			return r, notFoundf("snapshot %q belongs to group snapshot %q, which does not exist", id, r.GroupSnapshotID)
		} else if err != nil {
			return r, err
		}
	}
	return r, nil
}

// removeSnapshot deletes the snapshot's image, then its record.
func (p *Pool) removeSnapshot(id string) error {
	if err := removeFile(p.snapshotImage(id)); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", id, err)
	}
	if err := p.removeRecord(metaSnapshots, id); err != nil {
		return fmt.Errorf("delete snapshot %s: %w", id, err)
	}
	return nil
}

func csiSnapshot(r snapshotRecord) *csi.Snapshot {
	return &csi.Snapshot{
		SizeBytes:       r.SizeBytes,
		SnapshotId:      r.ID,
		SourceVolumeId:  r.SourceVolumeID,
		CreationTime:    timestamppb.New(r.CreationTime),
		ReadyToUse:      true,
		GroupSnapshotId: r.GroupSnapshotID,
	}
}

// snapshotSource is one volume to snapshot and the id its snapshot gets.
type snapshotSource struct {
	vol    Volume
	snapID string
}

// cutSnapshots snapshots the volumes together: the filesystems of those
// that are staged are frozen together, every image is copied, then all are
// thawed (at the freeze deadline at the latest, whatever the copy does).
// Only then are the copies made durable and given their records. A volume
// attached for block access cannot be frozen; with allowBlock (a single
// volume) it is copied as it is, else the call is FailedPrecondition: the
// group could not be write-order consistent. On error nothing is left
// behind.
func (p *Plugin) cutSnapshots(ctx context.Context, srcs []snapshotSource, groupID string, freeze time.Duration, allowBlock bool) (recs []snapshotRecord, err error) {
	points, err := quiescePoints(srcs, allowBlock)
	if err != nil {
		return nil, err
	}
	dir := p.pool.metaDir(metaSnapshots)
	if err := ensureDir(dir); err != nil {
		return nil, err
	}
	type job struct {
		s        snapshotSource
		src, tmp *os.File
		st       copyStats
	}
	jobs := make([]job, 0, len(srcs))
	defer func() {
		for _, j := range jobs {
			j.src.Close()
			if j.tmp != nil {
				j.tmp.Close()
				if err != nil {
					os.Remove(j.tmp.Name())
				}
			}
		}
	}()
	for _, s := range srcs {
		src, err := os.Open(s.vol.Path)
		if err != nil {
			return nil, fmt.Errorf("snapshot volume %s: %w", s.vol.ID, err)
		}
		jobs = append(jobs, job{s: s, src: src})
		tmp, err := os.CreateTemp(dir, "."+s.snapID+".tmp-*")
		if err != nil {
			return nil, fmt.Errorf("snapshot volume %s: %w", s.vol.ID, err)
		}
		jobs[len(jobs)-1].tmp = tmp
	}

	var cut time.Time
	err = p.whileFrozen(ctx, points, freeze, func(ctx context.Context) error {
		cut = time.Now().UTC()
		for i := range jobs {
			if h := p.hooks.beforeSnapshotCopy.Load(); h != nil {
				if err := (*h)(ctx, jobs[i].s.vol.ID); err != nil {
					return fmt.Errorf("snapshot volume %s: %w", jobs[i].s.vol.ID, err)
				}
			}
			st, err := copyImage(ctx, jobs[i].src, jobs[i].tmp, true)
			if err != nil {
				return fmt.Errorf("snapshot volume %s: %w", jobs[i].s.vol.ID, err)
			}
			jobs[i].st = st
		}
		return nil
	})
	if err != nil {
		return nil, err
	}

	// Thawed. Make the copies durable, then give them their names and
	// records; a failure removes what was renamed.
	for _, j := range jobs {
		if err := j.tmp.Sync(); err != nil {
			return nil, fmt.Errorf("snapshot volume %s: %w", j.s.vol.ID, err)
		}
	}
	defer func() {
		if err != nil {
			for _, r := range recs {
				_ = p.pool.removeSnapshot(r.ID)
			}
		}
	}()
	for _, j := range jobs {
		r := snapshotRecord{
			ID: j.s.snapID, SourceVolumeID: j.s.vol.ID, SizeBytes: j.s.vol.Size,
			CreationTime: cut, GroupSnapshotID: groupID, Reflinked: j.st.reflinked,
		}
		recs = append(recs, r)
		if err := os.Rename(j.tmp.Name(), p.pool.snapshotImage(r.ID)); err != nil {
			return nil, fmt.Errorf("snapshot volume %s: %w", j.s.vol.ID, err)
		}
		if err := p.pool.writeRecord(metaSnapshots, r.ID, r); err != nil {
			return nil, err
		}
		p.log.Info("snapshot cut", "volume", j.s.vol.ID, "snapshot", r.ID, "group_snapshot", groupID,
			"reflink", j.st.reflinked, "copied_bytes", j.st.written)
	}
	if err := syncDir(dir); err != nil {
		return nil, err
	}
	return recs, nil
}

// quiescePoints are the mount points of the staged filesystems to freeze
// for a snapshot of srcs; a volume staged for block access is refused
// (FailedPrecondition) unless allowBlock.
func quiescePoints(srcs []snapshotSource, allowBlock bool) ([]string, error) {
	var points []string
	for _, s := range srcs {
		point, blocked, err := quiescePoint(s.vol.Path)
		if err != nil {
			return nil, err
		}
		if blocked && !allowBlock {
			return nil, preconditionf("volume %s is staged for block access: its writes cannot be quiesced, so it cannot be snapshotted consistently with other volumes", s.vol.ID)
		}
		if point != "" {
			points = append(points, point)
		}
	}
	return points, nil
}

// CreateSnapshot snapshots one volume (frozen while copied if staged with
// mount access; a block-access volume is copied as it is). The name is the
// snapshot id; the same name for the same volume again returns the
// existing snapshot, for another volume (or a group member) it is
// AlreadyExists. Parameters: freezeTimeout.
func (s *controllerServer) CreateSnapshot(ctx context.Context, req *csi.CreateSnapshotRequest) (*csi.CreateSnapshotResponse, error) {
	id, src := req.GetName(), req.GetSourceVolumeId()
	if err := requireID("name", id); err != nil {
		return nil, err
	}
	if err := requireVolumeID(src); err != nil {
		return nil, fmt.Errorf("source_volume_id: %w", err)
	}
	if err := checkParams(req.GetParameters(), paramFreezeTimeout); err != nil {
		return nil, err
	}
	freeze, err := parseFreezeTimeout(req.GetParameters())
	if err != nil {
		return nil, err
	}
	r, found, unlock, err := s.p.trySnapshot(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if found {
		if r.SourceVolumeID != src || r.GroupSnapshotID != "" {
			return nil, incompatiblef("snapshot %s exists for volume %s (group snapshot %q)", id, r.SourceVolumeID, r.GroupSnapshotID)
		}
		if r, err = s.p.pool.getSnapshot(id); err == nil {
			return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(r)}, nil
		} else if !errors.Is(err, ErrNotFound) {
			return nil, err
		}
		// The record outlived its image: cut it again.
	}
	unlockVol, err := s.p.locks.lock(ctx, src)
	if err != nil {
		return nil, err
	}
	defer unlockVol()
	vol, err := s.p.pool.Get(src)
	if err != nil {
		return nil, err
	}
	recs, err := s.p.cutSnapshots(ctx, []snapshotSource{{vol: vol, snapID: id}}, "", freeze, true)
	if err != nil {
		return nil, err
	}
	return &csi.CreateSnapshotResponse{Snapshot: csiSnapshot(recs[0])}, nil
}

// DeleteSnapshot deletes a snapshot; an unknown one is already deleted. A
// member of a group snapshot is InvalidArgument: delete the group
// snapshot.
func (s *controllerServer) DeleteSnapshot(ctx context.Context, req *csi.DeleteSnapshotRequest) (*csi.DeleteSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if err := requireID("snapshot_id", id); err != nil {
		return nil, err
	}
	r, found, unlock, err := s.p.trySnapshot(id)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if found && r.GroupSnapshotID != "" {
		return nil, invalidf("snapshot %s is part of group snapshot %s: delete the group snapshot instead", id, r.GroupSnapshotID)
	}
	if err := s.p.pool.removeSnapshot(id); err != nil {
		return nil, err
	}
	return &csi.DeleteSnapshotResponse{}, nil
}

// ListSnapshots pages through the snapshots ordered by id, optionally only
// one snapshot or those of one source volume.
func (s *controllerServer) ListSnapshots(ctx context.Context, req *csi.ListSnapshotsRequest) (*csi.ListSnapshotsResponse, error) {
	if req.GetMaxEntries() < 0 {
		return nil, invalidf("max_entries must not be negative")
	}
	ids, err := s.p.pool.listRecords(metaSnapshots)
	if err != nil {
		return nil, err
	}
	recs := map[string]snapshotRecord{}
	var keep []string
	for _, id := range ids {
		if want := req.GetSnapshotId(); want != "" && id != want {
			continue
		}
		r, err := s.p.pool.getSnapshot(id)
		if errors.Is(err, ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if want := req.GetSourceVolumeId(); want != "" && r.SourceVolumeID != want {
			continue
		}
		recs[id] = r
		keep = append(keep, id)
	}
	page, next, err := paginate(keep, "snap", req.GetStartingToken(), req.GetMaxEntries())
	if err != nil {
		return nil, err
	}
	resp := &csi.ListSnapshotsResponse{NextToken: next}
	for _, id := range page {
		resp.Entries = append(resp.Entries, &csi.ListSnapshotsResponse_Entry{Snapshot: csiSnapshot(recs[id])})
	}
	return resp, nil
}

// GetSnapshot returns a snapshot, or NotFound.
func (s *controllerServer) GetSnapshot(ctx context.Context, req *csi.GetSnapshotRequest) (*csi.GetSnapshotResponse, error) {
	id := req.GetSnapshotId()
	if id == "" {
		return nil, invalidf("snapshot_id is required")
	}
	r, err := s.p.pool.getSnapshot(id)
	if err != nil {
		return nil, err
	}
	return &csi.GetSnapshotResponse{Snapshot: csiSnapshot(r)}, nil
}

// parseContentSource validates a CreateVolume content source.
func parseContentSource(src *csi.VolumeContentSource) (*contentSource, error) {
	if src == nil {
		return nil, nil
	}
	switch t := src.GetType().(type) {
	case *csi.VolumeContentSource_Snapshot:
		id := t.Snapshot.GetSnapshotId()
		if id == "" {
			return nil, invalidf("volume_content_source.snapshot.snapshot_id is required")
		}
		return &contentSource{SnapshotID: id}, nil
	case *csi.VolumeContentSource_Volume:
		id := t.Volume.GetVolumeId()
		if err := requireVolumeID(id); err != nil {
			return nil, fmt.Errorf("volume_content_source.volume: %w", err)
		}
		return &contentSource{VolumeID: id}, nil
	}
	return nil, invalidf("volume_content_source has no snapshot or volume")
}

func csiContentSource(src *contentSource) *csi.VolumeContentSource {
	switch {
	case src == nil:
		return nil
	case src.SnapshotID != "":
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
			Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: src.SnapshotID}}}
	default:
		return &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Volume{
			Volume: &csi.VolumeContentSource_VolumeSource{VolumeId: src.VolumeID}}}
	}
}

// restoreSize picks the size of a volume made from a source of srcSize
// bytes: the source's size unless the range asks for more; a limit below
// the source's size is OutOfRange.
func restoreSize(r *csi.CapacityRange, srcSize int64) (int64, error) {
	if r.GetRequiredBytes() == 0 && r.GetLimitBytes() == 0 {
		return srcSize, nil
	}
	size, err := volumeSize(r)
	if err != nil {
		return 0, err
	}
	if size < srcSize {
		if lim := r.GetLimitBytes(); lim > 0 && lim < srcSize {
			return 0, outOfRangef("the source holds %d bytes, limit_bytes %d is smaller", srcSize, lim)
		}
		size = srcSize
	}
	return size, nil
}

// createFrom makes volume id with the content of a snapshot or of another
// volume (a clone: the source is frozen while copied if it is staged, and
// the caller holds its lock).
func (p *Plugin) createFrom(ctx context.Context, id string, r *csi.CapacityRange, src *contentSource) (Volume, error) {
	var path string
	var srcSize int64
	var points []string
	if src.SnapshotID != "" {
		snap, err := p.pool.getSnapshot(src.SnapshotID)
		if err != nil {
			return Volume{}, err
		}
		path, srcSize = p.pool.snapshotImage(snap.ID), snap.SizeBytes
	} else {
		v, err := p.pool.Get(src.VolumeID)
		if err != nil {
			return Volume{}, err
		}
		path, srcSize = v.Path, v.Size
		point, _, err := quiescePoint(v.Path)
		if err != nil {
			return Volume{}, err
		}
		if point != "" {
			points = append(points, point)
		}
	}
	size, err := restoreSize(r, srcSize)
	if err != nil {
		return Volume{}, err
	}
	f, err := os.Open(path)
	if errors.Is(err, os.ErrNotExist) {
		return Volume{}, notFoundf("source of volume %s is gone", id)
	}
	if err != nil {
		return Volume{}, err
	}
	defer f.Close()
	var st copyStats
	vol, _, err := p.pool.create(id, size, src, func(tmp *os.File) error {
		return p.whileFrozen(ctx, points, DefaultFreezeTimeout, func(ctx context.Context) error {
			var cerr error
			st, cerr = copyImage(ctx, f, tmp, true)
			return cerr
		})
	})
	if err != nil {
		return Volume{}, err
	}
	p.log.Info("created volume from source", "volume", id, "snapshot", src.SnapshotID, "source_volume", src.VolumeID,
		"reflink", st.reflinked, "copied_bytes", st.written)
	return vol, nil
}
