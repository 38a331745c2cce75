package cli

import "testing"

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
