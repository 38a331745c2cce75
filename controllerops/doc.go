// Package controllerops is the agent's Controller API: the agent acting as
// the CO of the csi-addons VolumeGroup and Replication specs and of CSI's
// GroupController, relaying each API operation to one plugin's controller.
//
// Each plugin RPC is made as its spec's error table says (the tables are
// in the file of their service: volumegroup.go, replication.go,
// groupsnapshot.go): codes the table marks retryable are retried with
// exponential backoff under the caller's RetryPolicy, others fail at once
// with a message naming the RPC, the plugin's message, the attempts and
// what to fix. One operation at a time runs per plugin object, as the
// specs ask of a CO; a second one waits and says so in a WAITING progress.
//
// The package knows plugins only through the Plugins interface (a ready
// controller connection, what discovery found, where logs are); it holds
// no state beyond its per-object locks. Do not call it for node-side
// operations (publish, reclaim): those belong to the isolator and the
// reclaim scheduler.
package controllerops
