package integration

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
)

// TestHookContainerGoneWhileAgentDown: a runc container given its volume
// by the OCI hooks ends while the agent is down, so its poststop hook
// fails; the agent, back, cleans it up by itself (its processes are gone:
// nothing is in its mount namespace) and unpublishes the volume, with no
// reconcile. Before, it stayed PREPARED, its volume published for good.
func TestHookContainerGoneWhileAgentDown(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	sweepOnExit(t, h)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "v")
	cfg := fastConfig(h)
	cfg.ResyncInterval = 100 * time.Millisecond
	h.start(cfg)
	h.waitPlugin("loop", "ready", ready)
	b := h.bundle(busybox, "gone", "echo up > /data/f && exec sleep 600",
		volumeSpec{plugin: "loop", id: "v", path: "/data", access: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER})
	// The poststop hook gives up after 1s while the agent is down.
	path := filepath.Join(b, "config.json")
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(raw, &spec); err != nil {
		t.Fatal(err)
	}
	post := spec["hooks"].(map[string]any)["poststop"].([]any)[0].(map[string]any)
	post["args"] = append(post["args"].([]any), "--timeout", "1s")
	if raw, err = json.Marshal(spec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, raw, 0o644); err != nil {
		t.Fatal(err)
	}
	runDetached(t, runc, b, "gone", "its write to the volume", func() bool {
		cs := h.containers()
		return len(cs) == 1 && cs[0].GetPhase().String() == "PREPARED"
	})

	h.halt()
	if out, err := exec.Command(runc, "delete", "--force", "gone").CombinedOutput(); err != nil {
		t.Logf("runc delete with the agent down: %v\n%s", err, out) // the poststop hook fails
	}
	h.launch(cfg)
	deadline := time.Now().Add(waitTimeout)
	for len(h.containers()) > 0 || len(h.volumes()) > 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the gone container was not cleaned up: containers %v, volumes %v", h.containers(), h.volumes())
		}
		time.Sleep(50 * time.Millisecond)
	}
}
