package integration

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/csiagent/csiagent/agent"
	"github.com/csiagent/csiagent/internal/atomicfile"
	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
	statev1 "github.com/csiagent/csiagent/proto/state/v1"
)

// allocated is a file's allocated bytes (st_blocks × 512), as du sees it.
func allocated(t *testing.T, path string) int64 {
	t.Helper()
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return st.Blocks * 512
}

// writeAndDelete writes n MiB through a container's mount point, flushes
// it to the image, and deletes it: blocks the filesystem no longer uses
// but the sparse image still holds.
func writeAndDelete(t *testing.T, dir string, mib int) {
	t.Helper()
	f, err := os.Create(filepath.Join(dir, "junk"))
	if err != nil {
		t.Fatal(err)
	}
	// An open file would keep the volume busy for the cleanup.
	defer f.Close()
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i*7 + 1)
	}
	for range mib {
		if _, err := f.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(filepath.Join(dir, "junk")); err != nil {
		t.Fatal(err)
	}
	syscall.Sync()
}

// reclaimNow runs an on-demand reclaim over the API and returns its
// messages.
func (h *harness) reclaimNow(req *agentv1.ReclaimSpaceRequest) ([]*agentv1.ReclaimSpaceProgress, error) {
	stream, err := h.api().ReclaimSpace(context.Background(), req)
	if err != nil {
		return nil, err
	}
	var out []*agentv1.ReclaimSpaceProgress
	for {
		msg, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, msg)
	}
}

// waitVolume waits, on the agent's change notifications, until the
// volume satisfies cond.
func (h *harness) waitVolume(id, what string, cond func(v *agentv1.VolumeStatus) bool) *agentv1.VolumeStatus {
	h.t.Helper()
	var found *agentv1.VolumeStatus
	h.waitPlugin("", what, func(*agentv1.Plugin) bool {
		found = nil
		for _, v := range h.volumes() {
			if v.VolumeId == id && cond(v) {
				found = v
			}
		}
		return found != nil
	})
	return found
}

// TestReclaimSpace: a container writes 64 MiB and deletes it; an
// on-demand reclaim gives the blocks back (the sparse image shrinks) and
// reports exactly what was freed; then the schedule does the same.
func TestReclaimSpace(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	config := func(interval string) string {
		return strings.Replace(managedConfig("loop", false, bins.loop, "csi-loop-plugin", "--pool="+pool),
			`"type":"loop"`, `"type":"loop","csiagent":{"reclaim_space":{"interval":"`+interval+`"}}`, 1)
	}
	h.writeConfig("loop.json", config("0"))
	createVolumeSize(t, pool, "thin", "256MiB")
	image := filepath.Join(pool, "thin.img")
	h.start(fastConfig(h))
	sb := h.dir("sb")
	h.mustPrepare("c", sb, "", volumeSpec{plugin: "loop", id: "thin", path: "d"})

	writeAndDelete(t, filepath.Join(sb, "d"), 64)
	before := allocated(t, image)
	msgs, err := h.reclaimNow(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_Volume{Volume: &agentv1.VolumeRef{VolumeId: "thin"}}})
	if err != nil || len(msgs) != 2 {
		t.Fatalf("on-demand reclaim: %v, %v", msgs, err)
	}
	after := allocated(t, image)
	res, sum := msgs[0].Result, msgs[1].Summary
	drop := before - after
	if drop < 48<<20 {
		t.Errorf("image allocation dropped by %d bytes, want >= 48 MiB (%d -> %d)", drop, before, after)
	}
	if d := res.BytesReclaimed - drop; d > 1<<20 || d < -(1<<20) {
		t.Errorf("agent reports %d bytes reclaimed, the image's allocation dropped by %d", res.BytesReclaimed, drop)
	}
	if res.BytesReclaimed != res.PreUsage-res.PostUsage || sum.BytesFreed != res.BytesReclaimed || sum.Volumes != 1 || sum.Failures != 0 {
		t.Errorf("result %v, summary %v", res, sum)
	}
	v := h.waitVolume("thin", "showing its last reclaim", func(v *agentv1.VolumeStatus) bool { return v.LastReclaim != nil })
	if v.LastReclaim.BytesReclaimed != res.BytesReclaimed || v.LastReclaim.Outcome != "ok" {
		t.Errorf("volume's last reclaim %v, want %v", v.LastReclaim, res)
	}

	// The schedule: a 1 s interval from the plugin's config.
	writeAndDelete(t, filepath.Join(sb, "d"), 64)
	before = allocated(t, image)
	first := v.LastReclaim.Start.AsTime()
	h.writeConfig("loop.json", config("1s"))
	v = h.waitVolume("thin", "reclaimed by the schedule", func(v *agentv1.VolumeStatus) bool {
		// Done when the run is recorded and the next one scheduled.
		return v.LastReclaim != nil && v.LastReclaim.Start.AsTime().After(first) && !v.Reclaiming &&
			v.NextReclaim != nil && v.NextReclaim.AsTime().After(v.LastReclaim.Start.AsTime())
	})
	if drop := before - allocated(t, image); drop < 48<<20 || v.LastReclaim.BytesReclaimed < 48<<20 {
		t.Errorf("scheduled reclaim: image dropped %d, reported %d", drop, v.LastReclaim.BytesReclaimed)
	}
	p := h.waitPlugin("loop", "counting reclaims", func(p *agentv1.Plugin) bool { return p.Reclaim.GetRuns() >= 2 })
	if !p.Reclaim.Scheduled || p.Reclaim.BytesReclaimed < 96<<20 {
		t.Errorf("plugin reclaim totals = %v", p.Reclaim)
	}
	h.mustCleanup("c")
	h.assertClean(pool)
}

