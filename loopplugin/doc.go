// Package loopplugin is a complete CSI plugin (Identity, Controller,
// GroupController and Node services, plus the csi-addons ReclaimSpace,
// VolumeGroup and Replication services) whose volumes are
// sparse image files in a pool directory, attached to loop devices on the
// node that serves them. It is csiagent's reference plugin: the agent's
// tests and demo run against it, and it doubles as a small, real plugin for
// single hosts.
//
// # Volumes
//
// A volume is <pool>/<volume id>.img. CreateVolume (or the create-volume
// command through Pool.Create) makes a sparse file, so a new volume occupies
// no blocks; the volume id is the CreateVolume name and must be a plain file
// name (ValidateVolumeID). NodeStageVolume attaches the image to a loop
// device (LOOP_CONFIGURE; autoclear for mount access, so the kernel detaches
// the device when the filesystem is unmounted), formats a blank volume
// (ext4 unless the capability names another fs_type with a mkfs on the host)
// and mounts it at the staging path; for block access it bind-mounts the
// device node onto <staging>/device instead. A pool belongs to its node:
// the node and every volume are in the topology TopologyKey=<node id>
// (VOLUME_ACCESSIBILITY_CONSTRAINTS), a CreateVolume whose requisite
// topology excludes the node is refused, and NodeGetInfo reports
// Config.MaxVolumesPerNode (0: no limit) for the CO to enforce. NodePublishVolume bind-mounts
// staging onto the target (read-only if asked). Unpublish and unstage undo
// each step; unstage detaches a device only once no filesystem claims it
// (an exclusive open succeeds, waited for up to 2 s after the unmount): a
// copy of the staging mount that another mount namespace keeps (one made
// while the volume was staged, with private propagation) keeps the
// filesystem alive there, and a second device attached for the next stage
// would run a second instance of it beside the first. Such an unstage
// fails FailedPrecondition, saying so, with the device attached; the next
// call detaches it once that mount is gone. NodeReclaimSpace runs FITRIM, which punches holes into the image
// through the loop device's discard support, after the filesystem's frees
// of deleted files are final, and answers once the discards have reached
// the image (xfs finishes both in the background); ControllerReclaimSpace
// does the same offline with e2fsck -E discard.
//
// # Snapshots, clones and group snapshots
//
// A snapshot is a full, independent copy of a volume's image in the pool
// (.csi-loop/snapshots/): a reflink (FICLONE) where the pool's filesystem
// shares extents, else a sparse copy that reads only data extents
// (SEEK_DATA/SEEK_HOLE) and skips zero blocks. A staged volume's filesystem
// is frozen (FIFREEZE) for the copy; the thaw runs from its own goroutine
// when the copy returns or at the freeze deadline (freezeTimeout
// parameter, DefaultFreezeTimeout), whichever is first, so a failed or
// stuck copy never leaves a filesystem frozen. The GroupController's
// CreateVolumeGroupSnapshot freezes all members together, copies them all,
// thaws them: write-order consistent across the group. CreateVolume from a
// snapshot (or from a volume: a clone) copies the image back.
//
// # Volume groups and replication
//
// csi-addons volume groups are records in the pool: membership and
// parameters; deleting a group deletes its members. csi-addons
// replication copies a volume to a second pool (Config.ReplicaPool) and
// keeps it in step with syncs that write only the blocks that differ; see
// replication.go for when syncs happen and what the roles allow.
//
// # State
//
// The plugin keeps no state in memory but open descriptors. Every call
// reads what it needs from the kernel: the loop device backed by the image (matched by device and
// inode), the mount table at the staging and target paths. Groups,
// snapshots, replication roles and restored volumes' content sources are
// records in the pool under .csi-loop/, each written atomically (temporary
// file, fsync, rename, fsync of the directory). A plugin killed at any point
// and started again therefore answers every later call as if it had never
// stopped, and an operator's losetup and findmnt show the whole truth.
//
// # Block devices given to containers
//
// A container given a block volume holds its loop device's node, and any
// opener of a loop device, read-only and unprivileged, can ask to detach it
// (LOOP_CLR_FD) or, if it is a LO_FLAGS_READ_ONLY device, re-back it with
// another file (LOOP_CHANGE_FD). So the plugin holds every block-access
// device open from its attach to its own detach (re-held at start), which
// turns a LOOP_CLR_FD into a mark for detaching at the last close; it clears
// such marks every second and on its way out, logging each. Read-only devices
// are read-write loop devices made read-only with BLKROSET, which only
// CAP_SYS_ADMIN can undo, so LOOP_CHANGE_FD does not apply. A device detached
// anyway (marked, then the plugin killed within the second, with no other
// opener) is not reused: attaches skip loop numbers whose node is still
// bound somewhere, and unpublish and unstage remove a bound node whose device
// backs nothing.
//
// # Concurrency and errors
//
// Calls on one volume run one at a time (a per-volume lock; CSI calls wait
// for it within their deadline, ReclaimSpace and replication calls fail at
// once with Aborted), calls on different volumes run in parallel. Two plugin
// processes must not serve the same pool. Internally, errors wrap the
// classes in errors.go; the gRPC interceptor installed by NewServer is the
// only place that chooses status codes, following the CSI spec and the
// csi-addons error tables.
//
// # When not to use it
//
// The volumes live on one node: multi-node access modes are refused, and
// there is no controller publish or expansion. Snapshots and replicas are
// full copies: cheap only where the pool's filesystem reflinks, and a
// freeze lasts as long as the copy. Members staged for block access cannot
// be quiesced, so they are refused in group snapshots and replication
// syncs. The replica pool must be on this host (a mounted filesystem is
// fine). It needs root (CAP_SYS_ADMIN) for loop devices, mounts and
// FIFREEZE; the pool functions and the metadata calls work without.
package loopplugin
