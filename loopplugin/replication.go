package loopplugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/csiagent/csiagent/internal/loopdev"
	rep "github.com/csiagent/csiagent/proto/replication"
)

// Replication (csi-addons replication.Controller) of a volume to the
// replica pool (--replica-pool), a second pool directory on this host,
// typically on another disk. The two copies are the two "sides": each
// pool records its own side's state in .csi-loop/replication/<id>.json
// (role primary or secondary, the peer pool, whether its content is
// consistent, the last sync). A plugin serving the replica pool with
// --replica-pool pointing back sees the same pair from the other side, so
// a failover is Demote on one plugin, Promote on the other.
//
// When data moves (always from the primary's copy to the secondary's):
//
//   - EnableVolumeReplication: the initial copy, sparse (data extents
//     only), into a new image in the replica pool. The caller's side is
//     primary, the replica secondary.
//   - every schedulingInterval (Enable parameter, e.g. "5m"; none by
//     default): the primary's changes, from Serve's scheduler.
//   - DemoteVolume on the primary: a final sync before it becomes
//     secondary, so that promoting the other side loses nothing.
//   - ResyncVolume on a demoted side: it pulls the primary's changes.
//
// A sync compares the copies over the source's data extents
// (SEEK_DATA/SEEK_HOLE), block by block, and writes only the blocks that
// differ; ranges that became holes or zeros in the source are punched out
// of the target. Its bytes (GetVolumeReplicationInfo's last_sync_bytes)
// are the bytes of the target it changed. A source staged with mount
// access is frozen for the sync (freezeTimeout parameter), so the copy is
// crash-consistent; one staged for block access cannot be synced. A
// target that is staged is never written: syncing into it is
// FailedPrecondition. While a sync writes into a copy, that copy is marked
// inconsistent; an interrupted sync leaves it so, and Promote then needs
// force (or a Resync first).
//
// A secondary cannot be staged (NodeStageVolume is FailedPrecondition) nor
// deleted while replication is enabled. DisableVolumeReplication (on
// either side) removes both sides' state; both images stay, as independent
// volumes. Enabling again needs the stale copy in the replica pool deleted
// first (an enable interrupted between writing the two sides' records is
// finished by enabling again). GetVolumeReplicationInfo answers on the
// primary side only, as the csi-addons table says; both sides record every
// sync. Replication of volume groups is not supported.
//
// Calls on one volume do not wait: one in flight (here, or in the plugin
// serving the peer pool: the two sides' lock files are flocked) makes the
// next Aborted, as the csi-addons error table allows.

const (
	rolePrimary   = "primary"
	roleSecondary = "secondary"
	// paramSchedulingInterval names the Enable parameter that makes the
	// primary sync periodically (a Go duration of at least
	// minSchedulingInterval).
	paramSchedulingInterval = "schedulingInterval"
	minSchedulingInterval   = time.Second
	// defaultReplicationTick is how often the scheduler looks for
	// primaries whose interval has passed.
	defaultReplicationTick = 5 * time.Second
)

type syncRecord struct {
	Time     time.Time     `json:"time"`     // when the sync started
	Duration time.Duration `json:"duration"` // how long it took
	Bytes    int64         `json:"bytes"`    // bytes of the target changed
	From     string        `json:"from"`     // the source's pool
	Full     bool          `json:"full,omitempty"`
}

type replicationRecord struct {
	VolumeID      string            `json:"volume_id"`
	Role          string            `json:"role"`
	Peer          string            `json:"peer"` // the other side's pool directory
	ReplicationID string            `json:"replication_id,omitempty"`
	Parameters    map[string]string `json:"parameters,omitempty"`
	Consistent    bool              `json:"consistent"`
	LastSync      *syncRecord       `json:"last_sync,omitempty"`
	EnabledTime   time.Time         `json:"enabled_time"`
}

// replParams validates Enable's parameters.
func replParams(params map[string]string) (interval, freeze time.Duration, err error) {
	if err := checkParams(params, paramSchedulingInterval, paramFreezeTimeout); err != nil {
		return 0, 0, err
	}
	if freeze, err = parseFreezeTimeout(params); err != nil {
		return 0, 0, err
	}
	if v, ok := params[paramSchedulingInterval]; ok {
		interval, err = time.ParseDuration(v)
		if err != nil || interval < minSchedulingInterval {
			return 0, 0, invalidf("parameter %s=%q: want a duration of at least %s", paramSchedulingInterval, v, minSchedulingInterval)
		}
	}
	return interval, freeze, nil
}

