package isolator

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	"os/user"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/internal/optrace"
	"github.com/csiagent/csiagent/internal/redact"
	"github.com/csiagent/csiagent/mount"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// Prepare gives a container its volumes. All or nothing: on failure
// everything done for this container is undone before returning.
func (iso *Isolator) Prepare(ctx context.Context, req *statev1.PrepareRequest) ([]*statev1.ContainerMount, error) {
	defer iso.traceCheckpoints(ctx)()
	plan, err := iso.plan(req)
	if err != nil {
		return nil, err
	}
	for _, pm := range plan {
		if err := iso.checkSecrets(pm); err != nil {
			return nil, err
		}
	}
	uid, gid, err := lookupUser(req.GetUser())
	if err != nil {
		return nil, err
	}
	id := req.GetContainerId()
	c, unlock, err := iso.lockContainer(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("container %s: %w", id, err)
	}
	defer unlock()
	if c != nil {
		if quarantined(c.cp) {
			return nil, fmt.Errorf("%w: container %s is quarantined (%s)", ErrPrecondition, id, c.cp.GetLastError())
		}
		if !sameRequest(c.cp.GetRequest(), req) {
			return nil, fmt.Errorf("%w: container %s already has a different set of volumes; clean it up first", ErrPrecondition, id)
		}
		if c.cp.GetPhase() == statev1.ContainerCheckpoint_PREPARED {
			// Acknowledged before: its mounts must really be there.
			if missing := iso.missingMounts(c); len(missing) > 0 {
				iso.remount(ctx, c, true, downPlugins{})
				if missing = iso.missingMounts(c); len(missing) > 0 {
					return nil, fmt.Errorf("%w: container %s is prepared but its mounts %v are gone and cannot be restored; clean it up first", ErrPrecondition, id, missing)
				}
			}
			// What the first answer acknowledged may not be durable yet
			// (or its commit failed): acknowledge it only once it is.
			if err := iso.sync(ctx); err != nil {
				return nil, fmt.Errorf("container %s: %w", id, err)
			}
			return c.cp.GetMounts(), nil
		}
		// An interrupted prepare or cleanup: finish undoing it, then
		// start afresh.
		if err := iso.cleanupLocked(ctx, c, false); err != nil {
			return nil, err
		}
	}
	// The whole request (secrets stripped) at debug; a line per volume is
	// what an operator reads, and a tenth of the cost on the hot path.
	iso.log.Info("preparing container", "container", id, "volumes", planSummary(plan))
	iso.log.Debug("prepare request", "container", id, "request", redact.Value(req))
	c = &container{
		id:  id,
		dir: filepath.Join(iso.containersRoot(), id),
		cp:  &statev1.ContainerCheckpoint{ContainerId: id, Request: req},
	}
	if pid := int(req.GetPid()); pid != 0 {
		// Recorded against pid reuse: a mount is removed only from the
		// namespace it was made in.
		ns, err := iso.mounter(ctx).MountNamespace(pid)
		if err != nil {
			return nil, fmt.Errorf("%w: pid %d: %w", ErrInvalid, pid, err)
		}
		if req.GetConfined() && ns != req.GetCheckedMountNamespace() {
			// The member's process made itself a namespace (its own
			// user namespace's, where it may bind "/" anywhere) after
			// the API server checked the one it was in.
			return nil, fmt.Errorf("%w: pid %d is no longer in the mount namespace it was checked in", ErrPrecondition, pid)
		}
		c.cp.MountNamespace = ns
	}
	if err := checkpointStep(ctx, "checkpoint container PREPARING", func() error { return iso.setPhase(c, statev1.ContainerCheckpoint_PREPARING) }); err != nil {
		return nil, err
	}
	if err := iso.prepareMounts(ctx, c, plan, uid, gid); err != nil {
		iso.log.Warn("prepare failed; rolling back", "container", id, "error", err)
		// The caller's ctx may be what ended: roll back regardless.
		if rerr := iso.cleanupLocked(context.WithoutCancel(ctx), c, false); rerr != nil {
			iso.log.Error("rolling back a failed prepare", "container", id, "error", rerr)
			return nil, fmt.Errorf("%w (and rolling back failed, to be retried: %v)", err, rerr)
		}
		return nil, err
	}
	if err := checkpointStep(ctx, "checkpoint container PREPARED", func() error { return iso.setPhase(c, statev1.ContainerCheckpoint_PREPARED) }); err != nil {
		return nil, err
	}
	// Acknowledged only once PREPARED is durable, and with it (changes
	// commit in order) the volume records and their users: recovery
	// rolls back any container not PREPARED on disk.
	if err := iso.durable(ctx, c, c.written); err != nil {
		iso.log.Error("prepare not durable; rolling back", "container", id, "error", err)
		if rerr := iso.cleanupLocked(context.WithoutCancel(ctx), c, false); rerr != nil {
			return nil, fmt.Errorf("%w (and rolling back failed, to be retried: %v)", err, rerr)
		}
		return nil, err
	}
	iso.log.Info("container prepared", "container", id, "volumes", len(plan))
	return c.cp.GetMounts(), nil
}

