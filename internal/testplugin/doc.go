// Command testplugin is a CSI plugin for the agent's tests: it serves the
// CSI Identity and Node services (and on request Controller and csi-addons
// ReclaimSpaceNode) on $CSI_ENDPOINT, and misbehaves on command so that tests
// can drive plugin supervision (slow starts, crashes, crash loops, failing or
// hanging probes, hanging readiness calls) without a real storage system.
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
//	--data-dir DIR       serve NodeStage/Unstage/Publish/UnpublishVolume with bind mounts
//	                     of DIR/<escaped volume id> (needs root); without it they are
//	                     Unimplemented
//
// NodeGetCapabilities reports STAGE_UNSTAGE_VOLUME; NodeGetInfo's node_id is
// $MESOS_AGENT_ID, else "test-node".
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
//
// Probe checks them in this order: --probe-hang, --probe-fail,
// --probe-fail-file, --probe-not-ready.
//
// Output, for tests to assert how the plugin was launched and what it did:
//
//   - stdout, first thing at start: one JSON object with argv, env (only
//     CSI_ENDPOINT, MESOS_AGENT_ID and TESTPLUGIN_* variables that are set),
//     pid, ppid, pgid, uid, gid, cwd and cgroup (the cgroup v2 path from
//     /proc/self/cgroup).
//   - stderr: "testplugin: serving on <socket> pid <pid>" once listening, a
//     line when each RPC starts and one when it ends with its code, and a
//     line saying why it exits.
//
// Exit status: 0 after SIGTERM or SIGINT (in-flight calls are failed with
// Unavailable, the server stops gracefully within 5s, the socket is
// removed), 2 for bad flags or a bad CSI_ENDPOINT, 3 for a requested crash,
// 1 if serving fails.
package main
