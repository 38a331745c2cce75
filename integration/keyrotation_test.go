package integration

import (
	"strings"
	"testing"
	"time"

	"github.com/csiagent/csiagent/internal/testhelp"
	agentv1 "github.com/csiagent/csiagent/proto/agent/v1"
)

// TestScheduledKeyRotation: a plugin that offers csi-addons key rotation
// and whose config schedules it every second gets EncryptionKeyRotate on
// its published volume by the schedule (a second instance of the reclaim
// scheduler): counted, and the next run persisted with the volume and
// shown. (The loop plugin has no key to rotate: the test plugin serves
// the call.)
func TestScheduledKeyRotation(t *testing.T) {
	testhelp.NeedRoot(t)
	h := newHarness(t)
	h.writeConfig("t.json", strings.Replace(testPluginConfig("t", "--data-dir="+h.dir("data"), "--key-rotation"),
		`"type":"t"`, `"type":"t","csiagent":{"key_rotation":{"interval":"1s"}}`, 1))
	cfg := fastConfig(h)
	cfg.MetricsAddress = "127.0.0.1:0"
	h.start(cfg)
	h.mustPrepare("c", h.dir("sb"), "", volumeSpec{plugin: "t", id: "v", path: "d"})
	start := time.Now()
	v := h.waitVolume("v", "a key rotation run and its next one persisted", func(v *agentv1.VolumeStatus) bool {
		return v.NextKeyRotation != nil && v.NextKeyRotation.AsTime().After(start.Add(time.Second))
	})
	if next := v.NextKeyRotation.AsTime(); next.After(time.Now().Add(2 * time.Second)) {
		t.Errorf("next key rotation at %v: more than one interval away", next)
	}
	if n := h.scrape().value("csi_agent_scheduled_key_rotations_total", map[string]string{"plugin": "t", "code": "OK"}); n < 1 {
		t.Errorf("csi_agent_scheduled_key_rotations_total{code=OK} = %v; want >= 1", n)
	}
	h.mustCleanup("c")
	h.assertClean()
}