func (iso *Isolator) prepareMounts(ctx context.Context, c *container, plan []plannedMount, uid, gid int) error {
	// The volumes are acquired (staged, published) concurrently: each
	// under its own lock, one lock at a time, so no order can deadlock;
	// their checkpoints are in different files, whose fsyncs the
	// filesystem commits together. The container's mounts then follow in
	// request order.
	vcps := make([]*statev1.VolumeCheckpoint, len(plan))
	errs := make([]error, len(plan))
	if len(plan) == 1 {
		vcps[0], errs[0] = iso.acquire(ctx, plan[0], c.id)
	} else {
		sem := make(chan struct{}, maxParallelAcquire)
		var wg sync.WaitGroup
		for i, pm := range plan {
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				vcps[i], errs[i] = iso.acquire(ctx, pm, c.id)
			})
		}
		wg.Wait()
	}
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return iso.mountAll(ctx, c, plan, vcps, uid, gid)
}

// maxParallelAcquire caps the volumes of one Prepare acquired at once.
const maxParallelAcquire = 8

// planSummary lists a Prepare's volumes as plugin/volume->container_path
// (RO|RW).
func planSummary(plan []plannedMount) string {
	var b strings.Builder
	for i, pm := range plan {
		if i > 0 {
			b.WriteString(", ")
		}
		mode := "RW"
		if pm.readonly {
			mode = "RO"
		}
		fmt.Fprintf(&b, "%s->%s (%s)", pm.key, pm.containerPath, mode)
	}
	return b.String()
}

// mountAll mounts each published volume at the container's mount point: on
// the host, or inside the container's mount namespace for a request with a
// pid. Parents go before children (by path depth), and a mount point is
// resolved only once every mount above it is made, so /data/sub lands in
// the volume at /data, not under it. Mounts go in batches of paths none of
// which is below another (one batch unless paths nest): each batch's mount
// points are resolved inside their root (creating what is missing) and
// the volumes cloned, then all are checkpointed in one write with their
// identities (the new mount's id, the id of the mount it goes on, the
// namespace), then moved into place. A crash in between knows what to
// unmount, and by which id. A mount that fails leaves the record with the
// mounts made before it, for the rollback to undo.
func (iso *Isolator) mountAll(ctx context.Context, c *container, plan []plannedMount, vcps []*statev1.VolumeCheckpoint, uid, gid int) error {
	ns, err := iso.mountNamespace(ctx, c)
	if err != nil {
		return err
	}
	order := mountOrder(plan)
	var made []*statev1.ContainerMount
	for len(order) > 0 {
		n := batchLen(plan, order)
		pending := make([]*pendingMount, 0, n)
		defer func() {
			for _, p := range pending {
				p.close()
			}
		}()
		records := append([]*statev1.ContainerMount(nil), made...)
		for _, i := range order[:n] {
			p, err := iso.readyMount(ctx, c, plan[i], vcps[i], ns, uid, gid)
			if err != nil {
				return err
			}
			pending = append(pending, p)
			records = append(records, p.rec)
		}
		if err := checkpointStep(ctx, "checkpoint container mounts", func() error {
			return iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) { cp.Mounts, cp.BootId = records, iso.bootID })
		}); err != nil {
			return err
		}
		for _, p := range pending {
			if err := iso.mountOne(ctx, c, p, uid, gid); err != nil {
				if serr := iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) { cp.Mounts, cp.BootId = made, iso.bootID }); serr != nil {
					iso.log.Error("checkpointing the mounts made", "container", c.id, "error", serr)
				}
				return fmt.Errorf("volume %s: %w", p.pm.key, err)
			}
			made = append(made, p.rec)
		}
		order = order[n:]
	}
	return nil
}

// mountNamespace is the identity of the mount namespace a container's
// mounts are made in: its process's, or the agent's own.
func (iso *Isolator) mountNamespace(ctx context.Context, c *container) (uint64, error) {
	if c.cp.GetRequest().GetPid() != 0 {
		return c.cp.GetMountNamespace(), nil
	}
	ns, err := iso.mounter(ctx).MountNamespace(os.Getpid())
	if err != nil {
		return 0, fmt.Errorf("container %s: %w", c.id, err)
	}
	return ns, nil
}

// pendingMount is a mount about to be made: the volume cloned, detached,
// and, on the host, the resolved mount point.
type pendingMount struct {
	pm     plannedMount
	rec    *statev1.ContainerMount
	tree   *os.File
	target *os.File // host mounts only
}

func (p *pendingMount) close() {
	p.tree.Close()
	if p.target != nil {
		p.target.Close()
	}
}

