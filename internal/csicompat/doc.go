// Package csicompat reads what plugins built on CSI 1.3 to 1.12 send and
// the CSI 1.13 bindings no longer describe: the node capability
// VOLUME_CONDITION (NodeServiceCapability.RPC.Type 4) and
// NodeGetVolumeStatsResponse.volume_condition (field 2), through which
// such plugins (csi-driver-host-path among them) report a volume's
// health. CSI 1.13 replaced them with GET_VOLUME_HEALTH and
// NodeGetVolumeHealth; most plugins in the field still speak the old way.
//
// The old fields arrive as unknown fields of the new messages: decoded
// here from the wire (protowire), once, at the edge. Use it where the
// agent reads capabilities and stats; do not use it to build requests.
package csicompat
