// Package loopplugin is a complete CSI plugin (Identity, Controller and Node
// services, plus the csi-addons ReclaimSpace services) whose volumes are
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
// device node onto <staging>/device instead. NodePublishVolume bind-mounts
// staging onto the target (read-only if asked). Unpublish and unstage undo
// each step. NodeReclaimSpace runs FITRIM, which punches holes into the image
// through the loop device's discard support; ControllerReclaimSpace does the
// same offline with e2fsck -E discard.
//
// # State
//
// The plugin keeps no state of its own, neither in memory nor on disk. Every
// call reads what it needs from the kernel: the loop device backed by the
// image (matched by device and inode), the mount table at the staging and
// target paths. A plugin killed at any point and started again therefore
// answers every later call as if it had never stopped, and an operator's
// losetup and findmnt show the whole truth.
//
// # Concurrency and errors
//
// Calls on one volume run one at a time (a per-volume lock; CSI calls wait
// for it within their deadline, ReclaimSpace calls fail at once with
// Aborted), calls on different volumes run in parallel. Two plugin
// processes must not serve the same pool. Internally, errors wrap the
// classes in errors.go; the gRPC interceptor installed by NewServer is the
// only place that chooses status codes, following the CSI spec and the
// csi-addons error tables.
//
// # When not to use it
//
// The volumes live on one node: multi-node access modes are refused, and
// there is no controller publish, snapshot, clone or expansion. It needs
// root (CAP_SYS_ADMIN) for loop devices and mounts; only the pool functions
// work without.
package loopplugin
