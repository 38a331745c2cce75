package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

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
			return nil, fmt.Errorf("volumes[%d]: %w", i, withoutSecrets(r, err))
		}
		out = append(out, v)
	}
	return out, nil
}

// withoutSecrets is a parse error of volume r that quotes no secret:
// protojson's own quotes the value it refused ("invalid value for bytes
// field data: \"hunter2\"", a VALUE secret given as plain text rather
// than base64), and the OCI hook and the CLI print it to logs. The error
// of the volume parsed again without its secrets, or, when that one
// parses, one naming the secrets' fields only.
func withoutSecrets(r json.RawMessage, err error) error {
	var doc any
	if json.Unmarshal(r, &doc) != nil {
		return err // not reached: r is an element of a list json parsed
	}
	fields := dropSecrets(doc)
	if len(fields) == 0 {
		return err
	}
	stripped, merr := json.Marshal(doc)
	if merr != nil {
		return errors.New("invalid volume (its secrets are not shown)")
	}
	if perr := protojson.Unmarshal(stripped, &agentv1.Volume{}); perr != nil {
		return perr
	}
	slices.Sort(fields)
	return fmt.Errorf("invalid secret in %s (a VALUE secret's data is base64 in JSON; the value is not shown)", strings.Join(slices.Compact(fields), ", "))
}

// dropSecrets removes every key of doc's objects, at any depth, whose
// name holds "secret" (either spelling protojson reads) and returns their
// names.
func dropSecrets(doc any) []string {
	var dropped []string
	switch d := doc.(type) {
	case map[string]any:
		for k, v := range d {
			if strings.Contains(strings.ToLower(k), "secret") {
				delete(d, k)
				dropped = append(dropped, k)
				continue
			}
			dropped = append(dropped, dropSecrets(v)...)
		}
	case []any:
		for _, v := range d {
			dropped = append(dropped, dropSecrets(v)...)
		}
	}
	return dropped
}
