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

// TestExpandE2E (issue 25): an xfs volume in use by a container is grown
// by one ExpandVolume that names neither the plugin (the one publishing
// the volume here) nor anything but the new size: the loop plugin's
// controller grows its image (ControllerExpandVolume), then its node the
// device and the filesystem (NodeExpandVolume, with the capability the
// volume was staged with, xfs included). The container's mount sees the
// new size without a restart, its data intact. Before, the backend had to
// be grown by hand and the plugin named.
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
	conn := apiConn(t, h.cfg.APISocket)
	_, res, err := collect(agentv1.NewControllerClient(conn).ExpandVolume(opCtx(t), &agentv1.ExpandVolumeRequest{VolumeId: "grow", RequiredBytes: big, Retry: fast()}))
	if err != nil || !res.GetDone() || res.GetCapacityBytes() != big {
		t.Fatalf("ExpandVolume: %v, %v", res, err)
	}
	if st, err := os.Stat(filepath.Join(pool, "grow.img")); err != nil || st.Size() != big {
		t.Errorf("the image after the expansion: %v, %v; want %d bytes", st, err, big)
	}
	if after := size(); after < before+(big-small)*9/10 {
		t.Errorf("the container sees %d bytes before, %d after growing from %d to %d", before, after, small, big)
	}
	if b, err := os.ReadFile(filepath.Join(inContainer, "kept")); err != nil || string(b) != "kept" {
		t.Errorf("data after growing: %q, %v", b, err)
	}
	// Without a size, the backend cannot be grown.
	_, _, err = collect(agentv1.NewControllerClient(conn).ExpandVolume(context.Background(), &agentv1.ExpandVolumeRequest{VolumeId: "grow", Retry: fast()}))
	wantStatus(t, err, codes.InvalidArgument, "required_bytes is required")
	// A volume not published here: its plugin cannot be told.
	_, _, err = collect(agentv1.NewControllerClient(conn).ExpandVolume(context.Background(), &agentv1.ExpandVolumeRequest{VolumeId: "nope", RequiredBytes: big, Retry: fast()}))
	wantStatus(t, err, codes.InvalidArgument, "not published on this host")
	h.mustCleanup("c1")
	h.assertClean(pool)
}
