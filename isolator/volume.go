package isolator

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/csiagent/csiagent/internal/optrace"
	"github.com/csiagent/csiagent/internal/retrypolicy"
	"github.com/csiagent/csiagent/mount"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// Retry backoff of node RPCs: 200 ms doubling to 5 s, plus up to half of
// it again as jitter (retrypolicy.Backoff), within the RPC timeout.
const (
	retryBase = 200 * time.Millisecond
	retryMax  = 5 * time.Second
)

type vstate = statev1.VolumeCheckpoint_State

// The Mesos volume states.
const (
	stUnknown     = statev1.VolumeCheckpoint_UNKNOWN
	stCreated     = statev1.VolumeCheckpoint_CREATED
	stNodeReady   = statev1.VolumeCheckpoint_NODE_READY
	stVolReady    = statev1.VolumeCheckpoint_VOL_READY
	stPublished   = statev1.VolumeCheckpoint_PUBLISHED
	stNodeStage   = statev1.VolumeCheckpoint_NODE_STAGE
	stNodeUnstage = statev1.VolumeCheckpoint_NODE_UNSTAGE
	stNodePublish = statev1.VolumeCheckpoint_NODE_PUBLISH
	stNodeUnpub   = statev1.VolumeCheckpoint_NODE_UNPUBLISH
	stCtrlPublish = statev1.VolumeCheckpoint_CONTROLLER_PUBLISH
	stCtrlUnpub   = statev1.VolumeCheckpoint_CONTROLLER_UNPUBLISH
)

// withVolume runs f with the volume's lock held. v is nil when the agent
// does not track the volume.
func (iso *Isolator) withVolume(ctx context.Context, key volumeKey, f func(v *volume) error) error {
	waited := optrace.Begin(ctx, optrace.Lock, "volume lock")
	unlock, err := iso.volumeLocks.Lock(ctx, key.String())
	waited()
	if err != nil {
		return fmt.Errorf("volume %s: waiting for another operation on it: %w", key, err)
	}
	defer unlock()
	return f(iso.volumeAt(key))
}

// tryVolume is withVolume for who must not wait: it fails at once when
// another operation holds the volume.
func (iso *Isolator) tryVolume(key volumeKey, f func(v *volume) error) error {
	unlock, ok := iso.volumeLocks.TryLock(key.String())
	if !ok {
		return fmt.Errorf("volume %s: another operation holds it", key)
	}
	defer unlock()
	return f(iso.volumeAt(key))
}

// volumeAt is the volume of key, or nil.
func (iso *Isolator) volumeAt(key volumeKey) *volume {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	return iso.volumes[key]
}

// acquire makes container id a user of the volume and has it published.
// It returns the volume's checkpoint as it then is.
func (iso *Isolator) acquire(ctx context.Context, pm plannedMount, id string) (*statev1.VolumeCheckpoint, error) {
	var out *statev1.VolumeCheckpoint
	err := iso.withVolume(ctx, pm.key, func(v *volume) error {
		// A volume kept with no users may be kept because it is still
		// mounted elsewhere (see heldError).
		idle := v != nil && len(v.cp.Users) == 0
		if v == nil || v.cp.StaticProvisioning == nil {
			p, err := iso.cfg.Plugins.Lookup(pm.key.plugin)
			if err != nil {
				return err
			}
			nv := iso.newVolume(pm.key, p, pm.static, readOnlyAccess(pm.static.GetVolumeCapability()) || pm.static.GetReadonly())
			if v != nil { // reconstructed: keep what is known
				nv.dir = v.dir
				nv.cp.State, nv.cp.Users, nv.cp.StagingPath, nv.cp.TargetPath, nv.cp.RoTargetPath = v.cp.State, v.cp.Users, v.cp.StagingPath, v.cp.TargetPath, v.cp.RoTargetPath
			}
			v = nv
		} else if !sameUse(v.cp.StaticProvisioning, pm.static) {
			// Other containers are not named to this one's caller.
			return fmt.Errorf("%w: volume %s is in use by another container with a different volume_capability, readonly or volume_context", ErrPrecondition, pm.key)
		}
		if singleUser(pm.static.GetVolumeCapability()) && slices.ContainsFunc(v.cp.Users, func(u string) bool { return u != id }) {
			return fmt.Errorf("%w: volume %s is in use by another container and its access mode %s allows one", ErrPrecondition, pm.key, pm.static.GetVolumeCapability().GetAccessMode().GetMode())
		}
		if idle && singleWriter(pm.static.GetVolumeCapability()) {
			// Its filesystem, still mounted where a former user put it,
			// may still be written to: a single writer cannot have it.
			// Multi-writer and read-only users share that instance (the
			// volume is still published: no second stage).
			where, err := iso.foreignMounts(ctx, v)
			if err != nil {
				return err
			}
			if len(where) > 0 {
				return fmt.Errorf("%w: volume %s is still mounted elsewhere (%s) after its last user's cleanup and its access mode %s allows a single writer; it is torn down, and can be given to a new user, once that mount is gone", ErrPrecondition, pm.key, strings.Join(where, ", "), pm.static.GetVolumeCapability().GetAccessMode().GetMode())
			}
		}
		if !slices.Contains(v.cp.Users, id) && !offNode(v.cp) {
			// On the node already: the node's claim is still its own
			// (not handed to another host while this one was away).
			if err := iso.claim(ctx, pm.key, pm.static.GetVolumeCapability()); err != nil {
				return err
			}
		}
		if !slices.Contains(v.cp.Users, id) {
			// The new user is recorded with the first checkpoint the
			// publishing writes (before any RPC), or on its own below if
			// the volume is published already.
			v.pending = append(v.pending, func(cp *statev1.VolumeCheckpoint) {
				cp.Users = append(cp.Users, id)
				slices.Sort(cp.Users)
			})
		}
		defer func() { v.pending = nil }()
		if err := iso.converge(ctx, v, stPublished); err != nil {
			return err
		}
		if err := iso.writePending(v); err != nil {
			return err
		}
		if pm.readonly && pm.block {
			if err := iso.publishReadOnly(ctx, v); err != nil {
				return err
			}
		}
		out = v.cp
		return nil
	})
	return out, err
}