// readyMount resolves one mount point (creating what is missing) and
// clones the volume, and returns the mount's record with its identity.
func (iso *Isolator) readyMount(ctx context.Context, c *container, pm plannedMount, vcp *statev1.VolumeCheckpoint, ns uint64, uid, gid int) (*pendingMount, error) {
	req := c.cp.GetRequest()
	hostPath := vcp.GetTargetPath()
	if pm.readonly && pm.block {
		// A device its users cannot write (acquire's publishReadOnly
		// checked it).
		hostPath = vcp.GetRoTargetPath()
	}
	if err := iso.checkMounted(ctx, pm.key, hostPath); err != nil {
		return nil, err
	}
	if !pm.readonly && !pm.block && len(vcp.GetUsers()) == 1 {
		// Its only user: a volume that others use already (another
		// principal's, maybe) is not given to this one's user.
		if err := giveVolumeRoot(hostPath, uid, gid); err != nil {
			return nil, err
		}
	}
	p := &pendingMount{pm: pm, rec: &statev1.ContainerMount{
		PluginName: pm.key.plugin, VolumeId: pm.key.id, ContainerPath: pm.containerPath,
		HostPath: hostPath, Readonly: pm.readonly, MountNamespace: ns,
	}}
	resolve := func(m Mounter) (*os.File, error) {
		target, mp, err := resolveMountPoint(m, req, pm.containerPath, pm.block, uid, gid)
		if err != nil {
			return nil, err
		}
		parent, err := m.ID(target)
		if err != nil {
			target.Close()
			return nil, err
		}
		p.rec.MountPoint, p.rec.ParentMountId = mp, parent
		return target, nil
	}
	var err error
	if req.GetPid() == 0 {
		p.target, err = resolve(iso.mounter(ctx))
	} else {
		// Resolved (and created) in the container's namespace to learn
		// the path and parent to record; resolved again there when
		// mounting.
		err = iso.inNamespace(ctx, c, func(m Mounter) error {
			target, err := resolve(m)
			if err != nil {
				return err
			}
			target.Close()
			return notShared(m, p.rec.ParentMountId)
		})
	}
	if err != nil {
		return nil, fmt.Errorf("%w: volume %s: container_path %q: %w", ErrInvalid, pm.key, pm.containerPath, err)
	}
	var cid cloneID
	if p.tree, cid, err = iso.clone(ctx, p.rec.HostPath, pm.readonly); err != nil {
		p.close()
		return nil, fmt.Errorf("volume %s: %w", pm.key, err)
	}
	cid.setOn(p.rec)
	return p, nil
}

// notShared refuses a mount point on a shared mount of a container's
// namespace (the container's creator asked for one, such as Docker's
// "-v /x:/mnt:rshared"): a volume mounted there would propagate to the
// mount's peers, the host's /x among them, where the agent neither
// records nor looks for it; the container's cleanup, its namespace gone,
// would tear the volume down under that copy.
func notShared(m Mounter, parent uint64) error {
	ms, err := m.List(func(i *mountinfo.Info) (skip, stop bool) {
		hit := uint64(i.ID) == parent
		return !hit, hit
	})
	if err != nil || len(ms) == 0 {
		return err
	}
	if g := mount.PeerGroup(ms[0].Optional, "shared:"); g != "" {
		return fmt.Errorf("%w: it is on mount %s of the container's namespace, which is shared (peer group %s): the volume would propagate to the mount's peers, outside the container (the host's own, with a bind given rshared propagation); give that bind private or slave propagation (rprivate, rslave)", ErrPrecondition, ms[0].Mountpoint, g)
	}
	return nil
}

// cloneID is what identifies a container mount the agent made: the
// clone's mount id and its root's device and inode, read from the clone
// itself when it is made (see mount.Identity).
type cloneID struct {
	mount uint64
	root  mount.Root
}

// setOn records the clone's identity in a container's mount record, and
// the device it gives (a block volume's).
func (id cloneID) setOn(m *statev1.ContainerMount) {
	m.MountId, m.RootDev, m.RootIno, m.BlockDevice, m.UniqueMountId = id.mount, id.root.Dev, id.root.Ino, id.root.BlockDevice, id.root.UniqueID
}

// clone makes the detached mount tree of source for a container mount
// and reads its identity.
func (iso *Isolator) clone(ctx context.Context, source string, readOnly bool) (*os.File, cloneID, error) {
	m := iso.mounter(ctx)
	tree, err := m.CloneTree(source, readOnly)
	if err != nil {
		return nil, cloneID{}, err
	}
	var id cloneID
	if id.mount, err = m.ID(tree); err == nil {
		id.root, err = mount.RootOf(tree)
	}
	if err != nil {
		tree.Close()
		return nil, cloneID{}, err
	}
	return tree, id, nil
}

// mountIdentity is what identifies the recorded mount m for
// mount.UnmountOwn. A record without the clone's root (an earlier
// release's) gets the root of its host path as seen from the agent's own
// mount namespace: looked up inside a container's, that path is the
// container's to make.
func mountIdentity(m *statev1.ContainerMount) mount.Identity {
	id := mount.Identity{ID: m.GetMountId(), Parent: m.GetParentMountId(), Source: m.GetHostPath(), RootDev: m.GetRootDev(), RootIno: m.GetRootIno(),
		UniqueID: m.GetUniqueMountId()}
	var st unix.Stat_t
	if id.RootIno == 0 && id.Source != "" && unix.Stat(id.Source, &st) == nil {
		id.RootDev, id.RootIno = st.Dev, st.Ino
	}
	return id
}

