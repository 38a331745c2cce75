package loopplugin

import (
	"context"
	"log/slog"
	"maps"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"

	"github.com/csiagent/csiagent/internal/loopdev"
	"github.com/csiagent/csiagent/internal/testhelp"
)

func attachMode(c *Config) { c.NodeOnly = false }

// TestAttachLifecycle (attach mode): ControllerPublishVolume attaches the
// image (a device named in publish_context, answered again the same while
// attached); NodeStageVolume refuses without that publish_context and
// stages with it; NodeUnstageVolume leaves the device attached;
// ControllerUnpublishVolume refuses while staged and detaches after; a
// stale publish_context (detached since) is refused; the table's other
// codes: another node NotFound, another readonly AlreadyExists, a missing
// volume NotFound.
func TestAttachLifecycle(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo, attachMode)
	ctx := context.Background()
	id := e.createVolume(t, "att", 16<<20)
	img := filepath.Join(e.pool, id+".img")
	c := mountCap("ext4", snw)
	publish := func(node string, ro bool) (map[string]string, error) {
		r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: node, VolumeCapability: c, Readonly: ro})
		return r.GetPublishContext(), err
	}
	pc, err := publish("node-1", false)
	if err != nil {
		t.Fatal(err)
	}
	devs, err := loopdev.FindAll(img)
	if err != nil || len(devs) != 1 || pc[ContextDevice] != devs[0].Path {
		t.Fatalf("after the attach: devices %+v (%v), publish_context %v", devs, err, pc)
	}
	if again, err := publish("node-1", false); err != nil || !maps.Equal(again, pc) {
		t.Errorf("attaching again: %v, %v; want the same publish_context %v", again, err, pc)
	}
	_, err = publish("node-2", false)
	wantCode(t, err, codes.NotFound)
	_, err = publish("node-1", true)
	wantCode(t, err, codes.AlreadyExists)
	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "nope", NodeId: "node-1", VolumeCapability: c})
	wantCode(t, err, codes.NotFound)

	staging := filepath.Join(e.dir, "staging")
	stage := func(pc map[string]string) error {
		_, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc})
		return err
	}
	wantCode(t, stage(nil), codes.FailedPrecondition)
	if err := stage(pc); err != nil {
		t.Fatal(err)
	}
	_, err = e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"})
	wantCode(t, err, codes.FailedPrecondition)
	e.unstage(t, id, staging)
	if got, err := loopdev.FindAll(img); err != nil || len(got) != 1 || got[0].Path != pc[ContextDevice] {
		t.Fatalf("after unstage: devices %+v, %v; want the attachment kept", got, err)
	}
	// The plugin restarts: it holds the attachment again and answers the
	// same.
	e.p.held.release(devs[0].Name)
	if err := e.p.holdAttached(); err != nil {
		t.Fatal(err)
	}
	if again, err := publish("node-1", false); err != nil || !maps.Equal(again, pc) {
		t.Errorf("attaching after a restart: %v, %v; want %v", again, err, pc)
	}
	for range 2 { // idempotent
		if _, err := e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"}); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := loopdev.FindAll(img); err != nil || len(got) != 0 {
		t.Fatalf("after the detach: devices %+v, %v", got, err)
	}
	wantCode(t, stage(pc), codes.FailedPrecondition)
	if _, err := e.ctrl.DeleteVolume(ctx, &csi.DeleteVolumeRequest{VolumeId: id}); err != nil {
		t.Fatal(err)
	}
}