// WhileOffNode runs f under a volume's lock if the volume is not on the
// node (not tracked, or torn down), else refuses with ErrPrecondition
// naming its state and users: a deletion of the backend volume runs so,
// and no Prepare of it comes between the check and the deletion.
func (iso *Isolator) WhileOffNode(ctx context.Context, plugin, id string, f func() error) error {
	key := volumeKey{plugin, id}
	return iso.withVolume(ctx, key, func(v *volume) error {
		if v != nil && (len(v.cp.Users) > 0 || !offNode(v.cp)) {
			return fmt.Errorf("%w: volume %s is on this node (%s, used by %d container(s)): clean them up first", ErrPrecondition, key, v.cp.GetState(), len(v.cp.Users))
		}
		return f()
	})
}

// writePending checkpoints a volume's pending changes, if any.
func (iso *Isolator) writePending(v *volume) error {
	if len(v.pending) == 0 {
		return nil
	}
	return iso.updateVolume(v, func(*statev1.VolumeCheckpoint) {})
}

// release removes container id from the volume's users; the last user
// going tears the volume down (unpublish, unstage, forget), unless its
// filesystem is still mounted elsewhere (heldError): then the volume is
// kept as it is, without users, with that error, and the release
// succeeds.
func (iso *Isolator) release(ctx context.Context, key volumeKey, id string) error {
	cancelled, done := iso.releaseLast(key, id)
	defer done()
	lctx := ctx
	if cancelled {
		var cancel context.CancelFunc
		lctx, cancel = context.WithTimeout(ctx, reclaimCancelWait)
		defer cancel()
	}
	return iso.withVolume(lctx, key, func(v *volume) error {
		if v == nil {
			return nil
		}
		users := slices.DeleteFunc(slices.Clone(v.cp.Users), func(u string) bool { return u == id })
		if len(users) == len(v.cp.Users) && len(users) > 0 {
			return nil
		}
		drop := func(cp *statev1.VolumeCheckpoint) { cp.Users = users }
		if len(users) > 0 {
			return iso.updateVolume(v, drop)
		}
		// The last user goes with the first checkpoint of the teardown
		// (before any RPC); a teardown that fails writes it with its
		// error, and one that ends removes the checkpoint.
		v.pending = append(v.pending, drop)
		defer func() { v.pending = nil }()
		if err := iso.converge(ctx, v, stCreated); err != nil {
			if errors.Is(err, ErrUnknownPlugin) {
				// Not the caller's mistake: the agent cannot reach
				// the plugin to tear the volume down.
				return fmt.Errorf("%w: %w; restore the plugin's config (the volume is then torn down), or forget the container with cleanup --force (the volume stays published until its plugin is back)", ErrPrecondition, err)
			}
			var held *heldError
			if !errors.As(err, &held) {
				return err
			}
			// The container is gone from the volume all the same: the
			// volume is kept, published, for the resync to tear down
			// once the mount elsewhere is.
			iso.log.Warn("keeping a volume without users: it is still mounted elsewhere", "volume", key.String(), "container", id, "error", err)
		}
		return iso.writePending(v)
	})
}

// forceRelease, after release of the volume failed with failure, removes
// container id from its users all the same. A volume left without users
// is forgotten (its directories removed, never across a mount point) when
// nothing is mounted at its staging or target path; otherwise it is kept,
// with failure, for the resync to tear down.
func (iso *Isolator) forceRelease(ctx context.Context, key volumeKey, id string, failure error) error {
	return iso.withVolume(ctx, key, func(v *volume) error {
		if v == nil {
			return nil
		}
		users := slices.DeleteFunc(slices.Clone(v.cp.Users), func(u string) bool { return u == id })
		mounted := iso.anyMounted(v)
		if len(users) > 0 || mounted {
			if len(users) == 0 {
				iso.log.Warn("forced cleanup: keeping a volume that is still mounted for the resync to tear down", "volume", key.String(), "container", id, "error", failure)
			}
			return iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.Users = users })
		}
		iso.log.Warn("forced cleanup: forgetting a volume whose teardown failed; nothing is mounted at its paths", "volume", key.String(), "container", id, "error", failure)
		return iso.teardownDirs(ctx, v)
	})
}