// checkMounted refuses a volume whose publish path (the clone's source)
// is not a mount: unmounted outside the agent, a clone of it would hand
// the container the agent's empty directory to write in.
func (iso *Isolator) checkMounted(ctx context.Context, key volumeKey, path string) error {
	ok, err := iso.mounter(ctx).IsMountPoint(path)
	if err != nil {
		return fmt.Errorf("volume %s: %w", key, err)
	}
	if !ok {
		return fmt.Errorf("%w: volume %s: its publish path %s is not mounted (unmounted outside the agent); a repair publishes it again (the next resync pass, unless repair is off), or the first prepare after its last user's cleanup", ErrUnavailable, key, path)
	}
	return nil
}

// mountOne moves a cloned volume onto its mount point: the handle
// resolved on the host, or the mount point resolved again inside the
// container's namespace (both resolutions stay inside the rootfs).
func (iso *Isolator) mountOne(ctx context.Context, c *container, p *pendingMount, uid, gid int) error {
	if p.target != nil {
		err := iso.mounter(ctx).MoveTree(p.tree, p.target)
		iso.cfg.CrashPoint("bind")
		return err
	}
	req := c.cp.GetRequest()
	err := iso.inNamespace(ctx, c, func(m Mounter) error {
		target, _, err := resolveMountPoint(m, req, p.pm.containerPath, p.pm.block, uid, gid)
		if err != nil {
			return err
		}
		defer target.Close()
		return m.MoveTree(p.tree, target)
	})
	iso.cfg.CrashPoint("bind")
	return err
}

// mountOrder returns the indexes of plan, parents before children: by the
// depth of the container path, ties in request order.
func mountOrder(plan []plannedMount) []int {
	order := make([]int, len(plan))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool {
		return pathDepth(plan[order[a]].containerPath) < pathDepth(plan[order[b]].containerPath)
	})
	return order
}

func pathDepth(p string) int {
	return len(strings.FieldsFunc(filepath.Clean(p), func(r rune) bool { return r == '/' }))
}

// batchLen is how many of the mounts next in order can be resolved before
// any of them is made: up to the first whose container path is at or
// below another one's of the batch, in the same root.
func batchLen(plan []plannedMount, order []int) int {
	for n := 1; n < len(order); n++ {
		next := plan[order[n]].containerPath
		for _, i := range order[:n] {
			if nested(plan[i].containerPath, next) {
				return n
			}
		}
	}
	return len(order)
}

// nested reports whether container path b is at or below a, in the same
// root (both absolute: the rootfs; both relative: the sandbox).
func nested(a, b string) bool {
	if filepath.IsAbs(a) != filepath.IsAbs(b) {
		return false
	}
	a, b = filepath.Clean("/"+a), filepath.Clean("/"+b)
	return a == b || a == "/" || strings.HasPrefix(b, a+"/")
}

// inNamespace runs f in the mount namespace of the container's process,
// with the Mounter that acts there.
func (iso *Isolator) inNamespace(ctx context.Context, c *container, f func(Mounter) error) error {
	return iso.mounter(ctx).InNamespace(int(c.cp.GetRequest().GetPid()), c.cp.GetMountNamespace(), f)
}

// unmountFor removes a container's mount, exactly the recorded one (by
// mount id, reached inside the mount's root: see mount.UnmountOwn). For a
// container with a pid the mount lives in its namespace: when that is gone
// (the container ended), so is the mount; while it lives, the mount is
// removed there, inside the rootfs before pivot_root or "/" after it. A
// mount that moved or is gone is logged and described in the note
// returned.
func (iso *Isolator) unmountFor(ctx context.Context, c *container, m *statev1.ContainerMount) (note string, err error) {
	req := c.cp.GetRequest()
	id := mountIdentity(m)
	root := mountRoot(req, m.GetContainerPath())
	var res mount.Result
	if req.GetPid() == 0 {
		mounts := iso.mounter(ctx)
		res, err = mounts.UnmountOwn(ctx, root, m.GetMountPoint(), id)
		if errors.Is(err, mount.ErrOutsideRoot) && root != "/" {
			// Not below the root now: the root's path leads elsewhere
			// than when the mount was made (a member swapped its rootfs
			// for a symlink while it was prepared, then back). Still
			// where the agent put it, the mount is the agent's to
			// remove, reached from the host's root (no symlink on the
			// way) and checked by its identity.
			if at, lerr := mounts.Locate(id); lerr == nil && at == filepath.Clean(m.GetMountPoint()) {
				res, err = mounts.UnmountOwn(ctx, "/", at, id)
			}
		}
	} else {
		err = iso.inNamespace(ctx, c, func(ns Mounter) error {
			path := m.GetMountPoint()
			if _, serr := os.Lstat(root); serr != nil {
				// After pivot_root: the rootfs is "/".
				path = filepath.Join("/", strings.TrimPrefix(path, root))
				root = "/"
			}
			res, err = ns.UnmountOwn(ctx, root, path, id)
			return err
		})
		if errors.Is(err, mount.ErrNoProcess) || errors.Is(err, mount.ErrWrongNamespace) {
			return "", nil
		}
	}
	switch {
	case err != nil:
		return "", err
	case res.Where == mount.Moved:
		note = fmt.Sprintf("mount %d of %s had moved to %s (unmounted there)", id.ID, m.GetMountPoint(), res.Path)
	case res.Where == mount.Gone:
		note = fmt.Sprintf("mount %d of %s was not there (never made, or unmounted by someone else)", id.ID, m.GetMountPoint())
	}
	if note != "" {
		iso.log.Warn("a container's mount was not where it was recorded", "container", c.id, "note", note)
	}
	return note, nil
}

