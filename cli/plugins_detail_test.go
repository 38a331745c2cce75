package cli

import (
	"bytes"
	"strings"
	"testing"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestPluginDetailShowsNodeInfo: csi-agent plugins TYPE shows what
// NodeGetInfo said beyond the node id: the topology segments (sorted) and
// the volume limit, and nothing for a plugin that reports neither.
func TestPluginDetailShowsNodeInfo(t *testing.T) {
	p := &agentv1.Plugin{Type: "t", Instances: []*agentv1.PluginInstance{{
		NodeId: "n1", MaxVolumesPerNode: 16,
		AccessibleTopology: map[string]string{"zone": "z1", "host": "h1"},
	}}}
	var b bytes.Buffer
	printPluginDetail(&b, p)
	for _, want := range []string{"Topology:", "host=h1, zone=z1", "Max volumes per node:", "16"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("the detail lacks %q:\n%s", want, b.String())
		}
	}
	b.Reset()
	printPluginDetail(&b, &agentv1.Plugin{Type: "t", Instances: []*agentv1.PluginInstance{{NodeId: "n1"}}})
	if strings.Contains(b.String(), "Topology") || strings.Contains(b.String(), "Max volumes") {
		t.Errorf("a plugin without topology or limit shows them:\n%s", b.String())
	}
}
