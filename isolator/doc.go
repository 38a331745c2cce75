// Package isolator will own the volume lifecycle: prepare and clean up a
// container's pre-provisioned CSI volumes through the plugins' node
// service, with every transition checkpointed before the RPC (as the Mesos
// volume/csi isolator does) and reference counts persisted, so that crashes
// and reboots never lose track of a mount.
//
// Nothing is implemented here yet; see issue 5.
package isolator