// TestAttachBlock (attach mode): a block volume is staged from the
// attached device, a read-only target gets a read-only device of its own
// (detached with its unpublish), and the attachment outlives the unstage.
func TestAttachBlock(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo, attachMode)
	ctx := context.Background()
	id := e.createVolume(t, "blk", 16<<20)
	img := filepath.Join(e.pool, id+".img")
	c := blockCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER)
	r, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: c})
	if err != nil {
		t.Fatal(err)
	}
	staging, rw, ro := filepath.Join(e.dir, "staging"), filepath.Join(e.dir, "rw"), filepath.Join(e.dir, "ro")
	if _, err := e.node.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: id, StagingTargetPath: staging, VolumeCapability: c, PublishContext: r.GetPublishContext()}); err != nil {
		t.Fatal(err)
	}
	e.publish(t, id, staging, rw, c, false)
	e.publish(t, id, staging, ro, c, true)
	if got, err := loopdev.FindAll(img); err != nil || len(got) != 2 {
		t.Fatalf("devices %+v, %v; want the attachment and a read-only one", got, err)
	}
	e.unpublish(t, id, ro)
	e.unpublish(t, id, rw)
	e.unstage(t, id, staging)
	if got, err := loopdev.FindAll(img); err != nil || len(got) != 1 || got[0].Path != r.GetPublishContext()[ContextDevice] {
		t.Fatalf("after unstage: devices %+v, %v; want the attachment only", got, err)
	}
	if _, err := e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"}); err != nil {
		t.Fatal(err)
	}
	if got, err := loopdev.FindAll(img); err != nil || len(got) != 0 {
		t.Fatalf("after the detach: devices %+v, %v", got, err)
	}
}

// TestAttachModeUnstagesEarlierStage: a volume staged by a release in
// node-only mode (the stage attached its device; no attachment record)
// is unstaged, device detached, by a plugin in attach mode.
func TestAttachModeUnstagesEarlierStage(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo)
	id := e.createVolume(t, "old", 16<<20)
	staging := filepath.Join(e.dir, "staging")
	e.stage(t, id, staging, mountCap("ext4", snw))
	e.p.nodeOnly = false // the upgrade
	e.unstage(t, id, staging)
	if got, err := loopdev.FindAll(filepath.Join(e.pool, id+".img")); err != nil || len(got) != 0 {
		t.Fatalf("after unstage: devices %+v, %v; want none", got, err)
	}
}

// TestNodeOnlyMode: without attach mode the controller does not offer
// PUBLISH_UNPUBLISH_VOLUME and refuses the calls (Unimplemented).
func TestNodeOnlyMode(t *testing.T) {
	e := newEnv(t, slog.LevelInfo)
	ctx := context.Background()
	caps, err := e.ctrl.ControllerGetCapabilities(ctx, &csi.ControllerGetCapabilitiesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range caps.GetCapabilities() {
		if c.GetRpc().GetType() == csi.ControllerServiceCapability_RPC_PUBLISH_UNPUBLISH_VOLUME {
			t.Errorf("node-only mode offers PUBLISH_UNPUBLISH_VOLUME")
		}
	}
	_, err = e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: "v", NodeId: "node-1", VolumeCapability: mountCap("", snw)})
	wantCode(t, err, codes.Unimplemented)
}

// TestAttachedIdleVolumeSnapshots: a volume attached by the controller
// but not staged (nothing mounted from its device) has nothing to
// quiesce: a group snapshot of it is taken, not refused as if it were
// staged for block access.
func TestAttachedIdleVolumeSnapshots(t *testing.T) {
	testhelp.NeedRoot(t)
	e := newEnv(t, slog.LevelInfo, attachMode)
	ctx := context.Background()
	a, b := e.createVolume(t, "ga", 16<<20), e.createVolume(t, "gb", 16<<20)
	for _, id := range []string{a, b} {
		if _, err := e.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: id, NodeId: "node-1", VolumeCapability: mountCap("", snw)}); err != nil {
			t.Fatal(err)
		}
	}
	r, err := e.group.CreateVolumeGroupSnapshot(ctx, &csi.CreateVolumeGroupSnapshotRequest{Name: "g", SourceVolumeIds: []string{a, b}})
	if err != nil {
		t.Fatalf("group snapshot of attached, unstaged volumes: %v", err)
	}
	var ids []string
	for _, s := range r.GetGroupSnapshot().GetSnapshots() {
		ids = append(ids, s.GetSnapshotId())
	}
	if _, err := e.group.DeleteVolumeGroupSnapshot(ctx, &csi.DeleteVolumeGroupSnapshotRequest{GroupSnapshotId: r.GetGroupSnapshot().GetGroupSnapshotId(), SnapshotIds: ids}); err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{a, b} {
		if _, err := e.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: id, NodeId: "node-1"}); err != nil {
			t.Fatal(err)
		}
	}
}