type replicationServer struct {
	rep.UnimplementedControllerServer
	p *Plugin
}

var _ rep.ControllerServer = (*replicationServer)(nil)

// replCall is one replication operation on one volume, holding its locks
// and both sides' records (nil where a side has none).
type replCall struct {
	p           *Plugin
	id          string
	local, peer *Pool
	lrec, prec  *replicationRecord
	release     func()
}

// replicatedVolume is the volume a request's replication_source names
// (the spec reserves the old volume_id field); a valid source is
// Unimplemented without a replica pool.
func (p *Plugin) replicatedVolume(src *rep.ReplicationSource) (string, error) {
	id := src.GetVolume().GetVolumeId()
	switch {
	case src.GetVolumegroup() != nil:
		return "", invalidf("replication of volume groups is not supported")
	case src.GetVolume() == nil:
		return "", invalidf("replication_source.volume is required: the volume to replicate")
	case id == "":
		return "", invalidf("replication_source.volume.volume_id is required")
	}
	if err := ValidateVolumeID(id); err != nil {
		return "", err
	}
	if p.replica == nil {
		return "", unimplementedf("replication needs a replica pool (--replica-pool)")
	}
	return id, nil
}

// volumeSource is the replication source of one volume.
func volumeSource(id string) *rep.ReplicationSource {
	return &rep.ReplicationSource{Type: &rep.ReplicationSource_Volume{Volume: &rep.ReplicationSource_VolumeSource{VolumeId: id}}}
}

// beginReplication validates the source, takes the volume's lock and both
// sides' lock files without waiting (ErrBusy: Aborted), and loads both
// sides' records.
func (p *Plugin) beginReplication(src *rep.ReplicationSource) (*replCall, error) {
	volumeID, err := p.replicatedVolume(src)
	if err != nil {
		return nil, err
	}
	c := &replCall{p: p, id: volumeID, local: p.pool, peer: p.replica}
	unlock, err := p.locks.tryLock(volumeID)
	if err != nil {
		return nil, err
	}
	held := []func(){unlock}
	c.release = func() {
		for i := len(held) - 1; i >= 0; i-- {
			held[i]()
		}
	}
	// Both processes lock the two files in the same (path) order.
	files := []string{c.local.lockFile(volumeID), c.peer.lockFile(volumeID)}
	slices.Sort(files)
	for _, f := range files {
		u, err := flockFile(f)
		if err != nil {
			c.release()
			return nil, err
		}
		held = append(held, u)
	}
	if c.lrec, err = c.local.replication(volumeID); err == nil {
		c.prec, err = c.peer.replication(volumeID)
	}
	if err != nil {
		c.release()
		return nil, err
	}
	return c, nil
}

// lockFile is the file the two sides of a replicated volume flock.
func (p *Pool) lockFile(id string) string {
	return filepath.Join(p.metaDir(metaReplication), id+".lock")
}

// replication returns the side's record, nil if it has none.
func (p *Pool) replication(id string) (*replicationRecord, error) {
	var r replicationRecord
	if err := p.readRecord(metaReplication, id, &r); errors.Is(err, ErrNotFound) {
		return nil, nil
	} else if err != nil {
		return nil, err
	}
	return &r, nil
}

// ours reports whether the peer's record pairs with this side.
func (c *replCall) ours(r *replicationRecord) bool {
	return r != nil && r.Peer == c.local.Dir()
}

// volume returns the local volume, or NotFound.
func (c *replCall) volume() (Volume, error) { return c.local.Get(c.id) }

// beginEnabled is beginReplication for a call on a local volume with
// replication enabled (FailedPrecondition unless this side has a record);
// it also returns the volume.
func (p *Plugin) beginEnabled(src *rep.ReplicationSource) (*replCall, Volume, error) {
	c, err := p.beginReplication(src)
	if err != nil {
		return nil, Volume{}, err
	}
	vol, err := c.volume()
	if err == nil && c.lrec == nil {
		err = preconditionf("replication is not enabled for volume %s", c.id)
	}
	if err != nil {
		c.release()
		return nil, Volume{}, err
	}
	return c, vol, nil
}