// converge drives a volume (lock held) to PUBLISHED or, for CREATED, tears
// it down and forgets it.
//
// One checkpoint goes before the calls: the first call's transitional
// state (CONTROLLER_PUBLISH, NODE_STAGE, NODE_PUBLISH, NODE_UNPUBLISH,
// NODE_UNSTAGE, CONTROLLER_UNPUBLISH). Recovery reads a transitional state
// as "anywhere between the stable state before and the one wanted" and
// redoes the whole way from the far end (attach, stage and publish toward
// PUBLISHED; unpublish, unstage and detach toward CREATED): these CSI calls
// are idempotent, so a call that had already happened costs a no-op. The
// attach's publish_context goes out with the next checkpoint: a crash
// before it repeats the attach, which answers the same.
// The state reached is checkpointed after the calls: PUBLISHED, the
// checkpoint's removal, or, when a call fails, that call's transitional
// state (it may have acted), with the error.
func (iso *Isolator) converge(ctx context.Context, v *volume, want vstate) error {
	reached, err := iso.convergeSteps(ctx, v, want)
	if err != nil && (v.cp.LastError != err.Error() || reached != v.cp.State || len(v.pending) > 0) {
		if serr := iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.State, cp.LastError = reached, err.Error() }); serr != nil {
			iso.log.Error("checkpointing volume error", "volume", v.key.String(), "error", serr)
		}
	}
	return err
}

// offNode reports whether nothing of the volume is on the node: CREATED,
// or NODE_READY and not attached.
func offNode(cp *statev1.VolumeCheckpoint) bool {
	return cp.GetState() == stCreated || (cp.GetState() == stNodeReady && !cp.GetControllerPublished())
}

// nodeStep is one call between stable states.
type nodeStep struct {
	rpc           func(context.Context, Node, *volume) error
	during, after vstate
}

// path lists the calls that take volume cp from its state to want
// (PUBLISHED or CREATED); from a transitional state, the whole way. A
// plugin that attaches (node.Controller) has the attach first on the way
// up unless the volume is attached with a publish_context known, and the
// detach last on the way down when it is or may be (a CONTROLLER_ state).
func (iso *Isolator) path(cp *statev1.VolumeCheckpoint, want vstate, node Node) []nodeStep {
	cur := cp.GetState()
	var steps []nodeStep
	if want == stPublished {
		if node.Controller != nil && (!cp.GetControllerPublished() || len(cp.GetPublishContext()) == 0 || cur == stCtrlPublish || cur == stCtrlUnpub) {
			steps = append(steps, nodeStep{iso.controllerPublish, stCtrlPublish, stNodeReady})
		}
		if node.StageUnstage && (cur != stVolReady || len(steps) > 0) {
			steps = append(steps, nodeStep{iso.stage, stNodeStage, stVolReady})
		}
		return append(steps, nodeStep{iso.publish, stNodePublish, stPublished})
	}
	if cur != stNodeReady {
		if cur != stVolReady || !node.StageUnstage {
			steps = append(steps, nodeStep{iso.unpublish, stNodeUnpub, stVolReady})
		}
		if node.StageUnstage {
			steps = append(steps, nodeStep{iso.unstage, stNodeUnstage, stNodeReady})
		}
	}
	if node.Controller != nil && (cp.GetControllerPublished() || cur == stCtrlPublish || cur == stCtrlUnpub) {
		steps = append(steps, nodeStep{iso.controllerUnpublish, stCtrlUnpub, stCreated})
	}
	return steps
}

// convergeSteps does converge's work and returns, when it fails, the state
// to record with the error.
func (iso *Isolator) convergeSteps(ctx context.Context, v *volume, want vstate) (vstate, error) {
	if v.cp.State == stUnknown {
		if err := iso.readState(v); err != nil {
			return v.cp.State, err
		}
	}
	switch {
	case want == stPublished && v.cp.State == stPublished:
		return stPublished, iso.clearError(v)
	case want == stCreated && offNode(v.cp):
		return v.cp.State, iso.teardownDirs(ctx, v)
	}
	if want == stCreated {
		// Torn down while a former user still has its filesystem
		// mounted, a volume would be staged again for its next user
		// while that instance lives on: two instances of one
		// filesystem.
		where, err := iso.foreignMounts(ctx, v)
		if err != nil {
			return v.cp.State, err
		}
		if len(where) > 0 {
			return v.cp.State, &heldError{key: v.key, where: where}
		}
	}
	// The wait for a plugin that is not ready is one step, with the
	// step's deadline.
	nctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
	ready := optrace.Begin(ctx, optrace.Other, "plugin ready (Plugins.Node)")
	node, err := iso.cfg.Plugins.Node(nctx, v.key.plugin)
	ready()
	cancel()
	if err != nil {
		return v.cp.State, fmt.Errorf("volume %s: %w", v.key, &pluginDownError{plugin: v.key.plugin, err: err})
	}
	before := v.cp.State
	steps := iso.path(v.cp, want, node)
	if want == stCreated && node.Controller == nil && v.cp.ControllerPublished && len(v.cp.PublishContext) > 0 {
		// Attached by a controller the agent no longer has: kept as it
		// is, so that it is detached once the controller is back.
		return before, fmt.Errorf("%w: volume %s was attached by plugin %s's controller, which is no longer configured or no longer offers PUBLISH_UNPUBLISH_VOLUME: kept until it is back (declare CONTROLLER_SERVICE in the plugin's config)", ErrPrecondition, v.key, v.key.plugin)
	}
	if len(steps) == 0 {
		// Taken as attached (see readState) by a plugin that does not
		// attach: nothing to call.
		return before, iso.teardownDirs(ctx, v)
	}
	switch {
	case v.cp.State != steps[0].during || len(v.pending) > 0:
		if err := checkpointStep(ctx, "checkpoint volume: first step", func() error { return iso.enterState(ctx, v, before, want, steps[0].during, node) }); err != nil {
			return v.cp.State, err
		}
	case want == stPublished:
		// Resumed from the step's mid-way state (an interrupted stage,
		// or recovery after a reboot, which records it first): the
		// node must still hold the claim, as on every way up.
		if err := iso.claim(ctx, v.key, v.cp.GetStaticProvisioning().GetVolumeCapability()); err != nil {
			return v.cp.State, err
		}
	}
	if want == stPublished {
		iso.takeTree(ctx, v)
	}
	var reached vstate
	for i, s := range steps {
		if err := s.rpc(ctx, node, v); err != nil {
			if i == 0 && iso.refusedUntouched(before, err, v) {
				// The plugin refused the first call of the way up
				// outright and nothing is mounted: the volume is where
				// it was, and undoing it needs no call the plugin
				// would refuse the same way.
				return before, err
			}
			// A failed call may have acted (a plugin that mounted and
			// then failed to answer): the volume is between the states
			// before and after it.
			return s.during, err
		}
		reached = s.after
	}
	if want == stPublished {
		return reached, checkpointStep(ctx, "checkpoint volume PUBLISHED", func() error {
			return iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.State, cp.LastError = stPublished, "" })
		})
	}
	return reached, iso.teardownDirs(ctx, v)
}

