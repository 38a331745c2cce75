// Command testplugin is a CSI plugin for the agent's tests: it serves the
// CSI Identity and Node services (and on request Controller and csi-addons
// ReclaimSpaceNode and EncryptionKeyRotationController) on $CSI_ENDPOINT,
// with gRPC server reflection listing what it serves (no csi-addons
// identity: the agent's discovery reads the reflection), and misbehaves on command so that tests can drive plugin supervision
// (slow starts, crashes, crash loops, failing or hanging probes, hanging
// readiness calls) and the volume lifecycle (secrets that must arrive,
// node calls that fail on demand, a publish that lies) without a real
// storage system.
//
// Tests build it with `go build ./internal/testplugin` and launch it the way
// the agent launches managed plugins. It is not a reference plugin (that is
// cmd/csi-loop-plugin) and must never be installed on a host.
//
// Usage:
//
//	CSI_ENDPOINT=unix:///path/csi.sock testplugin [flags] [args...]
//
// CSI_ENDPOINT is unix:///path, unix:path or a bare path; a stale socket at
// the path is removed. Extra arguments are ignored (they show in argv).
//
// Identity and node flags:
//
//	--name NAME          GetPluginInfo name (default test.csi.csiagent.io; version 0.0.1)
//	--controller         advertise CONTROLLER_SERVICE and serve ControllerGetCapabilities
//	--reclaim            serve reclaimspace.ReclaimSpaceNode (without it the service is
//	                     not registered, so calls fail with Unimplemented); NodeReclaimSpace
//	                     reports pre_usage 1048576 and post_usage 0
//	--key-rotation       serve encryptionkeyrotation.EncryptionKeyRotationController;
//	                     EncryptionKeyRotate checks volume_id and volume_path and
//	                     rotates nothing
//	--data-dir DIR       serve NodeStage/Unstage/Publish/UnpublishVolume with bind mounts
//	                     of DIR/<escaped volume id> (needs root); without it they are
//	                     Unimplemented
//
// NodeGetCapabilities reports STAGE_UNSTAGE_VOLUME; NodeGetInfo's node_id is
// $MESOS_AGENT_ID, else "test-node".
//
// Node volumes (with --data-dir). A volume is the directory DIR/<escaped id>
// (created on first stage); a block volume's data is the file
// DIR/<escaped id>.blk (created sparse, 16 MiB, on first block publish; ids
// "x" and "x.blk" collide, so tests must not use both). Paths must be
// absolute (else InvalidArgument), and, as CSI says, the CO creates the
// staging directory and the target's parent (else FailedPrecondition).
//
//   - NodeStageVolume bind-mounts the volume directory on the staging path,
//     for mount and block access alike.
//   - NodePublishVolume needs the volume staged at staging_target_path
//     (else FailedPrecondition). For mount access it bind-mounts the staging
//     path on the target, a directory; for block access, the backing file on
//     the target, a regular file. The target may exist (with
//     target_path_exists the CO creates it: an empty directory or file) or
//     is created; one of the wrong type or a symlink is FailedPrecondition.
//     Read-only if asked.
//   - NodeUnpublishVolume and NodeUnstageVolume unmount the path only if it
//     is a mount of this volume (another mount there is FailedPrecondition
//     and stays), and remove nothing else, except that unpublish removes
//     (not recursively) a target that publish created. Those targets are
//     recorded in DIR/#targets/, so this holds after a restart.
//   - A repeated call that is done succeeds; publishing again with another
//     read-only setting, or on a target holding another mount, is
//     AlreadyExists. A concurrent call on the same volume is Aborted.
//
// NodeStageVolume and NodePublishVolume check the request first, then the
// --fail-*-file, then the --require-*-secret flags, then (publish)
// --lie-publish.
//
// Node flags for the agent's isolator tests:
//
//	--require-stage-secret KEY=VALUE    NodeStageVolume fails with Unauthenticated
//	                                    ("missing or wrong secret KEY") unless its
//	                                    secrets map KEY to VALUE; repeatable, other
//	                                    keys are allowed
//	--require-publish-secret KEY=VALUE  the same for NodePublishVolume
//	--fail-stage-file F                 NodeStageVolume fails while F exists, with
//	                                    the gRPC code named in F ("Unavailable",
//	                                    "INVALID_ARGUMENT", "14"; empty: Internal;
//	                                    anything else: Internal saying so); write F
//	                                    atomically (rename) while calls may run
//	--fail-publish-file F               the same for NodePublishVolume
//	--lie-publish                       NodePublishVolume succeeds without mounting
//	                                    or creating anything
//	--target-must-exist                 NodePublishVolume fails with FailedPrecondition
//	                                    when target_path does not exist (a plugin
//	                                    configured with target_path_exists)
//	--publish-misbehave-file F          while F exists, NodePublishVolume (after the
//	                                    request, --fail-publish-file and secret
//	                                    checks) misbehaves as F says: "hang" blocks
//	                                    until the call's context ends; "lie" succeeds
//	                                    without mounting; "die" publishes, removes F
//	                                    and exits with status 3 without answering;
//	                                    "oversized" publishes and answers with a
//	                                    5 MiB message (over gRPC's 4 MiB default
//	                                    limit); "malformed" publishes and answers
//	                                    with bytes that are not a valid message
//
// Secret values are never logged: stderr shows the keys of the secrets each
// call got, and the argv on stdout shows --require-*-secret as KEY=***.
//
// Misbehaviour flags:
//
//	--start-delay D      sleep D before listening (slow start)
//	--crash-after D      exit with status 3 after serving for D, leaving the socket behind
//	--exit-immediately   exit with status 3 at once (crash loop); the stdout line is still written
//	--probe-not-ready N  the first N Probe calls that would succeed report ready=false
//	--probe-fail         Probe fails with Unavailable
//	--probe-hang         Probe blocks until its context ends (or the plugin stops)
//	--probe-fail-file F  Probe fails with Unavailable while file F exists (toggle at run time)
//	--hang-info          GetPluginInfo blocks until its context ends (or the plugin stops)
//	--reclaim-hang       NodeReclaimSpace of a named volume blocks until its context ends
//
// Probe checks them in this order: --probe-hang, --probe-fail,
// --probe-fail-file, --probe-not-ready.
//
// Output, for tests to assert how the plugin was launched and what it did:
//
//   - stdout, first thing at start: one JSON object with argv (secret values
//     masked), env (only CSI_ENDPOINT, MESOS_AGENT_ID and TESTPLUGIN_*
//     variables that are set), pid, ppid, pgid, uid, gid, cwd and cgroup
//     (the cgroup v2 path from /proc/self/cgroup).
//   - stderr: "testplugin: serving on <socket> pid <pid>" once listening, a
//     line when each RPC starts and one when it ends with its code, and a
//     line saying why it exits; "<method>: secrets with keys [...]" for a
//     stage or publish call with secrets.
//
// Exit status: 0 after SIGTERM or SIGINT (in-flight calls are failed with
// Unavailable, the server stops gracefully within 5s, the socket is
// removed), 2 for bad flags or a bad CSI_ENDPOINT, 3 for a requested crash,
// 1 if serving fails.
package main
