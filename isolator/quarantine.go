package isolator

import (
	"fmt"
	"slices"
	"sort"
	"strings"

	"github.com/moby/sys/mountinfo"

	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// A container record that cannot be read is quarantined, not dropped: its
// container may still run with our mounts. The file is kept aside (see
// moveAside); a record in phase PHASE_UNKNOWN takes its place, rebuilt
// from what else is on the host: its volumes are those whose records list
// it as a user (so they keep that user and stay published), its mounts the
// binds of those volumes' targets in the mount table that no other
// container's record claims. Recovery and resync leave a quarantined
// container alone (no remount, no cleanup of their own); Cleanup (or
// Reconcile, when the runtime no longer has it) unmounts what was found
// and releases its volumes. ListContainers shows it with the reason, the
// csi_agent_containers metric counts it under PHASE_UNKNOWN.

// quarantined reports whether a container record is a quarantined one.
func quarantined(cp *statev1.ContainerCheckpoint) bool {
	return cp.GetPhase() == statev1.ContainerCheckpoint_PHASE_UNKNOWN
}

// quarantine rebuilds the record of container id, whose file was corrupt
// (cause; kept as aside), and checkpoints it. It runs at load, after every record
// has been read.
func (iso *Isolator) quarantine(id, dir, aside string, cause error) {
	cp := &statev1.ContainerCheckpoint{
		ContainerId: id,
		BootId:      iso.bootID,
		Phase:       statev1.ContainerCheckpoint_PHASE_UNKNOWN,
		Request:     &statev1.PrepareRequest{ContainerId: id},
	}
	var keys []volumeKey
	for k, v := range iso.volumes {
		if slices.Contains(v.cp.GetUsers(), id) {
			keys = append(keys, k)
		}
	}
	sort.Slice(keys, func(i, j int) bool { return keys[i].String() < keys[j].String() })
	table, terr := iso.mounts.List(nil)
	claimed := map[string]bool{}
	for _, c := range iso.containers {
		for _, m := range c.cp.GetMounts() {
			claimed[m.GetMountPoint()] = true
		}
	}
	for _, k := range keys {
		v := iso.volumes[k]
		cp.Request.Volumes = append(cp.Request.Volumes, &statev1.Volume{
			Source: &statev1.Volume_Source{Type: statev1.Volume_Source_CSI_VOLUME, CsiVolume: &statev1.CSIVolume{
				PluginName: k.plugin, StaticProvisioning: v.cp.GetStaticProvisioning(),
			}},
		})
		for _, m := range bindsOf(table, v.cp.GetTargetPath(), v.cp.GetStagingPath()) {
			if !claimed[m.Mountpoint] {
				// No rootfs is known: the mount point is resolved from the
				// host's root without following links, and only the mount
				// with this id (and the volume's root) is ever unmounted.
				cp.Mounts = append(cp.Mounts, &statev1.ContainerMount{
					PluginName: k.plugin, VolumeId: k.id, MountPoint: m.Mountpoint, ContainerPath: m.Mountpoint,
					HostPath: v.cp.GetTargetPath(), MountId: uint64(m.ID), ParentMountId: uint64(m.Parent),
				})
			}
		}
	}
	var found []string
	for _, m := range cp.Mounts {
		found = append(found, m.GetMountPoint())
	}
	cp.LastError = fmt.Sprintf("container record was corrupt (%v; kept as %s); quarantined: volumes %v from their records, mounts %v from the mount table; clean it up to release them", cause, aside, keys, found)
	if terr != nil {
		cp.LastError += "; mount table unreadable: " + terr.Error()
	}
	c := &container{id: id, dir: dir, cp: cp}
	iso.containers[id] = c
	if _, err := iso.writeCheckpoint(dir, containerStateFile, cp); err != nil {
		iso.log.Error("checkpointing a quarantined container", "container", id, "error", err)
	}
	iso.log.Error("container record corrupt: quarantined", "container", id, "volumes", len(keys), "mounts", found, "moved_to", aside)
}

// bindsOf lists the mount points in table that bind the filesystem mounted
// at target (same device, same root), other than target and staging
// themselves: where containers see a published volume.
func bindsOf(table []*mountinfo.Info, target, staging string) []*mountinfo.Info {
	var at *mountinfo.Info
	for _, m := range table {
		if m.Mountpoint == target {
			at = m // the last one is the visible one
		}
	}
	if at == nil {
		return nil
	}
	var out []*mountinfo.Info
	for _, m := range table {
		if m.Major == at.Major && m.Minor == at.Minor && m.Root == at.Root &&
			m.Mountpoint != target && m.Mountpoint != staging && !strings.HasPrefix(m.Mountpoint, target+"/") {
			out = append(out, m)
		}
	}
	return out
}
