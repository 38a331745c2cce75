package isolator

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/mount"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// Repair is what a repair of one volume did.
type Repair struct {
	// Republished: the volume's target (and staging) path was found not
	// mounted and published again.
	Republished bool
	// Rebound describes each container mount replaced, Skipped each one
	// left alone and why.
	Rebound, Skipped []string
}

// RepairOutcome is how a repair ended, as Config.OnRepair is told.
type RepairOutcome string

const (
	// Repaired: the volume was republished and its containers' mounts
	// re-bound (those that are not the agent's left alone).
	Repaired RepairOutcome = "repaired"
	// RepairFailed: republishing the volume or re-binding a container's
	// mount failed; the next check tries again.
	RepairFailed RepairOutcome = "failed"
)

// Repair checks, through the Mounter, whether a published volume's target
// path is still a mount and, if it is not (unmounted behind the agent's
// back), republishes the volume (its staging path too, when that is gone
// as well) and re-binds it into each container using it. With
// Config.NoRepair it only warns. The resync passes call it (on a worker
// of their own) for every volume they find so; the daemon calls it too
// before it asks a plugin for a volume's usage. Each repair is logged,
// recorded as the volume's last repair and reported to Config.OnRepair;
// an error is the failed repair's.
//
// A container's mount is replaced only when the top mount at its mount
// point (resolved inside the container's root, in its mount namespace)
// is the one recorded, by mount id: a new clone of the republished target
// is put beneath it, the new mount is recorded next to the old one, the
// old one is unmounted by id and forgotten. A crash in between leaves both
// recorded, top first in cleanup order. A mount that is not ours is
// never touched.
//
// Nothing is done (and nothing returned) for a volume that is not
// published, has no users, or whose target is still mounted or cannot be
// checked, nor before the first recovery pass has run (recovery restores
// mounts itself, and tears down the volumes left without users). The
// first check takes no lock, so a volume busy with another operation is
// waited for only when its target is not mounted.
func (iso *Isolator) Repair(ctx context.Context, pluginType, volumeID string) (Repair, error) {
	select {
	case <-iso.recovered:
	default:
		return Repair{}, nil
	}
	key := volumeKey{pluginType, volumeID}
	target, ok := iso.usedTarget(key)
	if !ok {
		return Repair{}, nil
	}
	if mounted, err := iso.mounts.IsMountPoint(target); err != nil || mounted {
		return Repair{}, nil
	}
	if iso.cfg.NoRepair {
		iso.log.Warn("a published volume's target path is not mounted; repair is off (--repair=false)", "plugin", pluginType, "volume", volumeID, "target", target)
		return Repair{}, nil
	}
	r, err := iso.republish(ctx, key)
	if err != nil {
		iso.cfg.OnRepair(pluginType, volumeID, RepairFailed)
		iso.log.Error("repairing a volume whose target path was not mounted", "plugin", pluginType, "volume", volumeID, "rebound", r.Rebound, "skipped", r.Skipped, "error", err)
		return r, fmt.Errorf("repairing the volume (its target path was not mounted): %w", err)
	}
	if r.Republished {
		iso.cfg.OnRepair(pluginType, volumeID, Repaired)
		iso.log.Warn("repaired a volume whose target path was not mounted: republished", "plugin", pluginType, "volume", volumeID, "rebound", r.Rebound, "skipped", r.Skipped)
	}
	return r, nil
}

// usedTarget is the target path of the volume of key if it is published
// and has users.
func (iso *Isolator) usedTarget(key volumeKey) (string, bool) {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	v := iso.volumes[key]
	if v == nil || v.cp.State != stPublished || len(v.cp.Users) == 0 {
		return "", false
	}
	return v.cp.TargetPath, true
}

