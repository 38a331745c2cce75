package integration

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// setDeviceRules sets linux.resources.devices of a bundle's config.json.
func setDeviceRules(t *testing.T, bundle string, rules []map[string]any) {
	t.Helper()
	path := filepath.Join(bundle, "config.json")
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var spec map[string]any
	if err := json.Unmarshal(b, &spec); err != nil {
		t.Fatal(err)
	}
	spec["linux"].(map[string]any)["resources"] = map[string]any{"devices": rules}
	if b, err = json.Marshal(spec); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestBlockVolumeDeviceCgroupRunc (issue 24, finding 5): a block volume
// given through the OCI hook to a runc container whose device cgroup
// denies it (runc's default: every device denied) fails at create with
// the rule to add, naming the device, and is undone; with that rule the
// container writes the device. Before, the hook succeeded and every open
// of the device in the container failed with EPERM.
func TestBlockVolumeDeviceCgroupRunc(t *testing.T) {
	runc, busybox := needRunc(t)
	h := newHarness(t)
	pool := h.loopPlugin("loop")
	createVolume(t, pool, "blk")
	h.start(fastConfig(h))
	h.waitPlugin("loop", "ready", ready)
	vol := volumeSpec{plugin: "loop", id: "blk", path: "/disk", block: true}
	script := "busybox dd if=/dev/zero of=/disk bs=4096 count=1 conv=fsync && echo WROTE"
	denyAll := map[string]any{"allow": false, "access": "rwm"}

	denied := h.bundle(busybox, "denied", script, vol)
	setDeviceRules(t, denied, []map[string]any{denyAll})
	out, errOut, err := runContainer(t, runc, denied, "denied")
	rule := regexp.MustCompile(`--device-cgroup-rule 'b (\d+):(\d+) rw'`).FindStringSubmatch(errOut)
	if err == nil || rule == nil || !strings.Contains(errOut, "block volume blk at /disk") || !strings.Contains(errOut, "linux.resources.devices") {
		t.Fatalf("a container whose device cgroup denies its block volume: %v\nstdout: %s\nstderr: %s\nwant a failed create naming the rule", err, out, errOut)
	}
	h.assertClean(pool)

	allowed := h.bundle(busybox, "allowed", script, vol)
	setDeviceRules(t, allowed, []map[string]any{denyAll, {"allow": true, "type": "b", "major": 7, "access": "rw"}})
	out, errOut, err = runContainer(t, runc, allowed, "allowed")
	if err != nil || !strings.Contains(out, "WROTE") {
		t.Fatalf("with the rule: %v\nstdout: %s\nstderr: %s", err, out, errOut)
	}
	h.assertClean(pool)
}