// setRole records this side's new role (promoted or demoted, with force
// or not) and logs it.
func (c *replCall) setRole(role string, force bool) error {
	c.lrec.Role = role
	if err := c.save(sideRecord{c.local, c.lrec}); err != nil {
		return err
	}
	msg := "volume promoted"
	if role == roleSecondary {
		msg = "volume demoted"
	}
	c.p.log.Info(msg, "volume", c.id, "force", force)
	return nil
}

// sideRecord is one side's record and the pool it belongs in.
type sideRecord struct {
	pool *Pool
	rec  *replicationRecord
}

// save writes the records, in order.
func (c *replCall) save(recs ...sideRecord) error {
	for _, r := range recs {
		if err := r.pool.writeRecord(metaReplication, c.id, r.rec); err != nil {
			return err
		}
	}
	return nil
}

// notAttached fails if the image at path is attached to a loop device
// (staged somewhere on this host).
func notAttached(id, path, what string) error {
	ds, err := loopdev.FindAll(path)
	if err != nil {
		return fmt.Errorf("volume %s: %w", id, err)
	}
	if len(ds) > 0 {
		return preconditionf("the %s copy of volume %s is staged (attached to %s): unstage it first", what, id, ds[0].Path)
	}
	return nil
}

// sync makes the copy in to equal the copy in from (full: rewrite all its
// data instead of comparing), with the source frozen if it is staged. The
// target is marked inconsistent while it is written. Both records get
// the sync; the caller's records are updated in place.
func (c *replCall) sync(ctx context.Context, from, to *Pool, fromRec, toRec *replicationRecord, full bool) error {
	srcPath, dstPath := from.path(c.id), to.path(c.id)
	if err := notAttached(c.id, dstPath, "target"); err != nil {
		return err
	}
	point, blocked, err := quiescePoint(srcPath)
	if err != nil {
		return err
	}
	if blocked {
		return preconditionf("volume %s is staged for block access in %s: it cannot be quiesced for a sync", c.id, from.Dir())
	}
	var points []string
	if point != "" {
		points = []string{point}
	}
	_, freeze, err := replParams(fromRec.Parameters)
	if err != nil {
		return err
	}
	src, err := os.Open(srcPath)
	if err != nil {
		return fmt.Errorf("sync volume %s: %w", c.id, err)
	}
	defer src.Close()
	dst, err := os.OpenFile(dstPath, os.O_RDWR|unix.O_CLOEXEC, 0)
	if errors.Is(err, os.ErrNotExist) {
		return preconditionf("the copy of volume %s in %s is gone", c.id, to.Dir())
	}
	if err != nil {
		return fmt.Errorf("sync volume %s: %w", c.id, err)
	}
	defer dst.Close()

	toRec.Consistent = false
	if err := c.save(sideRecord{to, toRec}); err != nil {
		return err
	}
	start := time.Now()
	var st copyStats
	err = c.p.whileFrozen(ctx, points, freeze, func(ctx context.Context) error {
		if full {
			fi, err := dst.Stat()
			if err != nil {
				return err
			}
			if err := punch(dst, 0, fi.Size(), &st); err != nil {
				return err
			}
			st = copyStats{}
		}
		var serr error
		st, serr = syncImage(ctx, src, dst, full)
		return serr
	})
	if err == nil {
		err = dst.Sync()
	}
	if err != nil {
		return fmt.Errorf("sync volume %s from %s to %s: %w", c.id, from.Dir(), to.Dir(), err)
	}
	rec := &syncRecord{Time: start.UTC(), Duration: time.Since(start), Bytes: st.written + st.punched, From: from.Dir(), Full: full}
	toRec.Consistent, toRec.LastSync, fromRec.LastSync = true, rec, rec
	if err := c.save(sideRecord{to, toRec}, sideRecord{from, fromRec}); err != nil {
		return err
	}
	c.p.log.Info("replication synced", "volume", c.id, "from", from.Dir(), "to", to.Dir(),
		"bytes", rec.Bytes, "duration", rec.Duration.Round(time.Microsecond), "full", full, "frozen", len(points) > 0)
	return nil
}

