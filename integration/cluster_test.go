package integration

import (
	"errors"
	"os/exec"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csiagent/csiagent/internal/etcdtest"
	"github.com/csiagent/csiagent/internal/testhelp"
)

// TestClusterClaims (issue 29, first part): two agents (nodes a and b,
// each its own work and runtime dirs and its own csi-loop-plugin) share
// one pool standing in for network storage and a real 3-member etcd. A
// SINGLE_NODE_WRITER volume is claimed by the first host to prepare it:
// when both race for it, exactly one wins, every round, and the other is
// refused FailedPrecondition naming the holder; the claim goes with the
// last user's cleanup, and the other host then gets the volume. csi-agent
// cluster nodes and claims show both nodes and the claim's holder.
func TestClusterClaims(t *testing.T) {
	testhelp.NeedRoot(t)
	hosts := []*harness{newHarness(t), newHarness(t)}
	// Started after the harnesses, and closed gracefully: stopped, with
	// every goroutine of its servers, before their leak checks.
	ec := etcdtest.Start(t)
	t.Cleanup(ec.Close)
	nodes := []string{"node-a", "node-b"}
	pool := hosts[0].loopPlugin("loop")
	createVolume(t, pool, "shared")
	hosts[1].writeConfig("loop.json", managedConfig("loop", false, bins.loop, "csi-loop-plugin", "--pool="+pool))
	for i, h := range hosts {
		cfg := fastConfig(h)
		cfg.NodeID = nodes[i]
		cfg.Cluster.Endpoints = ec.Endpoints
		h.start(cfg)
		h.waitPlugin("loop", "ready", ready)
	}
	spec := volumeSpec{plugin: "loop", id: "shared", path: "data", access: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER}
	for round := range 5 {
		errs := make([]error, 2)
		var wg sync.WaitGroup
		for i, h := range hosts {
			wg.Go(func() { _, errs[i] = h.prepare("c", h.dir("sandbox"), "", spec) })
		}
		wg.Wait()
		won := -1
		for i, err := range errs {
			if err == nil {
				if won >= 0 {
					t.Fatalf("round %d: both hosts prepared the single-node volume", round)
				}
				won = i
			}
		}
		if won < 0 {
			t.Fatalf("round %d: neither host prepared the volume: %v", round, errors.Join(errs...))
		}
		lost := 1 - won
		if status.Code(errs[lost]) != codes.FailedPrecondition || !strings.Contains(errs[lost].Error(), nodes[won]) {
			t.Fatalf("round %d: the losing host got %v; want FailedPrecondition naming %s", round, errs[lost], nodes[won])
		}
		if round == 0 {
			// Either host shows the fleet: both nodes alive, the
			// claim and its holder.
			for cmd, want := range map[string][]string{"nodes": {"node-a", "node-b", "true"}, "claims": {"loop", "shared", "exclusive", nodes[won]}} {
				out, err := exec.Command(bins.agent, "cluster", cmd, "--api-socket", hosts[lost].cfg.APISocket).CombinedOutput()
				for _, w := range want {
					if err != nil || !strings.Contains(string(out), w) {
						t.Errorf("csi-agent cluster %s: %v\n%s\nwant %q in it", cmd, err, out, w)
					}
				}
			}
		}
		hosts[won].mustCleanup("c")
		// The claim went with the cleanup: the other host gets it.
		hosts[lost].mustPrepare("c", hosts[lost].dir("sandbox"), "", spec)
		hosts[lost].mustCleanup("c")
	}
	hosts[0].assertClean(pool)
}
