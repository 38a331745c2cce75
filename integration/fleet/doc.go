// Package fleet holds the end-to-end tests of csiagent on many hosts; it
// has no code of its own. A test runs a real 3-member etcd cluster in its
// process (internal/etcdtest: each member an etcd server with its own
// data dir and ports) and several `csi-agent serve` processes on one
// machine, each a host of the fleet: its own node id, work, runtime and
// config dirs and its own csi-loop-plugin, all on one shared pool of
// loop images standing in for network storage. They drive the agents
// only as a user would: the agent API on each socket, the csi-agent CLI,
// SIGKILL, and the machine's mount table.
//
// What they cover: claims raced for by every host (exactly one wins),
// shared readers against a writer, the etcd leader killed while claims
// are taken, a majority of etcd stopped (fail closed, nothing existing
// disturbed, recovery once the quorum is back), an agent host SIGKILLed
// (its claims persist; csi-agent cluster release refused while its lease
// lives, accepted with --node-is-down or after fencing) and a host that
// returns after its claims were released; TestClusterSoak (make
// cluster-soak) with its invariant checker.
//
// They are in a package of their own, apart from package integration, so
// that go test runs them beside those. They need root (mounts, loop
// devices; without it they skip), e2fsprogs and the Go toolchain
// (TestMain builds csi-agent and csi-loop-plugin).
package fleet
