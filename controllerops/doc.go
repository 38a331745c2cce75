// Package controllerops is the agent's Controller API: the agent acting as
// the CO of the csi-addons VolumeGroup, Replication and network fencing
// specs and of CSI's snapshots (Controller) and GroupController, relaying each API operation to one
// plugin's controller; and of the operations on a volume published here
// that a CO starts on the node plugin (csi-addons key rotation, CSI's
// NodeExpandVolume).
//
// Each plugin RPC is made as its spec's error table says (the tables are
// in the file of their service: volumegroup.go, replication.go,
// snapshot.go, groupsnapshot.go, fence.go, keyrotation.go, expand.go): codes the table marks retryable are retried with
// exponential backoff under the caller's RetryPolicy, others fail at once
// with a message naming the RPC, the plugin's message, the attempts and
// what to fix. One operation at a time runs per plugin object, as the
// specs ask of a CO; a second one waits and says so in a WAITING progress.
//
// Snapshots and group snapshots are recorded in the snapshot catalogue
// (package snapcat) under the name given at create: an intent before the
// plugin's create call, the result before the reply; get, delete and
// restore find them there by name. A group snapshot of a container
// (containersnapshot.go) freezes the container's filesystems around the
// plugin call, under a deadline, with a durable freeze record that the
// agent's start thaws after a crash.
//
// The package knows plugins only through the Plugins interface (a ready
// connection for a service, what discovery found, where a volume is
// published, a named volume's and a container's volumes, where logs
// are); it holds no state beyond its per-object locks and the catalogue. Do not call it for a volume's lifecycle (stage, publish, reclaim):
// that belongs to the isolator and the per-volume schedules (packages
// reclaim and pervolume).
package controllerops