// EnableVolumeReplication makes this side primary and copies the volume
// into the replica pool (sparse), which becomes the secondary. Enabling
// again succeeds without changing roles. Parameters: schedulingInterval,
// freezeTimeout.
func (s *replicationServer) EnableVolumeReplication(ctx context.Context, req *rep.EnableVolumeReplicationRequest) (*rep.EnableVolumeReplicationResponse, error) {
	c, err := s.p.beginReplication(req.GetReplicationSource())
	if err != nil {
		return nil, err
	}
	defer c.release()
	vol, err := c.volume()
	if err != nil {
		return nil, err
	}
	if c.lrec != nil {
		return &rep.EnableVolumeReplicationResponse{}, nil
	}
	_, freeze, err := replParams(req.GetParameters())
	if err != nil {
		return nil, err
	}
	if c.prec != nil {
		if !c.ours(c.prec) || c.prec.Role != roleSecondary {
			return nil, preconditionf("the replica pool %s has replication state for volume %s (%s of %s): disable replication there first", c.peer.Dir(), c.id, c.prec.Role, c.prec.Peer)
		}
		// An enable interrupted between the replica's record and ours:
		// finish it with a sync of what changed since the copy.
		c.lrec = &replicationRecord{VolumeID: c.id, Role: rolePrimary, Peer: c.peer.Dir(), ReplicationID: req.GetReplicationId(),
			Parameters: req.GetParameters(), Consistent: true, EnabledTime: time.Now().UTC()}
		if err := c.sync(ctx, c.local, c.peer, c.lrec, c.prec, false); err != nil {
			return nil, err
		}
		s.p.log.Info("replication enabled (resumed)", "volume", c.id, "replica", c.peer.Dir())
		return &rep.EnableVolumeReplicationResponse{}, nil
	}
	if _, err := c.peer.Get(c.id); err == nil {
		return nil, preconditionf("the replica pool %s already holds a volume %s: delete it before enabling replication", c.peer.Dir(), c.id)
	} else if !errors.Is(err, ErrNotFound) {
		return nil, err
	}
	point, blocked, err := quiescePoint(vol.Path)
	if err != nil {
		return nil, err
	}
	if blocked {
		return nil, preconditionf("volume %s is staged for block access: it cannot be quiesced for the initial copy", c.id)
	}
	var points []string
	if point != "" {
		points = []string{point}
	}
	src, err := os.Open(vol.Path)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	start := time.Now()
	var st copyStats
	if _, _, err := c.peer.create(c.id, vol.Size, nil, func(tmp *os.File) error {
		return s.p.whileFrozen(ctx, points, freeze, func(ctx context.Context) error {
			var cerr error
			st, cerr = copyImage(ctx, src, tmp, false)
			return cerr
		})
	}); err != nil {
		return nil, fmt.Errorf("enable replication of volume %s: %w", c.id, err)
	}
	now := time.Now().UTC()
	sync := &syncRecord{Time: start.UTC(), Duration: time.Since(start), Bytes: st.written, From: c.local.Dir(), Full: true}
	c.prec = &replicationRecord{VolumeID: c.id, Role: roleSecondary, Peer: c.local.Dir(), ReplicationID: req.GetReplicationId(),
		Parameters: req.GetParameters(), Consistent: true, LastSync: sync, EnabledTime: now}
	c.lrec = &replicationRecord{VolumeID: c.id, Role: rolePrimary, Peer: c.peer.Dir(), ReplicationID: req.GetReplicationId(),
		Parameters: req.GetParameters(), Consistent: true, LastSync: sync, EnabledTime: now}
	if err := c.save(sideRecord{c.peer, c.prec}, sideRecord{c.local, c.lrec}); err != nil {
		return nil, err
	}
	s.p.log.Info("replication enabled", "volume", c.id, "replica", c.peer.Dir(), "bytes", sync.Bytes, "duration", sync.Duration.Round(time.Microsecond))
	return &rep.EnableVolumeReplicationResponse{}, nil
}

// DisableVolumeReplication removes both sides' replication state; both
// copies stay as independent volumes. Not enabled is already disabled.
func (s *replicationServer) DisableVolumeReplication(ctx context.Context, req *rep.DisableVolumeReplicationRequest) (*rep.DisableVolumeReplicationResponse, error) {
	c, err := s.p.beginReplication(req.GetReplicationSource())
	if err != nil {
		return nil, err
	}
	defer c.release()
	if _, err := c.volume(); err != nil {
		return nil, err
	}
	if c.ours(c.prec) {
		if err := c.peer.removeRecord(metaReplication, c.id); err != nil {
			return nil, err
		}
	}
	if c.lrec != nil {
		if err := c.local.removeRecord(metaReplication, c.id); err != nil {
			return nil, err
		}
		s.p.log.Info("replication disabled", "volume", c.id, "role", c.lrec.Role)
	}
	return &rep.DisableVolumeReplicationResponse{}, nil
}