// TestReclaimCancelledByCleanup: a reclaim is running when the volume's
// last container is cleaned up; the cleanup cancels it, and no reclaim is
// sent once the volume is unpublished.
func TestReclaimCancelledByCleanup(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	data := h.dir("plugin-data")
	h.writeConfig("t.json", testPluginConfig("slow", "--data-dir="+data, "--reclaim", "--reclaim-hang"))
	h.start(fastConfig(h))
	h.mustPrepare("c", h.dir("sb"), "", volumeSpec{plugin: "slow", id: "v", path: "d"})
	done := make(chan error, 1)
	go func() {
		_, err := h.reclaimNow(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}})
		done <- err
	}()
	h.waitVolume("v", "reclaiming", func(v *agentv1.VolumeStatus) bool { return v.Reclaiming })
	h.mustCleanup("c")
	if err := <-done; err != nil && status.Code(err) != codes.Canceled {
		t.Errorf("reclaim ended with %v", err)
	}
	h.assertClean()
	log, err := os.ReadFile(filepath.Join(h.work, "csi", "slow", "default", "logs", "container-0.stderr.log"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(log)
	unpub := strings.Index(text, "rpc /csi.v1.Node/NodeUnpublishVolume\n")
	if unpub < 0 {
		t.Fatalf("the plugin never saw NodeUnpublishVolume:\n%s", text)
	}
	if strings.Contains(text[unpub:], "rpc /reclaimspace.ReclaimSpaceNode/NodeReclaimSpace\n") {
		t.Errorf("NodeReclaimSpace was sent after the volume was unpublished:\n%s", text)
	}
}

// TestReclaimNotOffered: a plugin without the reclaim service is not
// scheduled, and says why.
func TestReclaimNotOffered(t *testing.T) {
	h := newHarness(t)
	h.writeConfig("t.json", testPluginConfig("plain"))
	cfg := fastConfig(h)
	cfg.ReclaimDefaults.Interval = agent.DefaultReclaimInterval
	h.start(cfg)
	p := h.waitPlugin("plain", "ready", ready)
	if p.Reclaim == nil || p.Reclaim.Scheduled || !strings.Contains(p.Reclaim.Reason, "does not offer reclaimspace.ReclaimSpaceNode") {
		t.Errorf("reclaim totals = %v", p.Reclaim)
	}
}

// TestFirstReclaimShownNotWritten: a volume never reclaimed has its first
// run at its slot after it was published; the API shows it, and nothing
// is written for it (the checkpoint gets next_reclaim from the first run).
func TestFirstReclaimShownNotWritten(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	h.writeConfig("t.json", testPluginConfig("thin", "--data-dir="+h.dir("plugin-data"), "--reclaim"))
	cfg := fastConfig(h)
	cfg.ReclaimDefaults.Interval = time.Hour
	h.start(cfg)
	before := time.Now()
	h.mustPrepare("c", h.dir("sb"), "", volumeSpec{plugin: "thin", id: "v", path: "d"})
	// The scheduler picks the volume up on its own goroutine, which
	// announces nothing: poll the API.
	var v *agentv1.VolumeStatus
	for deadline := time.Now().Add(waitTimeout); v == nil; time.Sleep(10 * time.Millisecond) {
		if vs := h.volumes(); len(vs) == 1 && vs[0].NextReclaim != nil {
			v = vs[0]
		} else if time.Now().After(deadline) {
			t.Fatalf("no next reclaim shown: %v", vs)
		}
	}
	if next := v.NextReclaim.AsTime(); !next.After(before) || next.After(before.Add(time.Hour+time.Second)) {
		t.Errorf("next reclaim %v; want within the hour after %v", next, before)
	}
	b, _, err := atomicfile.ReadRecord(h.work, filepath.Join(h.work, "csi", "thin", "default", "volumes", "v", "volume.state"))
	if err != nil {
		t.Fatal(err)
	}
	var cp statev1.VolumeCheckpoint
	if err := proto.Unmarshal(b, &cp); err != nil {
		t.Fatal(err)
	}
	if cp.NextReclaim != nil {
		t.Errorf("the first slot was checkpointed: %v", &cp)
	}
	h.mustCleanup("c")
}

// TestCleanupCancelsEveryReclaim: two on-demand reclaims of one volume
// (the plugin's cap allows two calls) while its plugin hangs in
// NodeReclaimSpace: only one runs, and the cleanup of the volume's last
// container cancels it and returns within 2 s.
func TestCleanupCancelsEveryReclaim(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	h.writeConfig("t.json", testPluginConfig("slow", "--data-dir="+h.dir("plugin-data"), "--reclaim", "--reclaim-hang"))
	cfg := fastConfig(h)
	cfg.ReclaimDefaults.MaxConcurrent = 2
	cfg.ReclaimDefaults.Timeout = 15 * time.Second // ends an uncancelled reclaim
	h.start(cfg)
	h.mustPrepare("c", h.dir("sb"), "", volumeSpec{plugin: "slow", id: "v", path: "d"})
	done := make(chan error, 2)
	reclaim := func() {
		_, err := h.reclaimNow(&agentv1.ReclaimSpaceRequest{Target: &agentv1.ReclaimSpaceRequest_All{All: true}})
		done <- err
	}
	go reclaim()
	h.waitVolume("v", "reclaiming", func(v *agentv1.VolumeStatus) bool { return v.Reclaiming })
	go reclaim()
	start := time.Now()
	h.mustCleanup("c")
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("cleanup took %v with reclaims running; want at most 2 s", d)
	}
	for range 2 {
		if err := <-done; err != nil && status.Code(err) != codes.Canceled {
			t.Errorf("reclaim ended with %v", err)
		}
	}
	h.assertClean()
}
