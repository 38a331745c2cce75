package agent

import (
	"bytes"
	"crypto/rand"
	"crypto/sha256"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"

	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestReplicationLoopPluginE2E drives replication through the daemon's
// API against two real csi-loop-plugins serving each other's pool as
// replica: enable, write through a container, demote, promote on the
// replica side; the images are identical and the replica serves the data.
func TestReplicationLoopPluginE2E(t *testing.T) {
	needRoot(t)
	h := newHarness(t)
	poolA, poolB := mkPool(t, filepath.Join(h.extra, "a")), mkPool(t, filepath.Join(h.extra, "b"))
	createVolume(t, poolA, "v")
	plugin := func(name, pool, replica string) string {
		sock := filepath.Join(h.run, name+".sock")
		cmd := exec.Command(bins.loop, "--endpoint", "unix://"+sock, "--pool", pool, "--replica-pool", replica, "--node-id", "node-1", "--name", name)
		cmd.Stderr = testWriter{t}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		})
		h.writeConfig(name+".json", `{"type":"`+name+`","endpoints":[`+
			`{"csi_service":"CONTROLLER_SERVICE","endpoint":"unix://`+sock+`"},`+
			`{"csi_service":"NODE_SERVICE","endpoint":"unix://`+sock+`"}]}`)
		return name
	}
	primary, replica := plugin("primary", poolA, poolB), plugin("replica", poolB, poolA)
	h.start(fastConfig(h))
	h.waitPlugin(primary, "ready", ready)
	h.waitPlugin(replica, "ready", ready)
	conn, err := grpc.NewClient("unix://"+h.a.cfg.APISocket, grpc.WithTransportCredentials(insecure.NewCredentials()),
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
