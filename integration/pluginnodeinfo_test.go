package integration

import (
	"os/exec"
	"strings"
	"testing"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestPluginNodeInfoAndCapacity: with the real csi-loop-plugin, csi-agent
// plugins TYPE shows what NodeGetInfo said (topology, the volume limit
// from --max-volumes-per-node), the controller's capabilities and its
// capacity, asked of GetCapacity when the command runs.
func TestPluginNodeInfoAndCapacity(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := mkPool(t, h.dir("pool"))
	h.writeConfig("loop.json", managedConfig("loop", false, bins.loop, "csi-loop-plugin", "--pool="+pool, "--node-id=host-7", "--max-volumes-per-node=3"))
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", func(p *agentv1.Plugin) bool { return p.GetState() == agentv1.PluginState_PLUGIN_STATE_READY })
	out, err := exec.Command(bins.agent, "plugins", "loop", "--api-socket", h.cfg.APISocket).CombinedOutput()
	if err != nil {
		t.Fatalf("csi-agent plugins loop: %v\n%s", err, out)
	}
	for _, want := range []string{"Topology:", "topology.loop.csi.csiagent.io/host=host-7", "Max volumes per node:", "3",
		"Controller capabilities:", "GET_CAPACITY", "Capacity:", " available"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("csi-agent plugins loop lacks %q:\n%s", want, out)
		}
	}
}