// mountRoot is the root a container path resolves in: the sandbox for a
// relative path, else the rootfs, or the host's "/" when there is none.
func mountRoot(req *statev1.PrepareRequest, containerPath string) string {
	switch {
	case !filepath.IsAbs(containerPath):
		return req.GetSandbox()
	case req.GetRootfs() == "":
		return "/"
	}
	return req.GetRootfs()
}

// resolveMountPoint finds (creating what is missing) a container's mount
// point: an absolute path inside the rootfs, or the host's root when there
// is none; a relative one inside the sandbox. Symlinks resolve inside that
// root, never out of it. A block volume's mount point is a file. m is the
// Mounter of the namespace it is resolved in.
func resolveMountPoint(m Mounter, req *statev1.PrepareRequest, containerPath string, block bool, uid, gid int) (*os.File, string, error) {
	root, done, err := pinnedRoot(req, containerPath)
	if err != nil {
		return nil, "", err
	}
	defer done()
	return m.ResolveInRoot(root, containerPath, mountPointKind(block), uid, gid)
}

// pinnedRoot is mountRoot, for a confined request opened with no symlink
// on the way (mount.PinRoot), in the namespace of the calling thread (the
// container's, for one with a pid): its owner, an API group member, could
// otherwise swap it for a symlink to "/" after the check of its prefix,
// and have directories made and the volume mounted on the host's tree
// (the mount would be found outside the prefix and undone, the
// directories made as the member's user would stay). done releases it.
func pinnedRoot(req *statev1.PrepareRequest, containerPath string) (root string, done func(), err error) {
	root = mountRoot(req, containerPath)
	if !req.GetConfined() {
		return root, func() {}, nil
	}
	pinned, done, err := mount.PinRoot(root)
	if err != nil {
		return "", nil, fmt.Errorf("%w: the container's root %s: %w", ErrPrecondition, root, err)
	}
	return pinned, done, nil
}

// mountPointKind is what a volume's mount point is: a file for a block
// volume, else a directory.
func mountPointKind(block bool) mount.TargetKind {
	if block {
		return mount.File
	}
	return mount.Directory
}

// durable waits until a container's intent record (PREPARING, CLEANING),
// written at the start of the operation, is durable: an operation is
// acknowledged only then, so after any crash, the host's included,
// recovery knows of it. Its commit ran while the operation did its work;
// the records written after it follow with the next commit round.
func (iso *Isolator) durable(ctx context.Context, c *container, intent uint64) error {
	defer optrace.Begin(ctx, optrace.Commit, "Wait: container record durable")()
	if err := iso.commit.Wait(ctx, intent); err != nil {
		return fmt.Errorf("container %s: %w", c.id, err)
	}
	return nil
}

// sync waits until every checkpoint change made so far is durable.
func (iso *Isolator) sync(ctx context.Context) error {
	defer optrace.Begin(ctx, optrace.Commit, "Sync")()
	return iso.commit.Sync(ctx)
}

// checkpointStep runs f, a checkpoint write or removal on an operation's
// path, as an event (kind other) of ctx's trace: the store's writes are
// not traced themselves.
func checkpointStep(ctx context.Context, name string, f func() error) error {
	defer optrace.Begin(ctx, optrace.Other, name)()
	return f()
}

// traceCheckpoints, when ctx carries a trace, returns the func that adds
// to it the checkpoint writes and fsyncs of the Committer from now until
// it is called. The fsyncs run on the Committer's goroutine, in rounds
// shared with whatever else writes: the counts are those of the rounds
// that ran meanwhile, which an operation alone on the node has to itself.
func (iso *Isolator) traceCheckpoints(ctx context.Context) (done func()) {
	tr := optrace.From(ctx)
	if tr == nil {
		return func() {}
	}
	w0, f0, _ := iso.commit.Stats()
	return func() {
		w1, f1, _ := iso.commit.Stats()
		tr.Add("checkpoint writes", w1-w0)
		tr.Add("fsyncs", f1-f0)
	}
}

