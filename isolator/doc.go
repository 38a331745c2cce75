// Package isolator owns the volume lifecycle: it prepares and cleans up a
// container's pre-provisioned CSI volumes through the plugins' node
// service, with every transition checkpointed before the RPC (as the Mesos
// volume/csi isolator does) and reference counts persisted, so that crashes
// and reboots never lose track of a mount. Recovery and the periodic
// resync drive every volume and container to where it should be; each wait
// for a plugin and each node call has a deadline, and a plugin that is
// down holds up only its own volumes. It also runs space reclaims (one per
// volume at a time, cancelled by the cleanup of the volume's last user).
package isolator