// refusedUntouched reports whether err, from the first node call of a
// volume on its way up from a state with nothing staged or published, is
// a refusal that means the plugin did nothing (InvalidArgument, NotFound,
// FailedPrecondition) and nothing is mounted at its staging or target
// path.
func (iso *Isolator) refusedUntouched(before vstate, err error, v *volume) bool {
	if before != stCreated && before != stNodeReady {
		return false
	}
	code, ok := RPCCode(err)
	if !ok || !slices.Contains(refusals, code) {
		return false
	}
	return !iso.anyMounted(v)
}

// refusals are the codes with which CSI's error tables say a call did
// nothing: the request was wrong, or the volume is where the plugin cannot
// take it (ControllerPublishVolume: AlreadyExists, incompatibly attached;
// FailedPrecondition, attached to another node; ResourceExhausted, the
// node's attach limit).
var refusals = []codes.Code{codes.InvalidArgument, codes.NotFound, codes.FailedPrecondition, codes.AlreadyExists, codes.ResourceExhausted}

// anyMounted reports whether something is (or may be: the check failed)
// mounted at the volume's staging or target path.
func (iso *Isolator) anyMounted(v *volume) bool {
	for _, p := range []string{v.cp.StagingPath, v.cp.TargetPath} {
		if mounted, err := iso.mounts.IsMountPoint(p); mounted || err != nil {
			return true
		}
	}
	return false
}

// foreignMounts describes where the volume's filesystem is mounted besides
// its own paths (see Mounter.ForeignMounts): the filesystem at its target
// path or, when nothing is mounted there, at its staging path; none when
// neither is mounted. The scan has the RPC timeout.
func (iso *Isolator) foreignMounts(ctx context.Context, v *volume) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
	defer cancel()
	own := []string{v.cp.StagingPath, v.cp.TargetPath}
	if v.cp.RoTargetPath != "" {
		own = append(own, v.cp.RoTargetPath)
	}
	m := iso.mounter(ctx)
	for _, p := range []string{v.cp.TargetPath, v.cp.StagingPath} {
		if p == "" {
			continue
		}
		mounted, err := m.IsMountPoint(p)
		if err != nil {
			return nil, fmt.Errorf("volume %s: %w", v.key, err)
		}
		if !mounted {
			continue
		}
		where, err := m.ForeignMounts(ctx, p, own)
		if err != nil {
			return nil, fmt.Errorf("volume %s: looking for its mounts elsewhere: %w", v.key, err)
		}
		return where, nil
	}
	return nil, nil
}

// heldError: a volume with no users is not torn down because its
// filesystem is still mounted elsewhere (a former user's mount the agent
// did not make). It stays as it is (published), with this error, and the
// resync passes retry the teardown, which goes ahead once those mounts are
// gone; meanwhile it is refused to single-writer users.
type heldError struct {
	key   volumeKey
	where []string
}

func (e *heldError) Error() string {
	return fmt.Sprintf("volume %s is still mounted elsewhere (%s): kept, not torn down, until that mount is gone", e.key, strings.Join(e.where, ", "))
}

// readState finds out a reconstructed volume's state from the mount table.
// Whether its plugin's controller attached it is not known: it is taken as
// attached, with no publish_context, so that its teardown detaches it and
// its way up attaches it again (both idempotent; see path).
func (iso *Isolator) readState(v *volume) error {
	state := stNodeReady
	if ok, _ := iso.mounts.IsMountPoint(v.cp.StagingPath); ok {
		state = stVolReady
	}
	if ok, _ := iso.mounts.IsMountPoint(v.cp.TargetPath); ok {
		state = stPublished
	}
	return iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.State, cp.ControllerPublished = state, true })
}

func (iso *Isolator) clearError(v *volume) error {
	if v.cp.LastError == "" {
		return nil
	}
	return iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.LastError = "" })
}