// Cleanup takes a container's volumes away. An unknown container is
// already clean.
//
// With force, a volume whose teardown fails (its plugin refuses it, is
// gone or down) does not keep the container: the container stops being
// its user, and the volume is forgotten when nothing is mounted at its
// staging and target paths, else kept (without this user) for the resync
// to retry. A mount of the container that does not unmount still fails
// the cleanup: no mount is ever forgotten.
func (iso *Isolator) Cleanup(ctx context.Context, id string, force bool) error {
	return iso.CleanupIf(ctx, id, force, nil)
}

// CleanupIf is Cleanup of a container that allow, unless nil, accepts as
// it is once locked (no Prepare of the same id can change it between the
// check and the cleanup); allow's error is returned as it is.
func (iso *Isolator) CleanupIf(ctx context.Context, id string, force bool, allow func(ContainerInfo) error) error {
	if err := ValidateContainerID(id); err != nil {
		return err
	}
	defer iso.traceCheckpoints(ctx)()
	c, unlock, err := iso.lockContainer(ctx, id)
	if err != nil {
		return fmt.Errorf("container %s: %w", id, err)
	}
	defer unlock()
	if c != nil && allow != nil {
		iso.mu.Lock()
		info := containerInfo(id, c)
		iso.mu.Unlock()
		if err := allow(info); err != nil {
			return err
		}
	}
	if c == nil {
		// Already cleaned up, perhaps by a call whose removal of the
		// record is not durable yet: acknowledge only once it is.
		if err := iso.sync(ctx); err != nil {
			return fmt.Errorf("container %s: %w", id, err)
		}
		return nil
	}
	return iso.cleanupLocked(ctx, c, force)
}

// cleanupLocked unmounts a container's mounts, releases its volumes and
// forgets it. On failure the container stays CLEANING, with the error,
// for Cleanup, Reconcile or the resync to finish. force: see Cleanup.
func (iso *Isolator) cleanupLocked(ctx context.Context, c *container, force bool) error {
	if c.cp.GetPhase() != statev1.ContainerCheckpoint_CLEANING {
		if err := checkpointStep(ctx, "checkpoint container CLEANING", func() error { return iso.setPhase(c, statev1.ContainerCheckpoint_CLEANING) }); err != nil {
			return err
		}
	}
	intent := c.written
	var errs []error
	var notes []string
	// Children before parents: the reverse of the order they were made.
	ms := c.cp.GetMounts()
	for i := len(ms) - 1; i >= 0; i-- {
		m := ms[i]
		// A busy mount is retried for one step's deadline, then left to
		// the next attempt.
		uctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
		note, err := iso.unmountFor(uctx, c, m)
		cancel()
		if err != nil {
			errs = append(errs, fmt.Errorf("unmounting %s: %w", m.GetMountPoint(), err))
		}
		if note != "" {
			notes = append(notes, note)
		}
		iso.cfg.CrashPoint("unbind")
	}
	unmounted := len(errs) == 0
	if unmounted {
		// Every volume the request named: a prepare interrupted after
		// acquiring a volume but before recording its mount still holds
		// it.
		// Concurrently, as in prepareMounts.
		vols := c.cp.GetRequest().GetVolumes()
		rerrs := make([]error, len(vols))
		sem := make(chan struct{}, maxParallelAcquire)
		var wg sync.WaitGroup
		for i, v := range vols {
			csiVol := v.GetSource().GetCsiVolume()
			key := volumeKey{csiVol.GetPluginName(), csiVol.GetStaticProvisioning().GetVolumeId()}
			release := func() {
				rerrs[i] = iso.release(ctx, key, c.id)
				if rerrs[i] != nil && force {
					rerrs[i] = iso.forceRelease(ctx, key, c.id, rerrs[i])
				}
			}
			if len(vols) == 1 {
				release()
				continue
			}
			wg.Go(func() {
				sem <- struct{}{}
				defer func() { <-sem }()
				release()
			})
		}
		wg.Wait()
		for _, err := range rerrs {
			if err != nil {
				errs = append(errs, err)
			}
		}
	}
	if err := errors.Join(errs...); err != nil {
		// The status says what was found where, too.
		lastErr := strings.Join(append([]string{err.Error()}, notes...), "; ")
		if serr := iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) {
			cp.LastError = lastErr
			if unmounted {
				// Gone: the next attempt does not look for them
				// (and would call them unmounted by someone else).
				cp.Mounts = nil
			}
		}); serr != nil {
			iso.log.Error("checkpointing cleanup error", "container", c.id, "error", serr)
		}
		return fmt.Errorf("cleaning up container %s: %w", c.id, err)
	}
	forget := optrace.Begin(ctx, optrace.Other, "forget container record")
	iso.forgetContainer(c)
	forget()
	if err := iso.durable(ctx, c, intent); err != nil {
		return err
	}
	iso.log.Info("container cleaned up", "container", c.id)
	return nil
}

