package cli

import (
	"encoding/json"
	"fmt"

	"google.golang.org/protobuf/encoding/protojson"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// parseVolumes reads a JSON list of Mesos Volume objects, as frameworks
// write them (field names as in mesos.proto, enums by name), e.g.
//
//	[{"container_path": "data", "mode": "RW", "source": {"type": "CSI_VOLUME",
//	  "csi_volume": {"plugin_name": "...", "static_provisioning": {...}}}}]
//
// Unknown fields are errors naming the volume's index.
func parseVolumes(data []byte) ([]*agentv1.Volume, error) {
	var raw []json.RawMessage
	if err := json.Unmarshal(data, &raw); err != nil {
		return nil, fmt.Errorf("volumes: expected a JSON list of Mesos Volume objects: %w", err)
	}
	out := make([]*agentv1.Volume, 0, len(raw))
	for i, r := range raw {
		v := &agentv1.Volume{}
		if err := protojson.Unmarshal(r, v); err != nil {
			return nil, fmt.Errorf("volumes[%d]: %w", i, err)
		}
		out = append(out, v)
	}
	return out, nil
}
