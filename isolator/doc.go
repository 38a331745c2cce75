// Package isolator owns the volume lifecycle, as the Mesos volume/csi
// isolator does: Prepare gives a container its CSI volumes
// (ControllerPublishVolume once per volume when the plugin's controller
// attaches, its publish_context recorded and passed on; NodeStageVolume once
// per volume, NodePublishVolume, then a bind mount at
// the container path resolved inside its rootfs or sandbox, or, for a
// container with a pid, a clone of the published mount moved into its
// mount namespace), and Cleanup takes them away, the last user of a volume
// unpublishing, unstaging and detaching it. Prepare is all or nothing. A volume
// whose filesystem is still mounted elsewhere when its last user goes (in
// another mount namespace than the agent's, a container's: a former
// user's bind the agent did not make; see mount.ForeignMounts) is not torn
// down: it stays published, without
// users, with an error saying where, until a resync pass finds that mount
// gone; meanwhile a single-writer Prepare of it is refused (a second
// stage would make a second live instance of its filesystem), and users
// with a multi-writer or read-only access mode share it.
//
// Every transition is checkpointed under the work directory before the
// call that may act (the attach's durably first: an attachment outlives a
// power cut), and a volume's users are persisted with it, so a
// crash or a reboot never loses track of a mount: Run recovers first
// (redoing a transitional state the whole way, republishing after a
// reboot what has users and tearing down through the plugin what has
// none, remounting container mounts a reboot removed, dropping users no
// container backs) and then keeps every volume
// and container converged. Repair is the isolator's too: a published
// volume whose target path its Mounter finds not mounted (unmounted
// behind its back) is republished and re-bound into its containers,
// found by the resync passes and repaired on a worker of its own, or
// checked when the daemon calls Repair (before each stats poll); the
// policy (Config.NoRepair: only warn) and the report of each outcome
// (Config.OnRepair) are in its Config. Each wait for a plugin and each node call has
// a deadline, and a plugin that is down holds up only its own volumes
// (skipped, state kept, retried on the next pass). Operations are
// serialised per volume and per container. Reclaim-space calls run under
// the volume's lock too, so they never overlap a prepare or a cleanup;
// one runs per volume at a time, and the cleanup of the volume's last
// user cancels it.
//
// Its types are its own: what a container asks for, a volume's and a
// mount's records are the messages of its checkpoint schema
// (proto/state/v1, versioned, importing no API schema), and ListVolumes,
// ListContainers and Reconcile report plain views. It imports no API
// package; the API edge (package apiserver) translates.
//
// It finds plugins through the Plugins interface the daemon implements and
// never dials or supervises them. Its mount work goes through a Mounter:
// package mount by default; the package's unit tests put an in-memory
// model of the mount table and a fake node service in their place, so the
// state machine, recovery and reference counting are tested without root.
// Not for: creating or deleting volumes (the agent's named volumes) or
// deciding when to reclaim or rotate keys (packages reclaim and
// pervolume).
package isolator
