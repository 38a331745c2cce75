package cli

import (
	"strings"
	"testing"
)

// TestParseVolumesReadonly: a Volume as the Mesos doc writes it, with
// static_provisioning.readonly, parses (before: unknown field "readonly"),
// and the flag comes through.
func TestParseVolumesReadonly(t *testing.T) {
	vols, err := parseVolumes([]byte(`[{"container_path": "/data", "mode": "RO", "source": {"type": "CSI_VOLUME", "csi_volume": {
		"plugin_name": "loop", "static_provisioning": {"volume_id": "v1", "readonly": true,
		"volume_capability": {"mount": {}, "access_mode": {"mode": "MULTI_NODE_READER_ONLY"}}}}}}]`))
	if err != nil {
		t.Fatal(err)
	}
	if !vols[0].GetSource().GetCsiVolume().GetStaticProvisioning().GetReadonly() {
		t.Errorf("readonly lost: %v", vols[0])
	}
}

// TestParseVolumesQuotesNoSecret: a VALUE secret given as plain text, not
// base64, is an error that names the secrets' field and not the value (the
// OCI hook's and the CLI's errors reach the runtime's logs; protojson's
// own error quoted it). An error elsewhere in a volume with secrets is
// still the parser's own, without the secrets.
func TestParseVolumesQuotesNoSecret(t *testing.T) {
	const secret = "hunter2!secret"
	volume := func(extra string) []byte {
		return []byte(`[{"container_path": "/data", "mode": "RW"` + extra + `, "source": {"type": "CSI_VOLUME", "csi_volume": {
			"plugin_name": "loop", "static_provisioning": {"volume_id": "v1",
			"node_stage_secrets": {"k": {"type": "VALUE", "value": {"data": "` + secret + `"}}},
			"volume_capability": {"mount": {}, "access_mode": {"mode": "SINGLE_NODE_WRITER"}}}}}}]`)
	}
	_, err := parseVolumes(volume(""))
	if err == nil || strings.Contains(err.Error(), secret) || !strings.Contains(err.Error(), "node_stage_secrets") {
		t.Errorf("a plain-text VALUE secret: %v; want an error naming node_stage_secrets, without the value", err)
	}
	_, err = parseVolumes(volume(`, "colour": "red"`))
	if err == nil || strings.Contains(err.Error(), secret) || !strings.Contains(err.Error(), "colour") {
		t.Errorf("an unknown field beside a bad secret: %v; want the parser's error naming colour, without the value", err)
	}
}