// Reconcile cleans up every container of manager (PrepareRequest.Manager:
// "" for containers no manager named) not in live; another manager's
// containers are not looked at, whatever live says. A plugin found down
// (its wait has the RPC deadline) is not waited for again: the other
// containers using it are reported failed, not tried.
func (iso *Isolator) Reconcile(ctx context.Context, live []string, manager string) ReconcileResult {
	alive := map[string]bool{}
	for _, id := range live {
		alive[id] = true
	}
	resp := ReconcileResult{Failed: map[string]string{}}
	down := downPlugins{}
	// The records as listed, then the namespaces in use: a container
	// listed has had its namespace since before the scan, so one alive
	// now is in it. A record replaced since (the container cleaned up and
	// prepared again, in a new namespace) is not this reconcile's.
	listed := iso.containerRecords()
	scan := sync.OnceValues(iso.mounts.NamespacesInUse)
	for _, id := range slices.Sorted(maps.Keys(listed)) {
		if alive[id] {
			continue
		}
		if err := iso.withListedContainer(ctx, id, listed[id], func(c *container) error {
			req := c.cp.GetRequest()
			if req.GetManager() != manager {
				return nil // another manager's: its live list is not this one
			}
			if why := iso.running(c.cp, scan); why != "" {
				// The caller's live list is wrong about it (another
				// runtime's, or a runtime that answered for other
				// state): its processes would lose their volumes.
				resp.Failed[id] = fmt.Sprintf("container %s: not cleaned up: %s", id, why)
				return nil
			}
			if p, ok := down.of(req); ok {
				resp.Failed[id] = fmt.Sprintf("container %s: not tried: plugin %s did not answer for another container", id, p)
				return nil
			}
			if err := iso.cleanupLocked(ctx, c, false); err != nil {
				down.note(err)
				return err
			}
			resp.CleanedUp = append(resp.CleanedUp, id)
			return nil
		}); err != nil {
			resp.Failed[id] = err.Error()
		}
	}
	return resp
}

// containerRecords is the containers' records by id, as they are now.
func (iso *Isolator) containerRecords() map[string]*container {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	return maps.Clone(iso.containers)
}

// lockContainer takes container id's lock (waiting until ctx ends) and
// returns its record as it is under the lock, nil if it has none. Its
// error does not name the container.
func (iso *Isolator) lockContainer(ctx context.Context, id string) (c *container, unlock func(), err error) {
	waited := optrace.Begin(ctx, optrace.Lock, "container lock")
	unlock, err = iso.containerLocks.Lock(ctx, id)
	waited()
	if err != nil {
		return nil, nil, fmt.Errorf("waiting for another operation on it: %w", err)
	}
	iso.mu.Lock()
	c = iso.containers[id]
	iso.mu.Unlock()
	return c, unlock, nil
}

// withListedContainer runs f with container id locked, if its record is
// still the one listed (a pointer from containerRecords).
func (iso *Isolator) withListedContainer(ctx context.Context, id string, listed *container, f func(*container) error) error {
	c, unlock, err := iso.lockContainer(ctx, id)
	if err != nil {
		return fmt.Errorf("container %s: %w", id, err)
	}
	defer unlock()
	if c == nil || c != listed {
		return nil
	}
	return f(c)
}

// namespaceOfAnotherBoot is the mount namespace recorded for a container
// prepared into a process's namespace before a reboot: gone (no nsfs inode
// has this number).
const namespaceOfAnotherBoot = math.MaxUint64

// running says why a container may still run ("" when it is gone): a
// process is in the mount namespace it was prepared into (from scan, a
// NamespacesInUse made once for many containers, after they were listed),
// or its own recorded process is still there, or either could not be
// looked at. A container prepared without a pid (on the host) is not
// judged, one prepared before a reboot is gone: "".
func (iso *Isolator) running(cp *statev1.ContainerCheckpoint, scan func() (map[uint64]int, error)) string {
	ns := cp.GetMountNamespace()
	if ns == 0 || ns == namespaceOfAnotherBoot {
		return ""
	}
	inUse, err := scan()
	if err != nil {
		return fmt.Sprintf("cannot tell whether its processes are gone: %v", err)
	}
	if pid, ok := inUse[ns]; ok {
		return fmt.Sprintf("it still runs: pid %d is in its mount namespace", pid)
	}
	pid := int(cp.GetRequest().GetPid())
	got, err := iso.mounts.MountNamespace(pid)
	switch {
	case err == nil && got == ns:
		return fmt.Sprintf("it still runs: pid %d is in its mount namespace", pid)
	case err != nil && !errors.Is(err, mount.ErrNoProcess):
		return fmt.Sprintf("cannot tell whether its pid %d is gone: %v", pid, err)
	}
	return ""
}

