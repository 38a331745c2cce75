package integration

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestExpandE2E: an xfs volume in use by a container is grown on the
// backend (its image), then csi-agent's ExpandVolume grows it on the node;
// the container's mount sees the new size without a restart, its data
// intact.
func TestExpandE2E(t *testing.T) {
	testhelp.NeedRoot(t)
	const small, big = 320 << 20, 640 << 20 // xfs wants 300 MiB at least
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolumeSize(t, pool, "grow", "320MiB")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	sb := h.dir("sandbox")
	resp := h.mustPrepare("c1", sb, "", volumeSpec{plugin: "loop", id: "grow", path: "data", fsType: "xfs"})
	inContainer := resp.GetMounts()[0].GetMountPoint()
	if err := os.WriteFile(filepath.Join(inContainer, "kept"), []byte("kept"), 0o644); err != nil {
		t.Fatal(err)
	}
	size := func() int64 {
		var st unix.Statfs_t
		if err := unix.Statfs(inContainer, &st); err != nil {
			t.Fatal(err)
		}
		return int64(st.Blocks) * st.Bsize
	}
	before := size()
	if err := os.Truncate(filepath.Join(pool, "grow.img"), big); err != nil { // the backend grows it
		t.Fatal(err)
	}
	conn := apiConn(t, h.cfg.APISocket)
	_, res, err := collect(agentv1.NewControllerClient(conn).ExpandVolume(opCtx(t), &agentv1.ExpandVolumeRequest{PluginName: "loop", VolumeId: "grow", Retry: fast()}))
	if err != nil || !res.GetDone() || res.GetCapacityBytes() != big {
		t.Fatalf("ExpandVolume: %v, %v", res, err)
	}
	if after := size(); after < before+(big-small)*9/10 {
		t.Errorf("the container sees %d bytes before, %d after growing from %d to %d", before, after, small, big)
	}
	if b, err := os.ReadFile(filepath.Join(inContainer, "kept")); err != nil || string(b) != "kept" {
		t.Errorf("data after growing: %q, %v", b, err)
	}
	_, _, err = collect(agentv1.NewControllerClient(conn).ExpandVolume(context.Background(), &agentv1.ExpandVolumeRequest{PluginName: "loop", VolumeId: "nope", Retry: fast()}))
	wantStatus(t, err, codes.FailedPrecondition, "not published on this host")
	h.mustCleanup("c1")
	h.assertClean(pool)
}
