package integration

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestVolumeStatsE2E fills a published loop volume and checks the agent's
// figures (API and metrics) against statfs of its target; removing its
// backing image shows as abnormal within one poll interval; once the
// volume is cleaned up its series are gone.
func TestVolumeStatsE2E(t *testing.T) {
	testhelp.NeedRoot(t)
	const interval = 300 * time.Millisecond
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "vol1")
	cfg := metricsConfig(h)
	cfg.VolumeStatsInterval = interval
	h.start(cfg)
	h.waitPlugin("loop", "ready", ready)
	sb := h.dir("sandbox")
	resp := h.mustPrepare("c1", sb, "", volumeSpec{plugin: "loop", id: "vol1", path: "data"})
	if err := os.WriteFile(filepath.Join(resp.GetMounts()[0].GetHostPath(), "fill"), make([]byte, 16<<20), 0o644); err != nil {
		t.Fatal(err)
	}
	unix.Sync()

	list, err := h.api().ListVolumes(context.Background(), &agentv1.ListVolumesRequest{RefreshStats: true})
	if err != nil || len(list.GetVolumes()) != 1 {
		t.Fatalf("ListVolumes: %v, %v", list, err)
	}
	v := list.GetVolumes()[0]
	var st unix.Statfs_t
	if err := unix.Statfs(v.GetTargetPath(), &st); err != nil {
		t.Fatal(err)
	}
	s, bs := v.GetStats(), int64(st.Bsize)
	if !s.GetBytesKnown() || s.GetCapacityBytes() != int64(st.Blocks)*bs || s.GetUsedBytes() != int64(st.Blocks-st.Bfree)*bs ||
		s.GetAvailableBytes() != int64(st.Bavail)*bs || s.GetInodes() != int64(st.Files) || s.GetInodesFree() != int64(st.Ffree) ||
		s.GetUsedBytes() < 16<<20 || !s.GetHealthKnown() || s.GetAbnormal() {
		t.Errorf("stats %v; statfs blocks %d free %d avail %d bsize %d files %d ffree %d", s, st.Blocks, st.Bfree, st.Bavail, bs, st.Files, st.Ffree)
	}
	labels := map[string]string{"plugin": "loop", "volume_id": "vol1"}
	m := h.scrape()
	for name, want := range map[string]int64{
		"csi_agent_volume_stats_capacity_bytes": s.GetCapacityBytes(), "csi_agent_volume_stats_used_bytes": s.GetUsedBytes(),
		"csi_agent_volume_stats_available_bytes": s.GetAvailableBytes(), "csi_agent_volume_stats_inodes": s.GetInodes(),
		"csi_agent_volume_stats_inodes_used": s.GetInodesUsed(), "csi_agent_volume_stats_inodes_free": s.GetInodesFree(),
		"csi_agent_volume_condition_abnormal": 0,
	} {
		if got := m.value(name, labels); got != float64(want) {
			t.Errorf("%s = %v, want %d", name, got, want)
		}
	}

	// The backing image goes (a hard link keeps the inode, to put it back
	// for the cleanup).
	image, keep := filepath.Join(pool, "vol1.img"), filepath.Join(h.extra, "keep.img")
	if err := os.Link(image, keep); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(image); err != nil {
		t.Fatal(err)
	}
	removed := time.Now()
	waitFor(t, "the volume shown abnormal", func() bool {
		return len(h.scrape().find("csi_agent_volume_condition_abnormal", map[string]string{"plugin": "loop", "volume_id": "vol1"})) == 1 &&
			h.scrape().value("csi_agent_volume_condition_abnormal", labels) == 1
	})
	if took := time.Since(removed); took > 2*interval+time.Second {
		t.Errorf("abnormal shown after %v; the interval is %v", took, interval)
	}
	for _, v := range h.volumes() {
		if v.GetVolumeId() == "vol1" && v.GetStats().GetCondition() == "" {
			t.Errorf("no condition message: %v", v.GetStats())
		}
	}
	if err := os.Link(keep, image); err != nil && !errors.Is(err, os.ErrExist) {
		t.Fatal(err)
	}
	h.mustCleanup("c1")
	waitFor(t, "the volume's series gone", func() bool {
		return len(h.scrape().find("csi_agent_volume_stats_used_bytes", labels)) == 0
	})
	h.assertClean(pool)
}