// teardownDirs forgets a torn-down volume: its record and its mount
// directories (never across a mount point) are removed after the answer
// (removeLater), once a check finds they could be (nothing mounted in
// them, no data: mount.CheckEmptyTree). With Config.Claims, the record
// is removed first, then its claim released (Release makes the removal
// durable first), whether or not ctx has ended (ctx's values, such as a
// trace, go with it): the claim goes with the answer, and no record of
// the volume may outlive it.
func (iso *Isolator) teardownDirs(ctx context.Context, v *volume) error {
	tree, pool := iso.volumeTree(v)
	if err := iso.mounter(ctx).CheckEmptyTree(tree); err != nil {
		return fmt.Errorf("volume %s: %w", v.key, err)
	}
	v.pending = nil
	c := iso.cfg.Claims
	err := checkpointStep(ctx, "forget volume record", func() error {
		r := &removal{kind: "volume", name: v.key.String(), tree: tree, pool: pool, dir: v.dir, file: volumeStateFile}
		if c == nil {
			iso.removeLater(r, func() { delete(iso.volumes, v.key) })
			return nil
		}
		r.file = ""
		if err := iso.forgetVolume(v); err != nil {
			return err
		}
		iso.removeLater(r, func() {})
		return nil
	})
	if err != nil {
		return err
	}
	if c == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), iso.cfg.RPCTimeout)
	defer cancel()
	defer optrace.Begin(ctx, optrace.Claim, "Release")()
	if err := c.Release(ctx, v.key.plugin, v.key.id); err != nil {
		return fmt.Errorf("volume %s: releasing its claim: %w", v.key, err)
	}
	return nil
}

// controllerPublish attaches the volume to this node. An attachment is
// outside the host and survives a power cut, so its intent (the
// CONTROLLER_PUBLISH checkpoint, with the user) is durable before the
// call: recovery then finds the volume and detaches it, or keeps it for
// its user. Its publish_context goes out with the volume's next
// checkpoint and to the node calls that follow.
func (iso *Isolator) controllerPublish(ctx context.Context, node Node, v *volume) error {
	durable := optrace.Begin(ctx, optrace.Commit, "Wait: attach intent")
	err := iso.commit.Wait(ctx, v.written)
	durable()
	if err != nil {
		return fmt.Errorf("volume %s: making its attach intent durable: %w", v.key, err)
	}
	static := v.cp.StaticProvisioning
	secrets, err := iso.resolveSecrets(static.GetControllerPublishSecrets())
	if err != nil {
		return fmt.Errorf("volume %s: controller_publish_secrets: %w", v.key, err)
	}
	var pc map[string]string
	err = iso.call(ctx, v, "ControllerPublishVolume", controllerRetry, func(ctx context.Context) error {
		r, err := node.Controller.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{
			VolumeId:         v.key.id,
			NodeId:           node.NodeID,
			VolumeCapability: static.GetVolumeCapability(),
			Readonly:         v.cp.Readonly && node.PublishReadonly,
			Secrets:          secrets,
			VolumeContext:    static.GetVolumeContext(),
		})
		pc = r.GetPublishContext()
		return err
	})
	if err != nil {
		return err
	}
	v.publishContext = pc
	v.pending = append(v.pending, func(cp *statev1.VolumeCheckpoint) { cp.ControllerPublished, cp.PublishContext = true, pc })
	return nil
}

// controllerUnpublish detaches the volume from this node; NotFound (no
// such volume or node) is done.
func (iso *Isolator) controllerUnpublish(ctx context.Context, node Node, v *volume) error {
	secrets, err := iso.resolveSecrets(v.cp.StaticProvisioning.GetControllerPublishSecrets())
	if err != nil {
		return fmt.Errorf("volume %s: controller_publish_secrets: %w", v.key, err)
	}
	if err := iso.call(ctx, v, "ControllerUnpublishVolume", controllerRetry, func(ctx context.Context) error {
		_, err := node.Controller.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: v.key.id, NodeId: node.NodeID, Secrets: secrets})
		return notFoundIsDone(err)
	}); err != nil {
		return err
	}
	v.publishContext = nil
	v.pending = append(v.pending, func(cp *statev1.VolumeCheckpoint) { cp.ControllerPublished, cp.PublishContext = false, nil })
	return nil
}

// takeTree, for a volume whose directory (the parent of its staging and
// target paths) does not exist, moves a spare one there from its mount
// root's pool (treePool), if the pool has one.
func (iso *Isolator) takeTree(ctx context.Context, v *volume) {
	tree, pool := iso.volumeTree(v)
	if pool == nil {
		return
	}
	if _, err := os.Lstat(tree); errors.Is(err, fs.ErrNotExist) {
		if err := iso.mounter(ctx).TakeTree(pool, tree); err != nil {
			iso.log.Warn("taking a spare volume directory from the pool", "volume", v.key.String(), "error", err)
		}
	}
}

// volumeTree is v's directory (the parent of its target path) and, in
// the agent's own layout (its staging path beside its target path), the
// pool of its mount root: nil for a layout of its own.
func (iso *Isolator) volumeTree(v *volume) (string, *mount.TreePool) {
	tree := filepath.Dir(v.cp.TargetPath)
	if filepath.Dir(v.cp.StagingPath) != tree {
		return tree, nil
	}
	return tree, iso.treePool(tree)
}

// spareTrees is the directory of a mount root that holds its pool of
// spare volume directories (mount.TreePool): a name no volume's directory
// has (encodeVolumeID never starts with a '.').
const spareTrees = ".spare"

// maxSpareTrees is how many spare volume directories a mount root keeps.
const maxSpareTrees = 1024

// treePool is the pool of spare volume directories of the mount root that
// holds tree.
func (iso *Isolator) treePool(tree string) *mount.TreePool {
	root := filepath.Dir(tree)
	p, _ := iso.pools.LoadOrStore(root, &mount.TreePool{Dir: filepath.Join(root, spareTrees), Max: maxSpareTrees, Keep: []string{"staging"}})
	return p.(*mount.TreePool)
}

// mkdirAll makes a staging or target directory (0750), recorded as the
// mount event step of ctx's trace.
func mkdirAll(ctx context.Context, dir, step string) error {
	defer optrace.Begin(ctx, optrace.Mount, step)()
	return os.MkdirAll(dir, 0o750)
}

