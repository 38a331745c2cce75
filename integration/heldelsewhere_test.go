package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestHeldElsewhereNotGivenToSingleWriter: a host-mode container (root in
// its rootfs, CAP_SYS_ADMIN) binds its single-writer loop volume
// elsewhere in its own mount namespace and keeps running after its
// cleanup. The volume is not torn down (its loop device would detach
// lazily, the filesystem living on through the container's bind) and is
// not given to the next single-writer container: before, it was
// unpublished, unstaged and staged again for it, two live instances of
// one ext4 filesystem. Once the container is gone, a resync pass tears
// the volume down and the next Prepare gets it.
func TestHeldElsewhereNotGivenToSingleWriter(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	cfg := fastConfig(h)
	cfg.ResyncInterval = 100 * time.Millisecond
	h.start(cfg)
	h.waitPlugin("loop", "ready", ready)
	vol := volumeSpec{plugin: "loop", id: "v", path: "/data", access: csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER}

	rootfs := h.dir("rootfs-holder")
	h.mustPrepare("holder", "", rootfs, vol)
	// A host-mode container (its rootfs prepared by the agent, no hooks)
	// with CAP_SYS_ADMIN.
	b := h.busyboxBundle(busybox, "holder", rootfs,
		"busybox mkdir -p /elsewhere && busybox mount --bind /data /elsewhere && echo kept > /elsewhere/file && busybox sleep 600",
		func(spec map[string]any) {
			caps := []string{"CAP_SYS_ADMIN"}
			spec["process"].(map[string]any)["capabilities"] = map[string]any{"bounding": caps, "effective": caps, "permitted": caps}
		})
	runDetached(t, runc, b, "holder", "the bind of its volume elsewhere", func() bool {
		b, err := os.ReadFile(filepath.Join(rootfs, "data", "file"))
		return err == nil && string(b) == "kept\n"
	})

	h.mustCleanup("holder")
	if ms := mountsUnder(t, rootfs); len(ms) > 0 {
		t.Fatalf("left mounted in the rootfs after the cleanup: %v", ms)
	}
	vs := h.volumes()
	if len(vs) != 1 || len(vs[0].GetContainers()) > 0 || !strings.Contains(vs[0].GetLastError(), "/elsewhere in the mount namespace of pid") {
		t.Errorf("volumes after the cleanup: %v; want v kept, no users, its error naming the mount elsewhere", vs)
	}

	next := h.dir("rootfs-next")
	_, err := h.prepare("next", "", next, vol)
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "/elsewhere in the mount namespace of pid") {
		t.Fatalf("single-writer Prepare of the volume still mounted elsewhere: %v; want FailedPrecondition naming the mount", err)
	}
	// (That resync passes keep it while the mount lives is
	// TestUnitHeldElsewhereNotTornDown's, pass by pass.)

	if err := exec.Command(runc, "delete", "--force", "holder").Run(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(waitTimeout)
	for len(h.volumes()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the volume was not torn down once the container was gone: %v", h.volumes())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if devs := loopDevicesFor(t, pool); len(devs) > 0 {
		t.Errorf("loop devices left after the teardown: %v", devs)
	}

	h.mustPrepare("next", "", next, vol)
	if b, err := os.ReadFile(filepath.Join(next, "data", "file")); err != nil || string(b) != "kept\n" {
		t.Errorf("the next container reads %q, %v; want what the first wrote", b, err)
	}
	if vs := h.volumes(); len(vs) != 1 || vs[0].GetState() != agentv1.VolumeStatus_PUBLISHED || vs[0].GetLastError() != "" {
		t.Errorf("volumes: %v; want v published for the next container", vs)
	}
	h.mustCleanup("next")
	h.assertClean(pool)
}