// PromoteVolume makes this side primary. The other side must have been
// demoted (it then pushed its last changes here) and this copy must be
// consistent; force promotes anyway (the other side, if it is still
// primary, then syncs nothing more here and must be demoted and
// resynced). Already primary is success.
func (s *replicationServer) PromoteVolume(ctx context.Context, req *rep.PromoteVolumeRequest) (*rep.PromoteVolumeResponse, error) {
	c, _, err := s.p.beginEnabled(req.GetReplicationSource())
	if err != nil {
		return nil, err
	}
	defer c.release()
	if c.lrec.Role == rolePrimary {
		return &rep.PromoteVolumeResponse{}, nil
	}
	force := req.GetForce()
	switch {
	case force:
	case c.prec == nil:
		return nil, preconditionf("the peer %s has no replication state for volume %s: promote with force", c.peer.Dir(), c.id)
	case c.prec.Role == rolePrimary:
		return nil, preconditionf("the copy of volume %s in %s is still primary: demote it first, or promote with force", c.id, c.peer.Dir())
	case !c.lrec.Consistent:
		return nil, preconditionf("an interrupted sync left this copy of volume %s inconsistent: resync it, or promote with force", c.id)
	}
	if err := c.setRole(rolePrimary, force); err != nil {
		return nil, err
	}
	return &rep.PromoteVolumeResponse{}, nil
}

// DemoteVolume makes this side secondary, after a final sync of its
// changes to the other side if that one is secondary (a side promoted with
// force meanwhile is primary and keeps its data). The volume must not be
// staged here. force demotes even if the final sync fails or the other
// side's state is missing. Already secondary is success.
func (s *replicationServer) DemoteVolume(ctx context.Context, req *rep.DemoteVolumeRequest) (*rep.DemoteVolumeResponse, error) {
	c, vol, err := s.p.beginEnabled(req.GetReplicationSource())
	if err != nil {
		return nil, err
	}
	defer c.release()
	if c.lrec.Role == roleSecondary {
		return &rep.DemoteVolumeResponse{}, nil
	}
	if err := notAttached(c.id, vol.Path, "local"); err != nil {
		return nil, err
	}
	force := req.GetForce()
	switch {
	case c.ours(c.prec) && c.prec.Role == roleSecondary:
		if err := c.sync(ctx, c.local, c.peer, c.lrec, c.prec, false); err != nil {
			if !force {
				return nil, err
			}
			s.p.log.Warn("demoting without a final sync", "volume", c.id, "error", err)
		}
	case c.ours(c.prec):
		s.p.log.Warn("the peer was promoted meanwhile; demoting without a final sync", "volume", c.id, "peer", c.peer.Dir())
	case !force:
		return nil, preconditionf("the peer %s has no replication state for volume %s: demote with force", c.peer.Dir(), c.id)
	}
	if err := c.setRole(roleSecondary, force); err != nil {
		return nil, err
	}
	return &rep.DemoteVolumeResponse{}, nil
}

// ResyncVolume brings a demoted copy up to date with the primary (force:
// rewrites all its data instead of comparing). It reports ready once the
// copy equals the primary's; with no primary on the other side there is
// nothing to sync from and it reports not ready. A primary is
// FailedPrecondition, and so is a copy staged here.
func (s *replicationServer) ResyncVolume(ctx context.Context, req *rep.ResyncVolumeRequest) (*rep.ResyncVolumeResponse, error) {
	c, _, err := s.p.beginEnabled(req.GetReplicationSource())
	if err != nil {
		return nil, err
	}
	defer c.release()
	if c.lrec.Role != roleSecondary {
		return nil, preconditionf("volume %s is primary here: only a demoted copy can be resynced", c.id)
	}
	if !c.ours(c.prec) || c.prec.Role != rolePrimary {
		s.p.log.Warn("resync: the peer is not primary, nothing to sync from", "volume", c.id, "peer", c.peer.Dir())
		return &rep.ResyncVolumeResponse{Ready: false}, nil
	}
	if err := c.sync(ctx, c.peer, c.local, c.prec, c.lrec, req.GetForce()); err != nil {
		return nil, err
	}
	return &rep.ResyncVolumeResponse{Ready: true}, nil
}

