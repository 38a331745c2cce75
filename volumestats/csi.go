package volumestats

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/container-storage-interface/spec/lib/go/csi"

	"github.com/csiagent/csiagent/internal/csicompat"
)

// PollNode calls NodeGetVolumeStats and NodeGetVolumeHealth on a CSI node
// service, as its capabilities (caps: the node capability names) offer
// them: the calls a Source's Poll makes for a CSI plugin. The health of a
// plugin built on CSI 1.12 or earlier (VOLUME_CONDITION) comes with its
// stats (csicompat); NodeGetVolumeHealth, when offered too, has the last
// word.
func PollNode(ctx context.Context, node csi.NodeClient, caps []string, v Volume) Stats {
	var st Stats
	if slices.Contains(caps, "GET_VOLUME_STATS") {
		resp, err := node.NodeGetVolumeStats(ctx, &csi.NodeGetVolumeStatsRequest{VolumeId: v.ID, VolumePath: v.TargetPath, StagingTargetPath: v.StagingPath})
		if err != nil {
			st.Err = fmt.Errorf("NodeGetVolumeStats: %w", err)
			return st
		}
		if slices.Contains(caps, csicompat.VolumeCondition) {
			c, ok, err := csicompat.StatsCondition(resp)
			if err != nil {
				st.Err = fmt.Errorf("NodeGetVolumeStats: %w", err)
				return st
			}
			st.HealthKnown, st.Abnormal, st.Condition = ok, ok && c.Abnormal, ""
			if st.Abnormal {
				st.Condition = strings.TrimSpace("abnormal: " + c.Message)
			}
		}
		for _, u := range resp.GetUsage() {
			x := Usage{Known: true, Total: u.GetTotal(), Used: u.GetUsed(), Available: u.GetAvailable()}
			switch u.GetUnit() {
			case csi.VolumeUsage_BYTES:
				st.Bytes = x
			case csi.VolumeUsage_INODES:
				st.Inodes = x
			}
		}
	}
	if slices.Contains(caps, "GET_VOLUME_HEALTH") {
		resp, err := node.NodeGetVolumeHealth(ctx, &csi.NodeGetVolumeHealthRequest{VolumeId: v.ID, VolumePublishPath: v.TargetPath, StagingTargetPath: v.StagingPath})
		if err != nil {
			st.Err = fmt.Errorf("NodeGetVolumeHealth: %w", err)
			return st
		}
		st.HealthKnown = true
		var conds []string
		for _, h := range resp.GetVolumeHealth().GetHealthStatuses() {
			conds = append(conds, strings.TrimSpace(fmt.Sprintf("%s %s: %s", h.GetStatus(), h.GetReason(), h.GetMessage())))
		}
		st.Abnormal, st.Condition = len(conds) > 0, strings.Join(conds, "; ")
	}
	return st
}
