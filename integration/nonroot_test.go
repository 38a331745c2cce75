package integration

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestOCIHookNonRootWriter: a runc container running as uid 1000 writes to
// its fresh RW volume: the hook passes process.user, the agent gives the
// volume root to that user (only because it is fresh).
func TestOCIHookNonRootWriter(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "nonroot")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	bundle := h.bundle(busybox, "nonroot", "id -u; echo by-1000 > /data/file && echo WROTE",
		volumeSpec{plugin: "loop", id: "nonroot", path: "/data"})
	// Run the process as 1000:1000.
	cfgPath := filepath.Join(bundle, "config.json")
	b, err := os.ReadFile(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	spec["process"].(map[string]any)["user"] = map[string]int{"uid": 1000, "gid": 1000}
	if b, err = json.Marshal(spec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(cfgPath, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("busybox", filepath.Join(bundle, "rootfs", "bin", "id")); err != nil {
		t.Fatal(err)
	}
	out, errOut, err := runContainer(t, runc, bundle, "nonroot")
	if err != nil || !strings.Contains(out, "1000") || !strings.Contains(out, "WROTE") {
		t.Fatalf("non-root writer: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	h.assertClean(pool)
}