// attachment is the publish_context for the node calls: the one of an
// attach not yet checkpointed, or the recorded one.
func (v *volume) attachment() map[string]string {
	if v.publishContext != nil {
		return v.publishContext
	}
	return v.cp.GetPublishContext()
}

func (iso *Isolator) stage(ctx context.Context, node Node, v *volume) error {
	if err := mkdirAll(ctx, v.cp.StagingPath, "mkdir staging path"); err != nil {
		return fmt.Errorf("volume %s: creating staging path: %w", v.key, err)
	}
	static := v.cp.StaticProvisioning
	secrets, err := iso.resolveSecrets(static.GetNodeStageSecrets())
	if err != nil {
		return fmt.Errorf("volume %s: node_stage_secrets: %w", v.key, err)
	}
	return iso.call(ctx, v, "NodeStageVolume", nodeRetry, func(ctx context.Context) error {
		_, err := node.Client.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
			VolumeId:          v.key.id,
			PublishContext:    v.attachment(),
			StagingTargetPath: v.cp.StagingPath,
			VolumeCapability:  static.GetVolumeCapability(),
			Secrets:           secrets,
			VolumeContext:     static.GetVolumeContext(),
		})
		return err
	})
}

func (iso *Isolator) publish(ctx context.Context, node Node, v *volume) error {
	return iso.publishAt(ctx, node, v, v.cp.TargetPath, v.cp.Readonly)
}

// publishReadOnly gives a block volume's read-only users a target of their
// own, published with CSI readonly=true: a read-only bind of a writable
// device node would not stop writes. The target is recorded before the
// call, for the volume's unpublish to undo it whatever happens; a target
// already mounted is left as it is. Either way its device must refuse
// writes (checkReadOnly).
func (iso *Isolator) publishReadOnly(ctx context.Context, v *volume) error {
	ro := filepath.Join(filepath.Dir(v.cp.TargetPath), "target-ro")
	if v.cp.RoTargetPath == ro {
		if ok, err := iso.mounts.IsMountPoint(ro); err == nil && ok {
			return iso.checkReadOnly(v.key, v.cp)
		}
	} else if err := iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.RoTargetPath = ro }); err != nil {
		return err
	}
	node, err := iso.cfg.Plugins.Node(ctx, v.key.plugin)
	if err != nil {
		return fmt.Errorf("volume %s: %w", v.key, err)
	}
	if err := iso.publishAt(ctx, node, v, ro, true); err != nil {
		return err
	}
	return iso.checkReadOnly(v.key, v.cp)
}

// checkReadOnly refuses a block volume's read-only target whose device
// takes writes (BLKROGET): a plugin that ignores CSI readonly for block
// (csi-driver-host-path does) would have its read-only users write the
// volume. The agent does not put a read-only loop device of its own in
// between: a container can detach or re-back a loop device it can open
// (mount.BlockReadOnly says why).
func (iso *Isolator) checkReadOnly(key volumeKey, cp *statev1.VolumeCheckpoint) error {
	ro, err := iso.mounts.BlockReadOnly(cp.GetRoTargetPath())
	if err != nil {
		return fmt.Errorf("volume %s: checking its read-only publish at %s: %w", key, cp.GetRoTargetPath(), err)
	}
	if !ro {
		return fmt.Errorf("%w: volume %s: plugin %s published it read-only (CSI readonly=true) at %s with a device that takes writes (it ignores readonly for block volumes): refused to read-only users, who could write it; use the volume read-write, or a plugin that honours readonly", ErrPrecondition, key, key.plugin, cp.GetRoTargetPath())
	}
	return nil
}

// publishAt publishes the volume at target.
func (iso *Isolator) publishAt(ctx context.Context, node Node, v *volume, target string, readonly bool) error {
	static := v.cp.StaticProvisioning
	p, err := iso.cfg.Plugins.Lookup(v.key.plugin)
	if err != nil {
		return err
	}
	if err := mkdirAll(ctx, filepath.Dir(target), "mkdir target parent"); err != nil {
		return fmt.Errorf("volume %s: creating target parent: %w", v.key, err)
	}
	if p.TargetPathExists {
		// Mesos's target_path_exists: a plugin that expects the target
		// to exist (not CSI v1 compliant) gets it made: a directory, or
		// a file for a block volume's device node. Otherwise (CSI) the
		// CO makes only the parent, the plugin the target.
		if static.GetVolumeCapability().GetBlock() != nil {
			f, err := os.OpenFile(target, os.O_CREATE|os.O_RDONLY, 0o640)
			if err != nil {
				return fmt.Errorf("volume %s: creating target file: %w", v.key, err)
			}
			f.Close()
		} else if err := os.Mkdir(target, 0o750); err != nil && !os.IsExist(err) {
			return fmt.Errorf("volume %s: creating target: %w", v.key, err)
		}
	}
	secrets, err := iso.resolveSecrets(static.GetNodePublishSecrets())
	if err != nil {
		return fmt.Errorf("volume %s: node_publish_secrets: %w", v.key, err)
	}
	req := &csi.NodePublishVolumeRequest{
		VolumeId:         v.key.id,
		PublishContext:   v.attachment(),
		TargetPath:       target,
		VolumeCapability: static.GetVolumeCapability(),
		Readonly:         readonly,
		Secrets:          secrets,
		VolumeContext:    static.GetVolumeContext(),
	}
	if node.StageUnstage {
		req.StagingTargetPath = v.cp.StagingPath
	}
	if err := iso.call(ctx, v, "NodePublishVolume", nodeRetry, func(ctx context.Context) error {
		_, err := node.Client.NodePublishVolume(ctx, req)
		return err
	}); err != nil {
		return err
	}
	// A plugin that says it published but mounted nothing would have
	// containers write to the agent's own disk.
	if ok, err := iso.mounter(ctx).IsMountPoint(target); err != nil || !ok {
		return fmt.Errorf("volume %s: plugin %s reported NodePublishVolume success but nothing is mounted at %s", v.key, v.key.plugin, target)
	}
	return nil
}

