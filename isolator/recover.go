package isolator

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"sync"

	"golang.org/x/sys/unix"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// resync drives every volume and container to where it should be. The
// first pass after start is recovery: it also handles a reboot (mounts
// gone), references that no container backs, mounts missing from
// prepared containers (retried by later passes while a volume cannot be
// published), and directories no checkpoint claims. The passes after it
// return the published volumes with users whose target path is not a
// mount, for repairUnmounted. Anything locked is being handled by a live
// operation and is skipped.
// cleanUpGoneContainers cleans up, as their runtime's poststop would
// have, the prepared containers that were given their volumes in a
// process's mount namespace where no process is left: their runtime is done
// with them, but its Cleanup never reached the agent (the agent was down
// at poststop, or the runtime crashed). Their mounts went with the
// namespace; what is left is their share of the volumes.
func (iso *Isolator) cleanUpGoneContainers(ctx context.Context, down downPlugins) {
	// Listed before the scan, which runs only if a container needs it
	// (see Reconcile).
	ids := iso.containerIDs()
	scan := sync.OnceValues(iso.mounts.NamespacesInUse)
	for _, id := range ids {
		iso.withContainerIfFree(id, func(c *container) {
			if c.cp.GetPhase() != statev1.ContainerCheckpoint_PREPARED || c.cp.GetMountNamespace() == 0 {
				return
			}
			if why := iso.running(c.cp, scan); why != "" {
				if _, err := scan(); err != nil {
					iso.log.Warn("cannot tell whether a container is gone", "container", id, "error", err)
				}
				return
			}
			if p, ok := down.of(c.cp.GetRequest()); ok {
				iso.log.Warn("leaving a gone container for a later pass: its plugin is down", "container", id, "plugin", p)
				return
			}
			iso.log.Info("cleaning up a container whose processes are all gone: its runtime's cleanup never reached the agent", "container", id)
			if err := iso.cleanupLocked(ctx, c, false); err != nil {
				down.note(err)
				iso.log.Warn("cleaning up a gone container", "container", id, "error", err)
			}
		})
	}
}

func (iso *Isolator) resync(ctx context.Context, recovery bool) []volumeKey {
	if recovery || iso.rebuildLeft.Load() {
		iso.rebuildLeft.Store(!iso.rebuildMissingVolumes())
	}
	if recovery {
		for _, id := range iso.containerIDs() {
			iso.withContainerIfFree(id, iso.forgetOtherBootMountIDs)
		}
		iso.recoverVolumes()
	}
	// A plugin that is not ready holds up its own volumes and containers
	// only, and only once per pass (each wait for it has the RPC
	// deadline): the next pass retries them, their state kept.
	down := downPlugins{}
	for _, id := range iso.containerIDs() {
		iso.withContainerIfFree(id, func(c *container) {
			if c.cp.GetPhase() == statev1.ContainerCheckpoint_PREPARED || quarantined(c.cp) {
				return
			}
			if p, ok := down.of(c.cp.GetRequest()); ok {
				iso.log.Warn("leaving an interrupted prepare or cleanup for a later pass: its plugin is down", "container", id, "plugin", p)
				return
			}
			if err := iso.cleanupLocked(ctx, c, false); err != nil {
				down.note(err)
				iso.log.Warn("finishing an interrupted prepare or cleanup", "container", id, "error", err)
			}
		})
	}
	iso.cleanUpGoneContainers(ctx, down)
	var unmounted []volumeKey
	iso.forEachVolume(func(v *volume) {
		want := stCreated
		if len(v.cp.Users) > 0 {
			want = stPublished
		}
		if v.cp.State == stPublished && want == stPublished && !recovery {
			if ok, err := iso.mounts.IsMountPoint(v.cp.TargetPath); err == nil && !ok {
				unmounted = append(unmounted, v.key)
			}
		}
		if (v.cp.State == want && v.cp.LastError == "") || down[v.key.plugin] {
			return
		}
		vctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
		err := iso.converge(vctx, v, want)
		cancel()
		if err != nil {
			down.note(err)
			iso.log.Warn("volume not converged; will retry", "volume", v.key.String(), "want", want.String(), "error", err)
		}
	})
	for _, id := range iso.containerIDs() {
		iso.withContainerIfFree(id, func(c *container) {
			if recovery || len(c.remount) > 0 {
				iso.remount(ctx, c, recovery, down)
			}
		})
	}
	if recovery {
		// The removals the pass's teardowns left go first: the
		// directories they remove are not orphans, and a start ends
		// with none left.
		sctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
		if err := iso.SettleRemovals(sctx); err != nil {
			iso.log.Warn("recovery: the removals of torn-down volumes are not done; those not started are left to the next start", "error", err)
		}
		cancel()
		iso.removeOrphanDirs()
	}
	return unmounted
}

