package integration

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestReplicationLoopPluginE2E drives replication through the daemon's
// API against two real csi-loop-plugins serving each other's pool as
// replica: enable, write through a container, demote, promote on the
// replica side; the images are identical and the replica serves the data.
func TestReplicationLoopPluginE2E(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	poolA, poolB := mkPool(t, filepath.Join(h.extra, "a")), mkPool(t, filepath.Join(h.extra, "b"))
	createVolume(t, poolA, "v")
	plugin := func(name, pool, replica string) string {
		sock := filepath.Join(h.run, name+".sock")
		startUnmanaged(t, bins.loop, "--endpoint", "unix://"+sock, "--pool", pool, "--replica-pool", replica, "--node-id", "node-1", "--name", name)
		h.writeConfig(name+".json", `{"type":"`+name+`","endpoints":[`+
			`{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"},`+
			`{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"}]}`)
		return name
	}
	primary, replica := plugin("primary", poolA, poolB), plugin("replica", poolB, poolA)
	h.start(fastConfig(h))
	h.waitPlugin(primary, "ready", ready)
	h.waitPlugin(replica, "ready", ready)
	conn, err := grpc.NewClient("unix://"+h.cfg.APISocket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	c := agentv1.NewControllerClient(conn)
	req := func(plugin string) *agentv1.ReplicationRequest {
		return &agentv1.ReplicationRequest{PluginName: plugin, Source: &agentv1.ReplicationRequest_VolumeId{VolumeId: "v"}, Retry: fast()}
	}

	if _, _, err := collect(c.EnableReplication(opCtx(t), req(primary))); err != nil {
		t.Fatalf("enable: %v", err)
	}
	// Write through a container on the primary, then let it go.
	payload := make([]byte, 1<<20)
	if _, err := rand.Read(payload); err != nil {
		t.Fatal(err)
	}
	sb := h.dir("sb")
	h.mustPrepare("writer", sb, "", volumeSpec{plugin: primary, id: "v", path: "d"})
	if err := os.WriteFile(filepath.Join(sb, "d", "payload"), payload, 0o644); err != nil {
		t.Fatal(err)
	}
	h.mustCleanup("writer")
	// Resync is for a demoted side only.
	_, _, err = collect(c.ResyncVolume(opCtx(t), req(primary)))
	wantStatus(t, err, codes.FailedPrecondition, "")

	if _, _, err := collect(c.DemoteVolume(opCtx(t), req(primary))); err != nil {
		t.Fatalf("demote: %v", err)
	}
	if _, _, err := collect(c.PromoteVolume(opCtx(t), req(replica))); err != nil {
		t.Fatalf("promote on the replica side: %v", err)
	}
	sum := func(path string) [32]byte {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return sha256.Sum256(b)
	}
	if sum(filepath.Join(poolA, "v.img")) != sum(filepath.Join(poolB, "v.img")) {
		t.Fatal("the replica's image differs from the primary's after demote and promote")
	}
	_, info, err := collect(c.GetReplicationInfo(opCtx(t), req(replica)))
	if err != nil || info.GetInfo().GetLastSyncTime() == nil {
		t.Errorf("replication info on the new primary: %v, %v", info, err)
	}
	sb2 := h.dir("sb2")
	h.mustPrepare("reader", sb2, "", volumeSpec{plugin: replica, id: "v", path: "d"})
	got, err := os.ReadFile(filepath.Join(sb2, "d", "payload"))
	if err != nil || !bytes.Equal(got, payload) {
		t.Fatalf("the promoted replica does not serve the data: %v", err)
	}
	h.mustCleanup("reader")
	h.assertClean(poolA, poolB)
}

// TestGroupSnapshotWhileWritingE2E takes a group snapshot through the
// daemon while a container writes continuously to two volumes; both
// snapshots, restored with the plugin's CreateVolume, are clean ext4
// filesystems (e2fsck -fn) that mount.
func TestGroupSnapshotWhileWritingE2E(t *testing.T) {
	testhelp.NeedRoot(t)
	e2fsck, err := exec.LookPath("e2fsck")
	if err != nil {
		t.Fatalf("e2fsck is not installed: make deps installs e2fsprogs: %v", err)
	}
	h := newHarness(t)
	pool := mkPool(t, filepath.Join(h.extra, "pool"))
	createVolume(t, pool, "a")
	createVolume(t, pool, "b")
	sock := filepath.Join(h.run, "loop.sock")
	startLoopPlugin(t, sock, pool)
	h.writeConfig("loop.json", `{"type":"loop","endpoints":[`+
		`{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"},`+
		`{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"}]}`)
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	sb := h.dir("sb")
	h.mustPrepare("writer", sb, "", volumeSpec{plugin: "loop", id: "a", path: "a"}, volumeSpec{plugin: "loop", id: "b", path: "b"})

	// The container's writes: records appended to both volumes, in turn.
	stop, done, started := make(chan struct{}), make(chan error, 1), make(chan struct{})
	go func() {
		files := make([]*os.File, 2)
		for i, d := range []string{"a", "b"} {
			f, err := os.OpenFile(filepath.Join(sb, d, "log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
			if err != nil {
				done <- err
				return
			}
			defer f.Close()
			files[i] = f
		}
		record := bytes.Repeat([]byte("x"), 4095)
		for n := 0; ; n++ {
			select {
			case <-stop:
				done <- nil
				return
			default:
			}
			if _, err := files[n%2].Write(append(record, '\n')); err != nil {
				done <- err
				return
			}
			if n == 1 {
				close(started) // both logs exist and hold a record
			}
		}
	}()
	select {
	case <-started:
	case err := <-done:
		t.Fatalf("the container's writer failed: %v", err)
	}

	conn, err := grpc.NewClient("unix://"+h.cfg.APISocket, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	_, gs, err := collect(agentv1.NewControllerClient(conn).CreateGroupSnapshot(opCtx(t),
		&agentv1.CreateGroupSnapshotRequest{PluginName: "loop", Name: "while-writing", SourceVolumeIds: []string{"a", "b"}, Retry: fast()}))
	close(stop)
	if werr := <-done; werr != nil {
		t.Fatalf("the container's writer failed: %v", werr)
	}
	if err != nil || len(gs.GetGroupSnapshot().GetSnapshots()) != 2 {
		t.Fatalf("group snapshot: %v, %v", gs, err)
	}
	h.mustCleanup("writer")

	plugin, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer plugin.Close()
	ctrl := csi.NewControllerClient(plugin)
	for _, s := range gs.GetGroupSnapshot().GetSnapshots() {
		name := "restored-" + s.GetSourceVolumeId()
		if _, err := ctrl.CreateVolume(opCtx(t), &csi.CreateVolumeRequest{
			Name: name,
			VolumeCapabilities: []*csi.VolumeCapability{{
				AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
				AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
			}},
			VolumeContentSource: &csi.VolumeContentSource{Type: &csi.VolumeContentSource_Snapshot{
				Snapshot: &csi.VolumeContentSource_SnapshotSource{SnapshotId: s.GetSnapshotId()}}},
		}); err != nil {
			t.Fatalf("restore %s: %v", s.GetSnapshotId(), err)
		}
		if out, err := exec.Command(e2fsck, "-fn", filepath.Join(pool, name+".img")).CombinedOutput(); err != nil {
			t.Errorf("restored %s is not a clean filesystem: %v\n%s", name, err, out)
		}
		sb := h.dir("sb-" + name)
		h.mustPrepare("reader-"+name, sb, "", volumeSpec{plugin: "loop", id: name, path: "d"})
		if st, err := os.Stat(filepath.Join(sb, "d", "log")); err != nil || st.Size() == 0 {
			t.Errorf("restored log: %v, %v; want the records written before the snapshot", st, err)
		}
		h.mustCleanup("reader-" + name)
	}
	h.assertClean(pool)
}
