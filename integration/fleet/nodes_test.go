package fleet

import (
	"testing"

	"golang.org/x/sys/unix"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestNodesRegisterCapacity: a node registers each ready plugin with its
// controller's GetCapacity (asked in the background after the join, not
// on the start's path) and its NodeGetInfo, and every node of the fleet
// sees it.
func TestNodesRegisterCapacity(t *testing.T) {
	f := newFleet(t, 2)
	a, b := f.hosts[0], f.hosts[1]
	var st unix.Statfs_t
	if err := unix.Statfs(f.pool, &st); err != nil {
		t.Fatal(err)
	}
	poolSize := int64(st.Blocks) * st.Bsize
	var got *agentv1.ClusterNodePlugin
	f.waitFor("node-a registered with its loop plugin's capacity, as node-b sees it", func() bool {
		ctx, cancel := b.ctx()
		defer cancel()
		resp, err := b.api().ClusterNodes(ctx, &agentv1.ClusterNodesRequest{})
		if err != nil {
			t.Fatalf("ClusterNodes: %v", err)
		}
		for _, n := range resp.GetNodes() {
			for _, p := range n.GetPluginInfo() {
				if n.GetNodeId() == a.node && p.GetType() == loopType && p.GetAvailableCapacity() > 0 {
					got = p
					return true
				}
			}
		}
		return false
	})
	if c := got.GetAvailableCapacity(); c > poolSize {
		t.Errorf("node-a registered %d bytes available, more than its pool's filesystem holds (%d)", c, poolSize)
	}
}