// republish does Repair's work under the volume's lock, checking again
// that its target path is not mounted, then re-binds it into its users and
// records what it did.
func (iso *Isolator) republish(ctx context.Context, key volumeKey) (Repair, error) {
	var r Repair
	var users []string
	var target string
	err := iso.withVolume(ctx, key, func(v *volume) error {
		if v == nil || v.cp.State != stPublished || len(v.cp.Users) == 0 {
			return nil
		}
		if ok, err := iso.mounts.IsMountPoint(v.cp.TargetPath); err != nil || ok {
			return err
		}
		nctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
		node, err := iso.cfg.Plugins.Node(nctx, key.plugin)
		cancel()
		if err != nil {
			return fmt.Errorf("volume %s: %w", key, &pluginDownError{plugin: key.plugin, err: err})
		}
		if node.StageUnstage {
			if ok, err := iso.mounts.IsMountPoint(v.cp.StagingPath); err != nil {
				return err
			} else if !ok {
				if err := iso.stage(ctx, node, v); err != nil {
					return err
				}
			}
		}
		if err := iso.publish(ctx, node, v); err != nil {
			return err
		}
		r.Republished = true
		users, target = slices.Clone(v.cp.Users), v.cp.TargetPath
		return nil
	})
	if err != nil || !r.Republished {
		return r, err
	}
	var errs []error
	for _, id := range users {
		if err := iso.rebindContainer(ctx, id, key, target, &r); err != nil {
			errs = append(errs, fmt.Errorf("container %s: %w", id, err))
		}
	}
	err = errors.Join(errs...)
	note := r.String(time.Now(), err)
	if serr := iso.withVolume(ctx, key, func(v *volume) error {
		if v == nil {
			return nil
		}
		return iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) { cp.LastRepair = note })
	}); serr != nil {
		iso.log.Error("recording a repair", "volume", key.String(), "error", serr)
	}
	return r, err
}

// String says what a repair at t did, for the volume's status.
func (r Repair) String(t time.Time, err error) string {
	parts := []string{t.UTC().Format(time.RFC3339) + ": target path was not mounted: republished"}
	if len(r.Rebound) > 0 {
		parts = append(parts, "re-bound "+strings.Join(r.Rebound, ", "))
	}
	if len(r.Skipped) > 0 {
		parts = append(parts, "left alone "+strings.Join(r.Skipped, ", "))
	}
	if err != nil {
		parts = append(parts, "failed: "+err.Error())
	}
	return strings.Join(parts, "; ")
}

// rebindContainer replaces container id's mounts of the volume published
// at target.
func (iso *Isolator) rebindContainer(ctx context.Context, id string, key volumeKey, target string, r *Repair) error {
	c, unlock, err := iso.lockContainer(ctx, id)
	if err != nil {
		return err
	}
	defer unlock()
	if c == nil || c.cp.GetPhase() != statev1.ContainerCheckpoint_PREPARED {
		return nil
	}
	var errs []error
	for i := 0; i < len(c.cp.GetMounts()); i++ {
		m := c.cp.GetMounts()[i]
		if m.GetPluginName() != key.plugin || m.GetVolumeId() != key.id || m.GetHostPath() != target {
			continue
		}
		what := fmt.Sprintf("container %s: %s", id, m.GetContainerPath())
		newID, err := iso.rebind(ctx, c, i)
		switch {
		case errors.Is(err, errNotOurs):
			r.Skipped = append(r.Skipped, fmt.Sprintf("%s: %v", what, err))
		case err != nil:
			errs = append(errs, fmt.Errorf("%s: %w", m.GetContainerPath(), err))
		default:
			r.Rebound = append(r.Rebound, fmt.Sprintf("%s: mount %d replaced by %d", what, m.GetMountId(), newID))
		}
	}
	return errors.Join(errs...)
}

// errNotOurs: the mount at a container's mount point is not the one
// recorded.
var errNotOurs = errors.New("the mount there is not the one the agent made: left alone")