// repairUnmounted repairs (see Repair) the volumes of a pass's batch one
// at a time, skipping the rest of a plugin's once it is found down.
func (iso *Isolator) repairUnmounted(ctx context.Context, batch []volumeKey) {
	down := downPlugins{}
	for _, key := range batch {
		if !down[key.plugin] {
			_, err := iso.Repair(ctx, key.plugin, key.id)
			down.note(err)
		}
	}
}

// downPlugins are the plugins found down in one pass over containers or
// volumes: each is waited for once per pass.
type downPlugins map[string]bool

// note records the plugin err says is down, if any.
func (d downPlugins) note(err error) {
	if p, ok := downPlugin(err); ok {
		d[p] = true
	}
}

// of names a plugin of the request's volumes that is down.
func (d downPlugins) of(req *statev1.PrepareRequest) (string, bool) {
	for _, v := range req.GetVolumes() {
		if p := v.GetSource().GetCsiVolume().GetPluginName(); d[p] {
			return p, true
		}
	}
	return "", false
}

// forEachVolume runs f on each volume whose lock is free, lock held.
func (iso *Isolator) forEachVolume(f func(v *volume)) {
	iso.mu.Lock()
	keys := make([]volumeKey, 0, len(iso.volumes))
	for k := range iso.volumes {
		keys = append(keys, k)
	}
	iso.mu.Unlock()
	for _, k := range keys {
		unlock, ok := iso.volumeLocks.TryLock(k.String())
		if !ok {
			continue
		}
		if v := iso.volumeAt(k); v != nil {
			f(v)
		}
		unlock()
	}
}

func (iso *Isolator) withContainerIfFree(id string, f func(c *container)) {
	unlock, ok := iso.containerLocks.TryLock(id)
	if !ok {
		return
	}
	defer unlock()
	iso.mu.Lock()
	c := iso.containers[id]
	iso.mu.Unlock()
	if c != nil {
		f(c)
	}
}

// recoverVolumes runs recoverVolume on every volume, with the containers
// whose records name it (indexed once: 10,000 volumes by 1,000 records of
// 10 volumes each cost seconds scanned per volume).
func (iso *Isolator) recoverVolumes() {
	named := map[volumeKey][]string{}
	iso.mu.Lock()
	for id, c := range iso.containers {
		for _, rv := range c.cp.GetRequest().GetVolumes() {
			csiVol := rv.GetSource().GetCsiVolume()
			k := volumeKey{csiVol.GetPluginName(), csiVol.GetStaticProvisioning().GetVolumeId()}
			if !slices.Contains(named[k], id) {
				named[k] = append(named[k], id)
			}
		}
	}
	iso.mu.Unlock()
	iso.forEachVolume(func(v *volume) { iso.recoverVolume(v, named[v.key]) })
}

