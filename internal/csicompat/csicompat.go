package csicompat

import (
	"fmt"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/encoding/protowire"
)

// VolumeCondition is the name of the node capability CSI 1.3 to 1.12 call
// VOLUME_CONDITION (type 4): NodeGetVolumeStats reports the volume's
// condition.
const VolumeCondition = "VOLUME_CONDITION"

// nodeVolumeCondition is VOLUME_CONDITION's number.
const nodeVolumeCondition csi.NodeServiceCapability_RPC_Type = 4

// NodeCapabilityName names a node capability as the CSI spec does, the
// ones the bindings dropped included.
func NodeCapabilityName(t csi.NodeServiceCapability_RPC_Type) string {
	if t == nodeVolumeCondition {
		return VolumeCondition
	}
	return t.String()
}

// Condition is a volume's condition as NodeGetVolumeStats reported it.
type Condition struct {
	Abnormal bool
	Message  string
}

// statsVolumeCondition is NodeGetVolumeStatsResponse.volume_condition's
// field number; VolumeCondition's fields are abnormal (1) and message
// (2).
const (
	statsVolumeCondition protowire.Number = 2
	conditionAbnormal    protowire.Number = 1
	conditionMessage     protowire.Number = 2
)

// StatsCondition reads volume_condition from a NodeGetVolumeStats answer;
// ok is false when the plugin sent none. A malformed one is an error.
func StatsCondition(resp *csi.NodeGetVolumeStatsResponse) (c Condition, ok bool, err error) {
	b := resp.ProtoReflect().GetUnknown()
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return Condition{}, false, fmt.Errorf("volume_condition: %w", protowire.ParseError(n))
		}
		b = b[n:]
		if num == statsVolumeCondition && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return Condition{}, false, fmt.Errorf("volume_condition: %w", protowire.ParseError(n))
			}
			if c, err = parseCondition(v); err != nil {
				return Condition{}, false, err
			}
			ok = true // the last one wins, as proto3 says
			b = b[n:]
			continue
		}
		n = protowire.ConsumeFieldValue(num, typ, b)
		if n < 0 {
			return Condition{}, false, fmt.Errorf("volume_condition: %w", protowire.ParseError(n))
		}
		b = b[n:]
	}
	return c, ok, nil
}

// parseCondition decodes a VolumeCondition message.
func parseCondition(b []byte) (Condition, error) {
	var c Condition
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return Condition{}, fmt.Errorf("volume_condition: %w", protowire.ParseError(n))
		}
		b = b[n:]
		switch {
		case num == conditionAbnormal && typ == protowire.VarintType:
			v, m := protowire.ConsumeVarint(b)
			if m < 0 {
				return Condition{}, fmt.Errorf("volume_condition.abnormal: %w", protowire.ParseError(m))
			}
			c.Abnormal, n = v != 0, m
		case num == conditionMessage && typ == protowire.BytesType:
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return Condition{}, fmt.Errorf("volume_condition.message: %w", protowire.ParseError(m))
			}
			c.Message, n = string(v), m
		default:
			if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
				return Condition{}, fmt.Errorf("volume_condition: %w", protowire.ParseError(n))
			}
		}
		b = b[n:]
	}
	return c, nil
}