// rebind replaces c's mount i (see Repair) and returns the new mount's id.
func (iso *Isolator) rebind(ctx context.Context, c *container, i int) (uint64, error) {
	old := c.cp.GetMounts()[i]
	tree, cid, err := iso.clone(ctx, old.GetHostPath(), old.GetReadonly())
	if err != nil {
		return 0, err
	}
	defer tree.Close()
	newID := cid.mount
	req := c.cp.GetRequest()
	kind := mount.Directory
	if isBlockMount(c, old) {
		kind = mount.File
	}
	// Resolved inside the root: the rootfs (or sandbox), or, inside a
	// running container's namespace after pivot_root, "/".
	root, rel := mountRoot(req, old.GetContainerPath()), old.GetContainerPath()
	at := func(f func(m Mounter, root, rel string) error) error {
		if req.GetPid() == 0 {
			return f(iso.mounts, root, rel)
		}
		return iso.inNamespace(ctx, c, func(m Mounter) error {
			if _, err := os.Lstat(root); err != nil {
				return f(m, "/", rel)
			}
			return f(m, root, rel)
		})
	}
	// ours resolves the mount point and checks that its top mount is the
	// recorded one.
	ours := func(m Mounter, root, rel string) (*os.File, error) {
		h, _, err := m.ResolveInRoot(root, rel, kind, -1, -1)
		if err != nil {
			return nil, err
		}
		top, err := m.ID(h)
		if err == nil && top != old.GetMountId() {
			err = fmt.Errorf("%w (mount %d, recorded %d)", errNotOurs, top, old.GetMountId())
		}
		if err != nil {
			h.Close()
			return nil, err
		}
		return h, nil
	}
	if err := at(func(m Mounter, root, rel string) error {
		h, err := ours(m, root, rel)
		if err == nil {
			h.Close()
		}
		return err
	}); err != nil {
		return 0, err
	}
	rec := proto.Clone(old).(*statev1.ContainerMount)
	cid.setOn(rec)
	// The new mount goes beneath the old one: recorded before it, so a
	// cleanup (last first) unmounts the old one first.
	if err := iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) {
		cp.Mounts = slices.Insert(cp.Mounts, i, rec)
	}); err != nil {
		return 0, err
	}
	err = at(func(m Mounter, root, rel string) error {
		h, err := ours(m, root, rel)
		if err != nil {
			return err
		}
		defer h.Close()
		return m.MoveTreeBeneath(tree, h)
	})
	if err != nil {
		if serr := iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) { cp.Mounts = slices.Delete(cp.Mounts, i, i+1) }); serr != nil {
			iso.log.Error("checkpointing the mounts after a failed re-bind", "container", c.id, "error", serr)
		}
		return 0, err
	}
	tree.Close() // attached: the mount must not stay busy
	iso.cfg.CrashPoint("rebind")
	note, err := iso.unmountFor(context.Background(), c, old)
	if err != nil {
		return 0, fmt.Errorf("unmounting the stale mount %d: %w", old.GetMountId(), err)
	}
	if note != "" {
		iso.log.Warn("re-bind: the stale mount was not where recorded", "container", c.id, "note", note)
	}
	if err := iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) {
		cp.Mounts = slices.DeleteFunc(cp.Mounts, func(m *statev1.ContainerMount) bool { return m.GetMountId() == old.GetMountId() })
	}); err != nil {
		return 0, err
	}
	iso.log.Info("re-bound a container's volume", "container", c.id, "volume", old.GetVolumeId(), "container_path", old.GetContainerPath(), "old_mount", old.GetMountId(), "new_mount", newID)
	return newID, nil
}

// isBlockMount reports whether mount m of c is of a block volume.
func isBlockMount(c *container, m *statev1.ContainerMount) bool {
	for _, v := range c.cp.GetRequest().GetVolumes() {
		csiVol := v.GetSource().GetCsiVolume()
		if csiVol.GetPluginName() == m.GetPluginName() && csiVol.GetStaticProvisioning().GetVolumeId() == m.GetVolumeId() &&
			filepath.Clean(v.GetContainerPath()) == filepath.Clean(m.GetContainerPath()) {
			return csiVol.GetStaticProvisioning().GetVolumeCapability().GetBlock() != nil
		}
	}
	return false
}