// unpublish and unstage take NotFound as done: the plugin has no such
// volume, so it has nothing mounted (and removing the directories
// afterwards still refuses to cross a mount point, should it be wrong).
// A block volume's read-only target goes first, then is forgotten.
func (iso *Isolator) unpublish(ctx context.Context, node Node, v *volume) error {
	if ro := v.cp.RoTargetPath; ro != "" {
		if err := iso.unpublishAt(ctx, node, v, ro); err != nil {
			return err
		}
		if err := iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.RoTargetPath = "" }); err != nil {
			return err
		}
	}
	return iso.unpublishAt(ctx, node, v, v.cp.TargetPath)
}

func (iso *Isolator) unpublishAt(ctx context.Context, node Node, v *volume, target string) error {
	return iso.call(ctx, v, "NodeUnpublishVolume", nodeRetry, teardownCall(func(ctx context.Context) error {
		_, err := node.Client.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: v.key.id, TargetPath: target})
		return notFoundIsDone(err)
	}))
}

func (iso *Isolator) unstage(ctx context.Context, node Node, v *volume) error {
	return iso.call(ctx, v, "NodeUnstageVolume", nodeRetry, teardownCall(func(ctx context.Context) error {
		_, err := node.Client.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: v.key.id, StagingTargetPath: v.cp.StagingPath})
		return notFoundIsDone(err)
	}))
}

// teardownCalls is how many calls a node teardown call (NodeUnpublish,
// NodeUnstage: idempotent) gets when it fails Internal or Unknown, which
// call retries for no other call: plugins built on Kubernetes' mount
// utilities fail them so when the mount table changes while they read it
// ("could not get consistent content of /proc/mounts after 3 attempts"),
// as it does on a busy host.
const teardownCalls = 3

// teardownCall is f, its first teardownCalls-1 Internal and Unknown
// failures turned into Aborted (which call retries), the message kept.
func teardownCall(f func(context.Context) error) func(context.Context) error {
	calls := 0
	return func(ctx context.Context) error {
		calls++
		err := f(ctx)
		if c := status.Code(err); (c == codes.Internal || c == codes.Unknown) && calls < teardownCalls {
			return status.Errorf(codes.Aborted, "%s (%s; called again)", status.Convert(err).Message(), c)
		}
		return err
	}
}

func notFoundIsDone(err error) error {
	if status.Code(err) == codes.NotFound {
		return nil
	}
	return err
}

// The codes on which call retries, from CSI's error tables: a node call on
// Unavailable, DeadlineExceeded, ResourceExhausted and Aborted; an attach
// or detach on Unavailable, DeadlineExceeded and Aborted (its
// ResourceExhausted is the node's attach limit: retrying cannot help).
var (
	nodeRetry       = []codes.Code{codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted}
	controllerRetry = []codes.Code{codes.Unavailable, codes.DeadlineExceeded, codes.Aborted}
)

// call runs one RPC within the RPC timeout, retrying with jittered
// exponential backoff on the codes of retry; any other code
// (InvalidArgument, NotFound, FailedPrecondition, Unimplemented, ...) fails
// at once.
func (iso *Isolator) call(ctx context.Context, v *volume, rpc string, retry []codes.Code, f func(context.Context) error) error {
	defer optrace.Begin(ctx, optrace.Plugin, rpc)()
	ctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
	defer cancel()
	attempts, err := retrypolicy.Retry(ctx, retryBase, retryMax, retry, func(ctx context.Context) error {
		err := f(ctx)
		iso.cfg.CrashPoint("rpc " + rpc)
		return err
	}, func(attempt int, err error, d time.Duration) {
		iso.log.Warn("plugin RPC failed; retrying", "rpc", rpc, "volume", v.key.String(), "attempt", attempt, "code", status.Code(err).String(), "retry_in", d)
	})
	if err == nil {
		iso.log.Debug("plugin RPC done", "rpc", rpc, "volume", v.key.String(), "attempt", attempts)
		return nil
	}
	if msg := status.Convert(err).Message(); strings.Contains(strings.TrimSpace(msg), "\n") {
		iso.log.Warn("plugin RPC failed", "rpc", rpc, "volume", v.key.String(), "code", status.Code(err).String(), "message", msg)
	}
	return &rpcError{plugin: v.key.plugin, rpc: rpc, volume: v.key.id, err: err}
}

// pluginDownError: the plugin was unknown or not ready in time.
type pluginDownError struct {
	plugin string
	err    error
}

func (e *pluginDownError) Error() string { return e.err.Error() }
func (e *pluginDownError) Unwrap() error { return e.err }

// downPlugin names the plugin err says is down: unknown, not ready in
// time, or unreachable until its calls' deadline.
func downPlugin(err error) (string, bool) {
	var pd *pluginDownError
	if errors.As(err, &pd) {
		return pd.plugin, true
	}
	var re *rpcError
	if errors.As(err, &re) && (re.Code() == codes.Unavailable || re.Code() == codes.DeadlineExceeded) {
		return re.plugin, true
	}
	return "", false
}