// recoverVolume resets a volume's mounts after a reboot and makes its
// users those the container records back: it drops users whose records
// do not name it and adds the containers whose records do (a power cut
// can leave either record newer than the other).
func (iso *Isolator) recoverVolume(v *volume, namedBy []string) {
	// A user is a container whose record names the volume: one whose
	// record is gone, or names other volumes now (a power cut can leave
	// the volume's record newer than the container's), is not.
	var stale, missing []string
	for _, u := range v.cp.Users {
		if !slices.Contains(namedBy, u) {
			stale = append(stale, u)
		}
	}
	for _, id := range namedBy {
		if !slices.Contains(v.cp.Users, id) {
			missing = append(missing, id)
		}
	}
	slices.Sort(missing)
	rebooted := v.cp.BootId != iso.bootID && v.cp.State != stUnknown
	if len(stale) == 0 && len(missing) == 0 && !rebooted {
		return
	}
	err := iso.updateVolume(v, func(cp *statev1.VolumeCheckpoint) {
		cp.Users = slices.DeleteFunc(cp.Users, func(u string) bool { return slices.Contains(stale, u) })
		cp.Users = append(cp.Users, missing...)
		slices.Sort(cp.Users) // as every other change of the users keeps them
		if rebooted {
			// Mounts do not survive a reboot, but node state may (iSCSI
			// sessions log in again at boot), and that is the plugin's
			// to drop. So a volume past CREATED goes to a transitional
			// state, from which converge takes the whole way whichever
			// way it goes: staged and published again while it has
			// users (NODE_STAGE), unpublished and unstaged through the
			// plugin once it has none (NODE_UNPUBLISH), both calls
			// idempotent. Never a stable state: PUBLISHED would hand
			// the next user an empty target, NODE_READY would forget
			// the volume with no call to its plugin. An attached
			// volume with users is attached again first
			// (CONTROLLER_PUBLISH, not attached): an attachment may
			// not survive a reboot (a loop device does not), and its
			// publish_context may name what is gone; the attach is
			// idempotent where it does survive.
			// An attach or detach under way stays as it is: the
			// whole way from it includes the attach or detach. An
			// attached volume keeps its attach (for its detach) but
			// not its publish_context, which may name what the reboot
			// took: its way up attaches again (see path).
			cp.BootId, cp.PublishContext = iso.bootID, nil
			switch {
			case cp.State == stCreated || cp.State == stCtrlPublish || cp.State == stCtrlUnpub:
			case len(cp.Users) > 0 && cp.ControllerPublished:
				cp.State, cp.ControllerPublished = stCtrlPublish, false
			case len(cp.Users) > 0:
				cp.State = stNodeStage
			default:
				cp.State = stNodeUnpub
			}
		}
	})
	if err != nil {
		iso.log.Error("recovering volume", "volume", v.key.String(), "error", err)
		return
	}
	iso.log.Info("recovered volume", "volume", v.key.String(), "rebooted", rebooted, "dropped_users", stale, "added_users", missing)
}

// forgetOtherBootMountIDs clears the mount ids a container record holds
// from another boot: after a reboot they are reused by unrelated mounts,
// so a cleanup trusting them would find "our" mount somewhere else and
// refuse for ever. With the id cleared, a mount is ours only if it is at
// the mount point with the volume's root (mount.UnmountOwn with id 0).
func (iso *Isolator) forgetOtherBootMountIDs(c *container) {
	if c.cp.GetBootId() == "" || c.cp.GetBootId() == iso.bootID {
		return
	}
	err := iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) {
		for _, m := range cp.Mounts {
			// The roots and devices too: the volumes are staged
			// anew, on other devices.
			m.MountId, m.ParentMountId, m.RootDev, m.RootIno, m.BlockDevice, m.UniqueMountId = 0, 0, 0, 0, 0, 0
		}
		if cp.MountNamespace != 0 {
			// Its namespace went with the boot; its inode number
			// may name a new one now.
			cp.MountNamespace = namespaceOfAnotherBoot
		}
		cp.BootId = iso.bootID
	})
	if err != nil {
		iso.log.Warn("clearing a container's mount ids from before the reboot", "container", c.id, "error", err)
	}
}

