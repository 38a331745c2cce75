package cli

import (
	"bytes"
	"strings"
	"testing"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestPluginDetailShowsNodeInfo: csi-agent plugins TYPE shows what
// NodeGetInfo said beyond the node id (the topology segments, sorted, and
// the volume limit), the controller's capabilities and its capacity, and
// none of them for a plugin that reports none.
func TestPluginDetailShowsNodeInfo(t *testing.T) {
	p := &agentv1.Plugin{Type: "t", Instances: []*agentv1.PluginInstance{{
		NodeId: "n1", MaxVolumesPerNode: 16,
		AccessibleTopology:     map[string]string{"zone": "z1", "host": "h1"},
		ControllerCapabilities: []string{"CREATE_DELETE_VOLUME", "GET_CAPACITY"},
	}}, Capacity: &agentv1.Capacity{AvailableBytes: 3 << 30, MaximumVolumeBytes: 1 << 30}}
	var b bytes.Buffer
	printPluginDetail(&b, p)
	for _, want := range []string{"Topology:", "host=h1, zone=z1", "Max volumes per node:", "16",
		"Controller capabilities:", "CREATE_DELETE_VOLUME, GET_CAPACITY", "Capacity:", "3.0 GiB available, volumes of at most 1.0 GiB"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("the detail lacks %q:\n%s", want, b.String())
		}
	}
	b.Reset()
	printPluginDetail(&b, &agentv1.Plugin{Type: "t", Instances: []*agentv1.PluginInstance{{NodeId: "n1"}}})
	if strings.Contains(b.String(), "Topology") || strings.Contains(b.String(), "Max volumes") || strings.Contains(b.String(), "Capacity") || strings.Contains(b.String(), "Controller capabilities") {
		t.Errorf("a plugin without topology or limit shows them:\n%s", b.String())
	}
}