func (iso *Isolator) containerIDs() []string {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	ids := make([]string, 0, len(iso.containers))
	for id := range iso.containers {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	return ids
}

// pending says why a plugin's volumes wait: it has no config; "" when it
// has one.
func (iso *Isolator) pending(plugin string) string {
	if _, err := iso.cfg.Plugins.Lookup(plugin); errors.Is(err, ErrUnknownPlugin) {
		return "kept as it is until its plugin's config is back: " + err.Error()
	}
	return ""
}

// Tracks reports whether the isolator tracks a volume: it is on the
// node, or on its way on or off (a map lookup, for callers that must not
// wait for a volume's lock).
func (iso *Isolator) Tracks(plugin, volumeID string) bool {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	return iso.volumes[volumeKey{plugin, volumeID}] != nil
}

// ListVolumes reports every tracked volume, sorted by plugin and id.
func (iso *Isolator) ListVolumes() []VolumeInfo {
	out := iso.listVolumes()
	// The plugins' configs are looked up outside the isolator's lock.
	pending := map[string]string{}
	for i, v := range out {
		p, ok := pending[v.Plugin]
		if !ok {
			p = iso.pending(v.Plugin)
			pending[v.Plugin] = p
		}
		out[i].Pending = p
	}
	return out
}

func (iso *Isolator) listVolumes() []VolumeInfo {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	out := make([]VolumeInfo, 0, len(iso.volumes))
	for _, v := range iso.volumes {
		cp := v.cp
		out = append(out, VolumeInfo{
			Plugin: v.key.plugin, ID: v.key.id, State: cp.GetState(), StateSince: optionalTime(cp.GetStateSince()),
			Users: append([]string(nil), cp.GetUsers()...), StagingPath: cp.GetStagingPath(), TargetPath: cp.GetTargetPath(),
			Block: cp.GetStaticProvisioning().GetVolumeCapability().GetBlock() != nil, Readonly: cp.GetReadonly(), LastError: cp.GetLastError(),
			Capability:  proto.CloneOf(cp.GetStaticProvisioning().GetVolumeCapability()),
			NextReclaim: optionalTime(cp.GetNextReclaim()), LastReclaim: cp.GetLastReclaim(), Reclaiming: iso.reclaimActive[v.key],
			NextKeyRotation: optionalTime(cp.GetNextKeyRotation()), LastRepair: cp.GetLastRepair(),
			Attached: cp.GetControllerPublished(), PublishContext: maps.Clone(cp.GetPublishContext()),
		})
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Plugin != out[j].Plugin {
			return out[i].Plugin < out[j].Plugin
		}
		return out[i].ID < out[j].ID
	})
	return out
}

// ListContainers reports every container with volumes, sorted by id.
func (iso *Isolator) ListContainers() []ContainerInfo {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	out := make([]ContainerInfo, 0, len(iso.containers))
	for id, c := range iso.containers {
		out = append(out, containerInfo(id, c))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].ID < out[j].ID })
	return out
}

// containerInfo describes container c (iso.mu held).
func containerInfo(id string, c *container) ContainerInfo {
	return ContainerInfo{
		ID: id, Phase: c.cp.GetPhase(), Mounts: c.cp.GetMounts(), Rootfs: c.cp.GetRequest().GetRootfs(),
		Manager: c.cp.GetRequest().GetManager(), LastError: c.cp.GetLastError(),
	}
}

// sameRequest compares two Prepare requests as sets of volumes.
func sameRequest(a, b *statev1.PrepareRequest) bool {
	norm := func(r *statev1.PrepareRequest) *statev1.PrepareRequest {
		r = proto.Clone(r).(*statev1.PrepareRequest)
		sort.Slice(r.Volumes, func(i, j int) bool {
			ki := r.Volumes[i].GetSource().GetCsiVolume()
			kj := r.Volumes[j].GetSource().GetCsiVolume()
			return ki.GetPluginName()+"/"+ki.GetStaticProvisioning().GetVolumeId() < kj.GetPluginName()+"/"+kj.GetStaticProvisioning().GetVolumeId()
		})
		return r
	}
	return proto.Equal(norm(a), norm(b))
}

// lookupUser resolves the user mount point directories are given to: a
// name, a numeric uid, or "UID:GID" as the OCI hook passes process.user;
// -1 means keep root.
func lookupUser(name string) (uid, gid int, err error) {
	if name == "" {
		return -1, -1, nil
	}
	if u, g, ok := strings.Cut(name, ":"); ok {
		uid, uerr := strconv.ParseUint(u, 10, 31)
		gid, gerr := strconv.ParseUint(g, 10, 31)
		if uerr != nil || gerr != nil {
			return 0, 0, fmt.Errorf("%w: user %q: want a name, a uid or UID:GID", ErrInvalid, name)
		}
		return int(uid), int(gid), nil
	}
	u, err := user.Lookup(name)
	if err != nil {
		if n, perr := strconv.Atoi(name); perr == nil && !strings.HasPrefix(name, "-") {
			return n, n, nil
		}
		return 0, 0, fmt.Errorf("%w: user %q: %w", ErrInvalid, name, err)
	}
	uid, _ = strconv.Atoi(u.Uid)
	gid, _ = strconv.Atoi(u.Gid)
	return uid, gid, nil
}