// rpcError is a plugin's error, which keeps its gRPC code.
type rpcError struct {
	plugin, rpc, volume string
	err                 error
}

// Error gives the plugin's message up to its first line break: a
// plugin's error may carry a tool's whole output (mkfs.xfs's usage text);
// the whole message is in the agent's log (call logs it).
func (e *rpcError) Error() string {
	return fmt.Sprintf("plugin %s: %s of volume %s: %s", e.plugin, e.rpc, e.volume, firstLine(status.Convert(e.err).Message()))
}

// firstLine is msg's first line that is not blank, with a note of how
// many lines follow, if any.
func firstLine(msg string) string {
	lines := strings.Split(strings.TrimSpace(msg), "\n")
	if len(lines) <= 1 {
		return strings.TrimSpace(msg)
	}
	return fmt.Sprintf("%s (%d more lines in the agent's log)", strings.TrimSpace(lines[0]), len(lines)-1)
}

func (e *rpcError) Unwrap() error { return e.err }

// Code is the plugin's status code.
func (e *rpcError) Code() codes.Code { return status.Code(e.err) }

// RPCCode returns the status code of a plugin error inside err, if any.
func RPCCode(err error) (codes.Code, bool) {
	var re *rpcError
	if errors.As(err, &re) {
		return re.Code(), true
	}
	return codes.OK, false
}

// enterState records the first step of v's way from before to want. A
// volume coming onto the node (up from where nothing of it is there, see
// offNode) is first checked against the node's topology (ErrPrecondition),
// claimed across the fleet (Config.Claims) and checked against the
// plugin's limit of volumes on the node (ErrLimit), the latter under
// limitMu so that two volumes cannot both take the last place. A volume
// on its way up from anywhere else (recovery, a crash, a repair) is
// claimed again: no node call brings a volume up without the node's
// claim.
func (iso *Isolator) enterState(ctx context.Context, v *volume, before, want, during vstate, node Node) error {
	if want != stPublished {
		return iso.setState(v, during)
	}
	if !offNode(v.cp) {
		// Up again from a state recovery or a crash left (its claim may
		// have been released meanwhile): the node must still hold it.
		if err := iso.claim(ctx, v.key, v.cp.GetStaticProvisioning().GetVolumeCapability()); err != nil {
			return err
		}
		return iso.setState(v, during)
	}
	if err := accessible(v, node); err != nil {
		return err
	}
	if err := iso.claim(ctx, v.key, v.cp.GetStaticProvisioning().GetVolumeCapability()); err != nil {
		return err
	}
	if node.MaxVolumes <= 0 {
		return iso.setState(v, during)
	}
	waited := optrace.Begin(ctx, optrace.Lock, "volume limit lock")
	iso.limitMu.Lock()
	waited()
	defer iso.limitMu.Unlock()
	if n := iso.onNode(v); int64(n) >= node.MaxVolumes {
		return fmt.Errorf("volume %s: %w: plugin %s allows at most %d volume(s) on this node (NodeGetInfo max_volumes_per_node) and %d are staged or published here; "+
			"clean up a container that uses another of its volumes first", v.key, ErrLimit, v.key.plugin, node.MaxVolumes, n)
	}
	return iso.setState(v, during)
}

// claim has Config.Claims claim a volume for this node (nothing without
// a cluster).
func (iso *Isolator) claim(ctx context.Context, key volumeKey, capability *csi.VolumeCapability) error {
	c := iso.cfg.Claims
	if c == nil {
		return nil
	}
	defer optrace.Begin(ctx, optrace.Claim, "Claim")()
	if err := c.Claim(ctx, key.plugin, key.id, capability); err != nil {
		return fmt.Errorf("volume %s: %w", key, err)
	}
	return nil
}

// onNode counts the other volumes of v's plugin that have anything on the
// node (see offNode).
func (iso *Isolator) onNode(v *volume) int {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	n := 0
	for k, o := range iso.volumes {
		if k.plugin == v.key.plugin && o != v && !offNode(o.cp) {
			n++
		}
	}
	return n
}

// accessible refuses a volume whose accessible_topology (recorded when the
// agent provisioned it) has no segment this node's plugin topology holds.
// A volume without one is accessible everywhere; a plugin that reports no
// topology cannot be checked against one.
func accessible(v *volume, node Node) error {
	segs := v.cp.GetStaticProvisioning().GetAccessibleTopology()
	if len(segs) == 0 || len(node.Topology) == 0 {
		return nil
	}
	for _, t := range segs {
		if inSegment(t.GetSegments(), node.Topology) {
			return nil
		}
	}
	var where []string
	for _, t := range segs {
		where = append(where, segmentString(t.GetSegments()))
	}
	return fmt.Errorf("%w: volume %s is accessible only from %s and this node of plugin %s is at %s (NodeGetInfo accessible_topology)", ErrPrecondition, v.key, strings.Join(where, " or "), v.key.plugin, segmentString(node.Topology))
}

// inSegment reports whether every key of seg has its value in node.
func inSegment(seg, node map[string]string) bool {
	for k, val := range seg {
		if node[k] != val {
			return false
		}
	}
	return true
}

// segmentString is a topology segment as k=v pairs sorted by key.
func segmentString(seg map[string]string) string {
	keys := slices.Sorted(maps.Keys(seg))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + seg[k]
	}
	return "{" + strings.Join(parts, ",") + "}"
}