// replicationOf finds the volume a read-only replication call names and
// its replication state (nil when replication is not enabled for it).
func (s *replicationServer) replicationOf(src *rep.ReplicationSource) (string, *replicationRecord, error) {
	id, err := s.p.replicatedVolume(src)
	if err != nil {
		return "", nil, err
	}
	if _, err := s.p.pool.Get(id); err != nil {
		return "", nil, err
	}
	r, err := s.p.pool.replication(id)
	if err != nil {
		return "", nil, err
	}
	return id, r, nil
}

// GetVolumeReplicationInfo reports the last sync of a primary.
func (s *replicationServer) GetVolumeReplicationInfo(ctx context.Context, req *rep.GetVolumeReplicationInfoRequest) (*rep.GetVolumeReplicationInfoResponse, error) {
	id, r, err := s.replicationOf(req.GetReplicationSource())
	if err != nil {
		return nil, err
	}
	switch {
	case r == nil:
		return nil, preconditionf("replication is not enabled for volume %s", id)
	case r.Role != rolePrimary:
		return nil, preconditionf("volume %s is not primary here", id)
	case r.LastSync == nil:
		return nil, notFoundf("volume %s has not been synced yet", id)
	}
	resp := &rep.GetVolumeReplicationInfoResponse{
		LastSyncTime:     timestamppb.New(r.LastSync.Time),
		LastSyncDuration: durationpb.New(r.LastSync.Duration),
		LastSyncBytes:    r.LastSync.Bytes,
		Status:           rep.GetVolumeReplicationInfoResponse_HEALTHY,
	}
	// A scheduled replication two intervals behind is degraded.
	if interval, _, err := replParams(r.Parameters); err == nil && interval > 0 {
		if late := time.Since(r.LastSync.Time); late > 2*interval {
			resp.Status = rep.GetVolumeReplicationInfoResponse_DEGRADED
			resp.StatusMessage = fmt.Sprintf("last sync %s ago, scheduling interval %s", late.Round(time.Second), interval)
		}
	}
	return resp, nil
}

// GetReplicationDestinationInfo names the replica's copy: the replica pool
// keeps the volume under the same id.
func (s *replicationServer) GetReplicationDestinationInfo(ctx context.Context, req *rep.GetReplicationDestinationInfoRequest) (*rep.GetReplicationDestinationInfoResponse, error) {
	id, r, err := s.replicationOf(req.GetReplicationSource())
	if err != nil {
		return nil, err
	}
	if r == nil {
		return nil, preconditionf("replication is not enabled for volume %s", id)
	}
	return &rep.GetReplicationDestinationInfoResponse{ReplicationDestination: &rep.ReplicationDestination{
		Type: &rep.ReplicationDestination_Volume{Volume: &rep.ReplicationDestination_VolumeDestination{VolumeId: r.VolumeID}},
	}}, nil
}

// runReplication syncs, every tick, the primaries whose
// schedulingInterval has passed since their last sync, until ctx ends. A
// volume busy with another call is skipped until the next tick; errors
// are logged.
func (p *Plugin) runReplication(ctx context.Context) {
	if p.replica == nil {
		return
	}
	every(ctx, p.replicationTick, func() {
		ids, err := p.pool.listRecords(metaReplication)
		if err != nil {
			p.log.Warn("replication scheduler", "error", err)
			return
		}
		for _, id := range ids {
			if ctx.Err() != nil {
				return
			}
			if err := p.scheduledSync(ctx, id); err != nil && !errors.Is(err, ErrBusy) {
				p.log.Warn("scheduled replication sync failed", "volume", id, "error", err)
			}
		}
	})
}

func (p *Plugin) scheduledSync(ctx context.Context, id string) error {
	r, err := p.pool.replication(id)
	if err != nil || r == nil || r.Role != rolePrimary {
		return err
	}
	interval, _, err := replParams(r.Parameters)
	if err != nil || interval == 0 || (r.LastSync != nil && time.Since(r.LastSync.Time) < interval) {
		return err
	}
	c, err := p.beginReplication(volumeSource(id))
	if err != nil {
		return err
	}
	defer c.release()
	if c.lrec == nil || c.lrec.Role != rolePrimary || !c.ours(c.prec) || c.prec.Role != roleSecondary {
		return nil
	}
	return c.sync(ctx, c.local, c.peer, c.lrec, c.prec, false)
}