// remount restores a prepared container's mounts that are missing (after
// a reboot, or if someone unmounted them): with all (recovery, a repeated
// Prepare) every one, waiting for each volume's lock; otherwise (later
// resync passes) only those an earlier call could not restore
// (c.remount), skipping a volume another operation holds. A mount is
// restored only where its Prepare put it (restoreMount), and one that
// moved with a renamed parent directory is not missing (its cleanup
// unmounts it where it is). A mount once restored is not retried by the
// passes. Each restore has the RPC deadline; a volume of a plugin found
// down waits for a later pass.
func (iso *Isolator) remount(ctx context.Context, c *container, all bool, down downPlugins) {
	retry := c.remount
	c.remount = nil
	// A container with a pid has its mounts in its own namespace: they
	// live and die with it, whatever the agent does.
	if c.cp.GetPhase() != statev1.ContainerCheckpoint_PREPARED || c.cp.GetRequest().GetPid() != 0 {
		return
	}
	uid, gid, err := lookupUser(c.cp.GetRequest().GetUser())
	if err != nil {
		uid, gid = -1, -1
	}
	for i, m := range c.cp.GetMounts() {
		if !all && !slices.Contains(retry, m.GetContainerPath()) {
			continue
		}
		if ok, _ := iso.mounts.IsMountPoint(m.GetMountPoint()); ok {
			continue
		}
		if at, err := iso.mounts.Locate(mountIdentity(m)); err == nil && at != "" {
			// Not gone: moved with a directory above it, which the
			// container renamed. A second mount would take the record's
			// identity, and the cleanup would leave the first one.
			iso.log.Warn("a prepared container's mount is no longer at its mount point but still mounted (a directory above it was renamed): not mounted again; its cleanup unmounts it where it is", "container", c.id, "mount_point", m.GetMountPoint(), "now_at", at)
			continue
		}
		key := volumeKey{m.GetPluginName(), m.GetVolumeId()}
		if down[key.plugin] { // logged by whoever found it down
			c.remount = append(c.remount, m.GetContainerPath())
			continue
		}
		restore := func(v *volume) error {
			rctx, cancel := context.WithTimeout(ctx, iso.cfg.RPCTimeout)
			defer cancel()
			return iso.restoreMount(rctx, c, i, v, uid, gid)
		}
		var err error
		if all {
			err = iso.withVolume(ctx, key, restore)
		} else {
			err = iso.tryVolume(key, restore)
		}
		switch {
		case errors.Is(err, errElsewhere):
			iso.log.Error("not restoring a prepared container's mount", "container", c.id, "mount_point", m.GetMountPoint(), "error", err)
		case err != nil:
			down.note(err)
			c.remount = append(c.remount, m.GetContainerPath())
			iso.log.Warn("restoring a prepared container's mount; will retry", "container", c.id, "mount_point", m.GetMountPoint(), "error", err)
		default:
			iso.log.Info("restored a prepared container's mount", "container", c.id, "mount_point", m.GetMountPoint())
		}
	}
}

// errElsewhere: a container path resolves elsewhere than where its
// Prepare mounted the volume; the mount is not restored, nor retried.
var errElsewhere = errors.New("the mount point is elsewhere: its rootfs, or a directory on the way, was replaced (not restored)")

// restoreMount puts a clone of the published volume v (lock held) at the
// container's mount i, where its Prepare put it (errElsewhere when the
// container path resolves elsewhere now), and records its identity.
func (iso *Isolator) restoreMount(ctx context.Context, c *container, i int, v *volume, uid, gid int) error {
	m := c.cp.GetMounts()[i]
	if v == nil || v.cp.State != stPublished {
		return errors.New("the volume is not published")
	}
	block := v.cp.GetStaticProvisioning().GetVolumeCapability().GetBlock() != nil
	// Made again if missing (a reboot took a tmpfs it was on), inside
	// the rootfs as the Prepare did (a member's pinned: see
	// pinnedRoot). Its rootfs, or a directory on the way, may lead
	// elsewhere now (a symlink put in place of root's own rootfs): no
	// caller is there to judge where that leads, and nothing is mounted
	// anywhere but where the Prepare put it.
	target, at, err := resolveMountPoint(iso.mounts, c.cp.GetRequest(), m.GetContainerPath(), block, uid, gid)
	if errors.Is(err, unix.ELOOP) {
		return fmt.Errorf("%w: %w", errElsewhere, err) // a member's rootfs is a symlink now
	}
	if err != nil {
		return err
	}
	defer target.Close()
	if at != m.GetMountPoint() {
		return fmt.Errorf("%w: container path %s now resolves to %s, not to %s where it was prepared", errElsewhere, m.GetContainerPath(), at, m.GetMountPoint())
	}
	parent, err := iso.mounts.ID(target)
	if err != nil {
		return err
	}
	source := v.cp.GetTargetPath()
	if block && m.GetReadonly() {
		if err := iso.publishReadOnly(ctx, v); err != nil {
			return err
		}
		source = v.cp.GetRoTargetPath()
	}
	if err := iso.checkMounted(ctx, v.key, source); err != nil {
		return err
	}
	tree, id, err := iso.clone(ctx, source, m.GetReadonly())
	if err != nil {
		return err
	}
	defer tree.Close()
	if err := iso.mounts.MoveTree(tree, target); err != nil {
		return err
	}
	// The new mount's identity, for the cleanup to find it.
	return iso.updateContainer(c, func(cp *statev1.ContainerCheckpoint) {
		id.setOn(cp.Mounts[i])
		cp.Mounts[i].ParentMountId = parent
		cp.BootId = iso.bootID
	})
}

