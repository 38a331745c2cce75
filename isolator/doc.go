// Package isolator owns the volume lifecycle, as the Mesos volume/csi
// isolator does: Prepare gives a container its pre-provisioned CSI volumes
// (NodeStageVolume once per volume, NodePublishVolume, then a bind mount at
// the container path resolved inside its rootfs or sandbox, or, for a
// container with a pid, a clone of the published mount moved into its
// mount namespace), and Cleanup takes them away, the last user of a volume
// unpublishing and unstaging it. Prepare is all or nothing.
//
// Every transition is checkpointed under the work directory (Mesos layout,
// one file per volume and per container) before the node call that may act,
// and a volume's users are persisted with it, so a crash or a reboot never
// loses track of a mount: Run recovers first (redoing a transitional state
// the whole way, remounting what a reboot removed, dropping users no
// container backs) and then keeps every volume and container converged.
// Operations are serialised per volume and per container. Reclaim-space
// calls (ReclaimSpace on a volume published here, ReclaimOffline on one
// that is not) run under the volume's lock too, so they never overlap a
// prepare or a cleanup.
//
// It finds plugins through the Plugins interface the daemon implements and
// never dials or supervises them. Not for: provisioning volumes (CSI
// controller calls) or deciding when to reclaim (package reclaim).
package isolator
