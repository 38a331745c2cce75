// Package integration holds csiagent's end-to-end tests; it has no code
// of its own. They use the other packages as a user of them does: a
// daemon started in-process with agent.New and Run, or `csi-agent serve`
// run as a child, and driven only through what a user sees: the agent API
// on its socket, the csi-agent CLI, the OCI hook under runc, Docker's
// volume plugin protocol, the Prometheus metrics, sd_notify, the files of
// the work and runtime directories and the mount table.
//
// What they cover: plugin supervision (managed and unmanaged, live
// config, crash-loop backoff, probes, adoption after an agent SIGKILL),
// the volume lifecycle on csi-loop-plugin loop volumes (shared volumes,
// container paths, read-only and block, secrets, access modes), crashes
// at every step and recovery (corrupt checkpoints, work dir full, reboot,
// misbehaving plugins, a plugin down), the attack tables (hostile ids and
// messages, symlink escapes, a container that moves or covers its mounts,
// in real runc containers too), reclaim, repair, key rotation, expansion,
// the controller relay (volume groups, replication, group snapshots,
// fencing), metrics, the systemd unit and sd_notify, the OCI hook with
// runc, Docker and Podman named volumes, and TestSoak.
//
// What they need: root for most (mounts, loop devices, runc, other
// users; without it those skip), the Go toolchain (TestMain builds csi-agent,
// csi-loop-plugin and internal/testplugin once, with
// internal/testhelp.BuildBinaries), and the tools `make deps` installs:
// e2fsprogs, runc, busybox-static, systemd (systemd-analyze), and for the
// engine tests dockerd and podman. An engine that is not installed, or
// does not start on this machine, skips its tests; each engine is started
// by the first test that needs it, with storage of the tests' own, and
// stopped at the end.
//
// How they run: `make test` runs the package without -race (E2E_PKGS in
// the Makefile), 80 to 95 s here; alone, `go test -count=1 ./integration`
// as root. TestSoak is a 15 s smoke there; `make soak DURATION=10m` runs
// it for longer (CSIAGENT_SOAK_DURATION). `make bench` runs
// TestDockerRunOverhead with -engine-pairs 20. Tests run one at a time:
// they share the host's loop devices and mount table. The in-process
// harness fails a test that leaves a goroutine and kills the plugin
// processes its agent left; the volume tests check that no mount or loop
// device of theirs is left.
package integration