// requestVolume returns the volume key names in a container record's
// request, or nil.
func requestVolume(cp *statev1.ContainerCheckpoint, key volumeKey) *statev1.CSIVolume {
	for _, rv := range cp.GetRequest().GetVolumes() {
		csiVol := rv.GetSource().GetCsiVolume()
		if csiVol.GetPluginName() == key.plugin && csiVol.GetStaticProvisioning().GetVolumeId() == key.id {
			return csiVol
		}
	}
	return nil
}

// missingMounts lists a prepared host-mode container's mount points where
// nothing is mounted (a container with a pid has its mounts in its own
// namespace: not checked).
func (iso *Isolator) missingMounts(c *container) []string {
	if c.cp.GetRequest().GetPid() != 0 {
		return nil
	}
	var out []string
	for _, m := range c.cp.GetMounts() {
		if ok, _ := iso.mounts.IsMountPoint(m.GetMountPoint()); !ok {
			out = append(out, m.GetMountPoint())
		}
	}
	return out
}

// removeOrphanDirs removes volume directories under the default mount
// roots that no checkpoint claims, when nothing is mounted in them. Each
// is removed under its volume's lock, so a Prepare creating it meanwhile
// is not undercut.
func (iso *Isolator) removeOrphanDirs() {
	for _, pattern := range []string{
		filepath.Join(iso.cfg.WorkDir, "csi", "*", "*", "mounts", "*"),
		filepath.Join(iso.cfg.WorkDir, "csi", "*", "*", "volumes", "*"),
	} {
		dirs, _ := filepath.Glob(pattern)
		for _, d := range dirs {
			id, err := decodeVolumeID(filepath.Base(d))
			if err != nil {
				continue
			}
			key := volumeKey{filepath.Base(filepath.Dir(filepath.Dir(filepath.Dir(d)))), id}
			unlock, ok := iso.volumeLocks.TryLock(key.String())
			if !ok {
				continue
			}
			iso.mu.Lock()
			claimed := iso.volumes[key] != nil
			iso.mu.Unlock()
			if !claimed {
				if err := iso.mounts.RemoveEmptyTree(d); err != nil {
					iso.log.Warn("leaving an unclaimed volume directory", "dir", d, "error", err)
				} else {
					iso.log.Info("removed an unclaimed volume directory", "dir", d)
				}
			}
			unlock()
		}
	}
}

// Pending says what is not where it should be: containers whose prepare
// or cleanup is unfinished and volumes not in their wanted state, with
// their plugins; "" when nothing is.
func (iso *Isolator) Pending() string {
	iso.mu.Lock()
	defer iso.mu.Unlock()
	containers := 0
	for _, c := range iso.containers {
		if c.cp.GetPhase() != statev1.ContainerCheckpoint_PREPARED {
			containers++
		}
	}
	volumes := 0
	var plugins []string
	for k, v := range iso.volumes {
		want := stCreated
		if len(v.cp.Users) > 0 {
			want = stPublished
		}
		if v.cp.State != want || v.cp.LastError != "" {
			volumes++
			if !slices.Contains(plugins, k.plugin) {
				plugins = append(plugins, k.plugin)
			}
		}
	}
	if containers == 0 && volumes == 0 {
		return ""
	}
	line := fmt.Sprintf("%d containers and %d volumes pending", containers, volumes)
	if len(plugins) > 0 {
		slices.Sort(plugins)
		line += " (plugins " + strings.Join(plugins, ", ") + ")"
	}
	return line
}
