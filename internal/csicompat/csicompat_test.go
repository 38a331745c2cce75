package csicompat

import (
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// oldStats is a NodeGetVolumeStatsResponse as a CSI 1.12 plugin sends it:
// usage, then volume_condition {abnormal, message}.
func oldStats(t *testing.T, abnormal bool, message string) []byte {
	t.Helper()
	usage, err := proto.Marshal(&csi.VolumeUsage{Total: 100, Unit: csi.VolumeUsage_BYTES})
	if err != nil {
		t.Fatal(err)
	}
	var cond []byte
	if abnormal {
		cond = protowire.AppendTag(cond, 1, protowire.VarintType)
		cond = protowire.AppendVarint(cond, 1)
	}
	cond = protowire.AppendTag(cond, 2, protowire.BytesType)
	cond = protowire.AppendString(cond, message)
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, usage)
	b = protowire.AppendTag(b, 2, protowire.BytesType)
	return protowire.AppendBytes(b, cond)
}

// TestStatsCondition: the condition a CSI 1.12 plugin sends survives the
// 1.13 bindings' decoding, as unknown fields, and reads back; an answer
// without one says so; a malformed one is an error.
func TestStatsCondition(t *testing.T) {
	for _, c := range []struct {
		abnormal bool
		message  string
	}{{true, "The volume isn't mounted"}, {false, ""}} {
		var resp csi.NodeGetVolumeStatsResponse
		if err := proto.Unmarshal(oldStats(t, c.abnormal, c.message), &resp); err != nil {
			t.Fatal(err)
		}
		if len(resp.GetUsage()) != 1 {
			t.Fatalf("usage lost: %v", &resp)
		}
		got, ok, err := StatsCondition(&resp)
		if err != nil || !ok || got != (Condition{c.abnormal, c.message}) {
			t.Errorf("StatsCondition = %+v, %v, %v; want %+v", got, ok, err, c)
		}
	}
	if _, ok, err := StatsCondition(&csi.NodeGetVolumeStatsResponse{}); ok || err != nil {
		t.Errorf("no condition sent: ok %v, %v", ok, err)
	}
	var bad csi.NodeGetVolumeStatsResponse
	bad.ProtoReflect().SetUnknown(protowire.AppendTag(nil, 2, protowire.BytesType))
	if _, _, err := StatsCondition(&bad); err == nil || !strings.Contains(err.Error(), "volume_condition") {
		t.Errorf("malformed condition: %v", err)
	}
}

func TestNodeCapabilityName(t *testing.T) {
	if got := NodeCapabilityName(4); got != VolumeCondition {
		t.Errorf("type 4 = %q", got)
	}
	if got := NodeCapabilityName(csi.NodeServiceCapability_RPC_GET_VOLUME_HEALTH); got != "GET_VOLUME_HEALTH" {
		t.Errorf("GET_VOLUME_HEALTH = %q", got)
	}
}
